"""The online engine: add_request / step / abort / flush_cache, one code path with generate.

Requests that arrive while others decode get what they get alone (fp32), step() hands out each
token once, an abort gives every page back at once and leaves the others' outputs unchanged,
flush_cache waits for requests in flight, and nothing stays behind when every request is done."""

import pytest
import torch

import mimo_fn as mf

CFG = mf.ModelConfig.tiny()
PARAMS = mf.init_params(CFG, seed=2)
STOP = 7


def _prompts(n, seed=0, lo=3, hi=40):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(0, CFG.vocab_size, (m,), generator=gen).tolist() for m in lengths]


def _engine(**kw):
    return mf.Engine(CFG, PARAMS, mf.EngineConfig(**{"max_tokens": 512, "page_size": 4, "chunk_size": 16,
                                                     "max_batch": 4, **kw}))


def _drain(engine, outs=None):
    """step() until nothing is left; every RequestOutput by rid."""
    outs = {} if outs is None else outs
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    return outs


def _clean(engine):
    """Nothing held: every page free, no request records left."""
    assert not engine.has_unfinished()
    assert not engine.state.seqs and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    assert not engine._live and not engine._copies.held


def test_requests_arriving_while_others_decode_get_their_solo_result():
    prompts = _prompts(6)
    limits = [9, 4, 12, 6, 8, 5]
    sp = mf.SamplingParams(temperature=1.0, top_k=20, seed=5)
    sampling = [None, sp, None, None, sp, None]
    engine = _engine()
    rids, outs = [], {}
    for i, p in enumerate(prompts):  # one more request every two passes: they join a batch mid-decode
        rids.append(engine.add_request(p, max_new_tokens=limits[i], sampling=sampling[i], return_logprobs=True,
                                       return_routed_experts=True, stop_token_ids=[STOP]))
        for _ in range(2):
            for o in engine.step():
                outs.setdefault(o.rid, []).append(o)
    _drain(engine, outs)
    _clean(engine)
    for i, rid in enumerate(rids):
        solo = _engine().generate([prompts[i]], max_new_tokens=limits[i], sampling=sampling[i] and [sampling[i]],
                                  return_logprobs=True, return_routed_experts=True, stop_token_ids=[STOP])[0]
        steps = outs[rid]
        assert [o.finished for o in steps] == [False] * (len(steps) - 1) + [True]
        final = steps[-1].output
        assert sum((o.tokens for o in steps), []) == final.tokens == solo.tokens
        assert sum((o.logprobs for o in steps), []) == final.logprobs
        assert final.finish_reason == solo.finish_reason == steps[-1].finish_reason
        torch.testing.assert_close(torch.tensor(final.prompt_logprobs + final.logprobs),
                                   torch.tensor(solo.prompt_logprobs + solo.logprobs), rtol=0, atol=1e-5)
        assert torch.equal(final.routed_experts.sort(-1).values, solo.routed_experts.sort(-1).values)


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding"])
def test_abort_frees_pages_at_once_and_leaves_the_others_alone(where):
    prompts = _prompts(4, seed=1, lo=20, hi=40)
    engine = _engine(max_batch=2 if where == "waiting" else 4)
    rids = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    victim = rids[3] if where == "waiting" else rids[0]
    outs = {}
    steps = {"waiting": 1, "prefilling": 1, "decoding": 5}[where]
    for _ in range(steps):
        for o in engine.step():
            outs.setdefault(o.rid, []).append(o)
    held = engine.server_info()["num_used_pages"]
    assert engine.abort(victim)
    assert not engine.abort(victim) and not engine.abort(12345)
    after = engine.server_info()["num_used_pages"]
    assert after < held or where == "waiting"
    assert victim not in engine.state.seqs
    _drain(engine, outs)
    _clean(engine)
    assert outs[victim][-1].finish_reason == "abort" and outs[victim][-1].output.finish_reason == "abort"
    for rid, p in zip(rids, prompts):
        if rid != victim:
            assert outs[rid][-1].output.tokens == _engine().generate([p], max_new_tokens=8)[0].tokens


def test_generate_runs_beside_requests_added_before():
    """generate is the same step loop: a request added before it runs alongside, its outputs kept
    for the next step()."""
    prompts = _prompts(3, seed=2)
    engine = _engine()
    rid = engine.add_request(prompts[0], max_new_tokens=20)
    engine.step()
    got = engine.generate(prompts[1:], max_new_tokens=5)
    assert [o.tokens for o in got] == [o.tokens for o in _engine().generate(prompts[1:], max_new_tokens=5)]
    outs = _drain(engine)
    assert outs[rid][-1].output.tokens == _engine().generate(prompts[:1], max_new_tokens=20)[0].tokens
    _clean(engine)


def test_flush_cache_waits_for_requests_in_flight():
    prompts = _prompts(2, seed=3, lo=20, hi=30)
    engine = _engine(prefix_cache=True)
    engine.generate(prompts[:1], max_new_tokens=3)
    assert len(engine.prefix_cache) == 1
    rid = engine.add_request(prompts[1], max_new_tokens=6)
    assert not engine.flush_cache(timeout=0)  # in flight: nothing emptied
    assert len(engine.prefix_cache) == 1 and engine.has_unfinished()
    assert engine.flush_cache(timeout=60)
    assert len(engine.prefix_cache) == 0
    outs = engine.step()  # the request ran to its end inside flush_cache; its outputs come now
    assert sum((o.tokens for o in outs if o.rid == rid), []) == outs[-1].output.tokens
    assert outs[-1].output.tokens == _engine().generate(prompts[1:], max_new_tokens=6)[0].tokens
    assert not engine.has_unfinished()


def test_bad_requests_are_refused_whole():
    engine = _engine()
    good = engine.add_request([1, 2, 3], max_new_tokens=3)
    for kw, match in (({"prompt": []}, "add_request: prompt is empty"),
                      ({"prompt": [1, 999]}, r"add_request: prompt holds token id 999, outside the vocabulary"),
                      ({"prompt": "hi"}, "add_request: prompt = 'hi'; expected a list of token ids"),
                      ({"prompt": [1], "max_new_tokens": 0}, "add_request: max_new_tokens = 0"),
                      ({"prompt": [1] * 600}, r"add_request: .*exceeds the KV capacity"),
                      ({"prompt": [1], "stop_token_ids": ["a"]}, "add_request: stop_token_ids")):
        with pytest.raises(ValueError, match=match):
            engine.add_request(**kw)
    assert engine._st.request_ids() == [good]
    outs = _drain(engine)
    assert list(outs) == [good]
    assert outs[good][-1].output.tokens == _engine().generate([[1, 2, 3]], max_new_tokens=3)[0].tokens
    _clean(engine)


def test_server_info_counts_requests_and_pages():
    engine = _engine(max_batch=1)
    info = engine.server_info()
    assert info["num_used_pages"] == 0 and info["num_free_pages"] == info["num_total_pages"] == 128
    assert info["avg_spec_accept_length"] is None
    a, b = engine.add_request([1] * 10, max_new_tokens=4), engine.add_request([2] * 10, max_new_tokens=4)
    engine.step()
    info = engine.server_info()
    assert (info["num_running_reqs"], info["num_waiting_reqs"]) == (1, 1)
    assert info["num_used_pages"] == 3  # 10 tokens of 4 a page
    _drain(engine)
    assert engine.server_info()["num_used_pages"] == 0
    spec = _engine(num_draft_tokens=3)
    spec.generate([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=12)
    stats = spec.spec_stats()
    assert spec.server_info()["avg_spec_accept_length"] == stats["mean_accept_length"] == (
        stats["accepted"] + stats["verified"]) / stats["verified"]
    spec.generate([[1, 2, 3]], max_new_tokens=4)  # the server's figure counts every call since the start
    assert spec.server_info()["avg_spec_accept_length"] != spec.spec_stats()["mean_accept_length"]


def test_warmup_leaves_nothing_behind():
    engine = _engine(prefix_cache=True, chunk_size=32)
    engine.warmup()
    _clean(engine)
    assert len(engine.prefix_cache) == 0
    assert engine.generate([[4, 5, 6]], max_new_tokens=4)[0].tokens == _engine().generate([[4, 5, 6]],
                                                                                         max_new_tokens=4)[0].tokens
