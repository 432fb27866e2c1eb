"""Engine.generate on the scheduler: continuous batching gives each request its solo tokens."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import mimo_fn as mf

CFG = mf.ModelConfig.tiny()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # per-prompt sampling on a GPU: graphs and uploads too


def test_scheduled_batch_equals_each_request_alone():
    params = mf.init_params(CFG, seed=2)
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 40, 9, 70, 1, 25, 17, 33]
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    # small pool and chunk: requests queue, long prompts are chunked, prefill and decode passes alternate
    small = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=192, page_size=4, chunk_size=16, max_batch=4))
    together = small.generate(prompts, max_new_tokens=10)
    assert len(small.state.cache.full.free) == small.state.cache.full.num_pages
    for p, out in zip(prompts, together):
        solo = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4)).generate([p], max_new_tokens=10)
        assert out.tokens == solo[0].tokens
        assert len(out.tokens) == 10


def test_stop_tokens_and_sampling_is_batch_independent():
    params = mf.init_params(CFG, seed=2)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]
    greedy = engine.generate(prompts, max_new_tokens=8)
    stop = greedy[1].tokens[2]
    cut = engine.generate(prompts, max_new_tokens=8, stop_token_ids=[stop])
    assert cut[1].tokens == greedy[1].tokens[:greedy[1].tokens.index(stop) + 1]
    assert cut[1].finish_reason == "stop" and greedy[1].finish_reason == "length"
    one = engine.generate(prompts, max_new_tokens=8, stop_token_ids=stop)  # one id, not in a list
    assert [o.tokens for o in one] == [o.tokens for o in cut]
    assert engine.generate(prompts, max_new_tokens=8, stop_token_ids=None)[1].tokens == greedy[1].tokens
    for bad in ("7", [stop, 2.0], 3.0, True):
        with pytest.raises(ValueError, match=r"stop_token_ids = .*; expected token ids \(ints\), or one int"):
            engine.generate(prompts, max_new_tokens=8, stop_token_ids=bad)
    assert cut[0].finish_reason == ("stop" if stop in greedy[0].tokens else "length")
    sp = mf.SamplingParams(temperature=1.0, seed=9)
    a = engine.generate(prompts, max_new_tokens=8, sampling=sp)
    b = engine.generate(prompts, max_new_tokens=8, sampling=sp)
    c = engine.generate(prompts[:1], max_new_tokens=8, sampling=sp)
    assert [o.tokens for o in a] == [o.tokens for o in b] and c[0].tokens == a[0].tokens


def test_bad_prompt_and_interrupted_call_leave_the_engine_usable():
    params = mf.init_params(CFG, seed=2)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=128, page_size=4, chunk_size=8))
    with pytest.raises(ValueError, match=r"prompt 1 holds token id 999, outside the vocabulary \[0, 128\)"):
        engine.generate([[1, 2], [3, 999]], max_new_tokens=4)
    for prompts, new, match in (("hello", 4, "prompts is a str; expected a list of prompts"),
                                ([1, 2, 3], 4, r"prompt 0 = 1; expected a list of token ids"),
                                ([[1, 2], [1.5, 2]], 4, r"prompt 1 holds 1.5; expected token ids \(ints\)"),
                                ([torch.tensor([1.0, 2.0])], 4, "prompt 0 is a torch.float32 tensor of shape"),
                                ([[1, 2]], 4.0, r"max_new_tokens = 4.0, expected a positive int or one per prompt"),
                                ([[1, 2]], True, r"max_new_tokens = True, expected a positive int")):
        with pytest.raises(ValueError, match=match):  # floats were truncated to ints, and 4.0 was a TypeError
            engine.generate(prompts, max_new_tokens=new)
    ints = engine.generate([[7, 8, 9], [3, 4]], max_new_tokens=3)
    others = engine.generate([np.array([7, 8, 9]), torch.tensor([3, 4])], max_new_tokens=np.int64(3))
    assert [o.tokens for o in others] == [o.tokens for o in ints]
    calls = {"n": 0}
    real = engine._launch_decode

    def flaky(*a, **kw):  # fail in the middle of decoding
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*a, **kw)

    engine._launch_decode = flaky
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=6)
    engine._launch_decode = real
    assert not engine.state.seqs and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    fresh = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=128, page_size=4, chunk_size=8))
    assert engine.generate([[7, 8, 9]], max_new_tokens=5)[0].tokens == fresh.generate([[7, 8, 9]], max_new_tokens=5)[0].tokens


def test_routed_experts_for_replay():
    """generate returns, per token fed to the model, the experts each MoE layer chose: the same
    as the router gives when the whole sequence is prefilled at once."""
    params = mf.init_params(CFG, seed=2)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2]]
    outs = engine.generate(prompts, max_new_tokens=5, return_routed_experts=True)
    num_moe = sum(CFG.is_moe(i) for i in range(CFG.num_layers))
    for p, o in zip(prompts, outs):
        seq = p + o.tokens[:-1]  # every token that went through the model
        assert o.routed_experts.shape == (len(seq), num_moe, CFG.top_k)
        state = mf.init_state(CFG, params, max_tokens=64, page_size=4)
        _, ref = mf.prefill(state, mf.Batch.from_tokens([0], [seq]), capture_experts=True)
        assert torch.equal(o.routed_experts.sort(-1).values, ref.routed_experts_TLK.sort(-1).values)


@pytest.mark.parametrize("sampling", [None, mf.SamplingParams(temperature=1.0, top_k=20, seed=3)])
def test_overlapped_decode_equals_step_by_step(sampling, monkeypatch):
    """EngineConfig.overlap launches each decode step before reading the step before's tokens
    back (they feed it on the device), so a request that draws a stop token runs once more and
    that token must be dropped. Tokens, log-probs and routed experts equal the engine that reads
    every step back at once, with requests queueing for a small pool, stop tokens, a long prompt
    chunked between decode passes, and different output lengths."""
    params = mf.init_params(CFG, seed=4)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 30, 2, 44, 11, 7]
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    fed = []  # per decode step: did its tokens come from the device, unread (Batch.sampled)?
    real_decode = mf.engine.passes.decode

    def spy(state, batch, **kw):
        fed.append(batch.sampled)
        return real_decode(state, batch, **kw)

    monkeypatch.setattr(mf.engine.passes, "decode", spy)
    outs, pools = {}, {}
    for overlap in (False, True):
        engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=160, page_size=4, chunk_size=16, max_batch=3,
                                                        overlap=overlap))
        plain = engine.generate(prompts, max_new_tokens=9, sampling=sampling)
        stops = sorted({o.tokens[3] for o in plain[:3]})  # requests stop at different steps
        fed.clear()
        outs[overlap] = engine.generate(prompts, max_new_tokens=9, sampling=sampling, stop_token_ids=stops,
                                        return_logprobs=True, return_routed_experts=True)
        pools[overlap] = (len(engine.state.cache.full.free), engine.state.cache.full.num_pages, dict(engine.state.seqs))
        assert any(fed) == overlap and (not overlap or not all(fed))  # the first step after a prefill reads the host
    assert pools[True][0] == pools[True][1] and not pools[True][2]  # the extra steps' pages came back too
    for a, b in zip(outs[False], outs[True]):
        assert a.tokens == b.tokens
        assert a.tokens[-1] in stops or len(a.tokens) == 9
        assert a.finish_reason == b.finish_reason == ("stop" if a.tokens[-1] in stops else "length")
        assert not any(t in stops for t in a.tokens[:-1])
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
        assert torch.equal(a.routed_experts, b.routed_experts)
    assert any(len(o.tokens) < 9 for o in outs[True])  # some requests did stop early


@pytest.mark.parametrize("mode", ["step_by_step", "overlap", "speculative"])
def test_max_new_tokens_per_prompt(mode):
    """One limit per prompt: each output has exactly its own count of tokens (no stop tokens
    here), and greedy tokens are the prefix of a run with one larger limit for all."""
    params = mf.init_params(CFG, seed=5)
    extra = {"step_by_step": {"overlap": False}, "overlap": {}, "speculative": {"num_draft_tokens": 3}}[mode]
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8, **extra))
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [9, 8], [5, 6, 7], [3, 3, 3, 3, 3]]
    limits = [1, 7, 3, 12]
    long = engine.generate(prompts, max_new_tokens=12)
    outs = engine.generate(prompts, max_new_tokens=limits)
    assert [len(o.tokens) for o in outs] == limits
    assert all(o.tokens == lo.tokens[:n] for o, lo, n in zip(outs, long, limits))
    assert len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    with pytest.raises(ValueError, match=r"3 max_new_tokens for 4 prompts"):
        engine.generate(prompts, max_new_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[2\] = 0, expected a positive int"):
        engine.generate(prompts, max_new_tokens=[1, 2, 0, 4])


@pytest.mark.parametrize("mode", ["step_by_step", "overlap", "speculative"])
def test_sampling_params_per_prompt(mode):
    """sampling=[...] gives each prompt its own params (None: greedy). Each prompt gets the tokens
    and log-probs it gets alone under its params with seed + its index (the seeding of one params
    for all), while requests of different params share decode and verify steps; one params
    repeated equals passing it once. A bad list is a ValueError that leaves the engine as it was."""
    params = mf.init_params(CFG, seed=6, device=DEVICE)
    extra = {"step_by_step": {"overlap": False}, "overlap": {}, "speculative": {"num_draft_tokens": 3}}[mode]
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=8, max_batch=4, **extra))
    prompts = [[5, 9, 3, 77, 1, 2], [3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 3], [9, 9], [4, 4, 4, 4, 4], [6, 1]]
    hot = mf.SamplingParams(temperature=1.5, seed=5)
    narrow = mf.SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=11)
    sps = [hot, None, narrow, mf.SamplingParams(temperature=0.0, seed=3), hot, narrow]
    outs = engine.generate(prompts, max_new_tokens=10, sampling=sps, return_logprobs=True)
    greedy = engine.generate(prompts, max_new_tokens=10)
    for i, (p, sp, o) in enumerate(zip(prompts, sps, outs)):
        own = None if sp is None else replace(sp, seed=sp.seed + i)
        alone = engine.generate([p], max_new_tokens=10, sampling=own, return_logprobs=True)[0]
        assert o.tokens == alone.tokens, (i, sp)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
        assert (o.tokens == greedy[i].tokens) == (i in (1, 3)), (i, sp)  # the sampled ones did sample
    once = engine.generate(prompts, max_new_tokens=10, sampling=hot)
    repeated = engine.generate(prompts, max_new_tokens=10, sampling=[hot] * 6)
    assert [o.tokens for o in repeated] == [o.tokens for o in once]
    for bad, match in (([hot] * 5, "5 sampling params for 6 prompts"),
                       ([hot, None, {"temperature": 1.0}, hot, hot, hot],
                        r"sampling\[2\] = \{'temperature': 1.0\}; expected a SamplingParams or None"),
                       ("greedy", "sampling = 'greedy'; expected None")):
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, max_new_tokens=10, sampling=bad)
    assert not engine.state.seqs and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    assert [o.tokens for o in engine.generate(prompts, max_new_tokens=10, sampling=sps)] == [o.tokens for o in outs]


def _shared_and_not(prompts, sps, monkeypatch, max_new_tokens=6, **config):
    """generate with share_prompts on and off: asserts both give each request the same tokens,
    log-probs (prompt and output) and routed experts, and free every page; returns the outputs
    with sharing, the prompt tokens the model ran {share: tokens}, and the forks {dst: src}."""
    ran, forks, real_prefill, real_fork = [], [], mf.engine.passes.prefill, mf.engine.passes.fork

    def prefill_spy(state, batch, **kw):
        ran.append(batch.num_tokens)
        return real_prefill(state, batch, **kw)

    def fork_spy(state, sources, upto=None):
        forks.append(dict(sources))
        return real_fork(state, sources, upto)

    monkeypatch.setattr(mf.engine.passes, "prefill", prefill_spy)
    monkeypatch.setattr(mf.engine.passes, "fork", fork_spy)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    outs, tokens_run = {}, {}
    for share in (False, True):
        ran.clear()
        engine = mf.Engine(CFG, params, mf.EngineConfig(**{"max_tokens": 2048, "page_size": 4, **config},
                                                        share_prompts=share))
        outs[share] = engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sps, return_logprobs=True,
                                      return_routed_experts=True)
        tokens_run[share] = sum(ran)
        assert not engine.state.seqs and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
        assert len(engine.state.cache.swa.free) == engine.state.cache.swa.num_pages
    prompt_of = dict(enumerate(prompts))  # and the sequences of held prompts (ids past the requests')
    for dst, src in (pair for f in forks for pair in f.items()):  # a src it does not know: a held prefix
        assert dst != src and (src not in prompt_of or prompt_of.setdefault(dst, prompt_of[src]) == prompt_of[src])
    for i, (o, want) in enumerate(zip(outs[True], outs[False])):
        assert o.tokens == want.tokens, i
        torch.testing.assert_close(torch.tensor(o.prompt_logprobs + o.logprobs),
                                   torch.tensor(want.prompt_logprobs + want.logprobs), rtol=0, atol=1e-5)
        assert torch.equal(o.routed_experts, want.routed_experts)
    return outs[True], tokens_run, forks


@pytest.mark.parametrize("mode", ["plain", "speculative", "bounded_swa"])
def test_identical_prompts_prefill_once(mode, monkeypatch):
    """n samples of a prompt (as GRPO draws them): once one holds the whole prompt, the others
    copy its K/V pages (mf.fork) instead of running it. Tokens, log-probs of prompt and output,
    and routed experts equal the engine that runs every prompt, with prompts that end mid-page,
    a batch cap that admits some copies passes later (after the earlier ones decoded: one runs
    the prompt again, the rest copy it), a one-token prompt, a long prompt chunked over passes,
    greedy and sampled requests."""
    from mimo_fn.cache import swa_pool_pages

    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (37, 11))
    long = torch.randint(0, CFG.vocab_size, (300,), generator=gen).tolist()
    prompts = [a, b, a, a, [5], b, a, [5], a, long, long]
    sp = mf.SamplingParams(temperature=1.0, seed=2)
    sps = [None, sp, sp, None, sp, None, sp, None, sp, sp, None]
    extra = {"plain": {}, "speculative": {"num_draft_tokens": 3},
             "bounded_swa": {"max_swa_tokens": 4 * swa_pool_pages(CFG, 4, 3, 128)}}[mode]  # 3 in flight
    outs, tokens_run, forks = _shared_and_not(prompts, sps, monkeypatch, chunk_size=128, max_batch=5, **extra)
    assert forks and tokens_run[True] < tokens_run[False]
    assert outs[0].tokens != outs[2].tokens  # one prompt, sampled apart


def test_many_copies_of_a_short_prompt(monkeypatch):
    """50 copies of a 10-token prompt in a 70-page pool (pages of 4, window 8): a copy shares the
    prompt's filled pages in both pools, so the sliding-window pool, as large as the full one,
    holds every copy the full pool admits (each holds 1 page of its own in it, not the 3 of
    the prompt's window)."""
    p = torch.randint(0, CFG.vocab_size, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = mf.SamplingParams(temperature=1.0, seed=1)
    outs, tokens_run, forks = _shared_and_not([p] * 50, [sp, None] * 25, monkeypatch, max_tokens=280, chunk_size=64,
                                              max_batch=64)
    assert tokens_run[True] < tokens_run[False] == 500 and sum(map(len, forks)) >= 40


def test_copies_admitted_later_fork_a_held_prompt(monkeypatch):
    """6 copies each of 4 prompts and a batch cap of 8: the copies are admitted a few at a time,
    as requests finish, long after their source has decoded. The prompt is held for them (a
    sequence of its own, forked when it is prefilled), so each prompt runs once."""
    gen = torch.Generator().manual_seed(6)
    distinct = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (40, 23, 40, 9)]
    prompts = [p for p in distinct for _ in range(6)]
    news = [2 + 5 * i % 13 for i in range(len(prompts))]
    sp = mf.SamplingParams(temperature=1.0, seed=4)
    _, tokens_run, forks = _shared_and_not(prompts, [sp, None, None] * 8, monkeypatch, news, chunk_size=64,
                                           max_batch=8)
    assert tokens_run[True] == 40 + 23 + 40 + 9 and tokens_run[False] == 6 * tokens_run[True]
    assert any(dst >= len(prompts) for f in forks for dst in f)  # forks into the held prompts' sequences


def test_held_prompts_give_way_to_a_request_they_would_starve(monkeypatch):
    """A held prompt keeps its pages while its copy waits behind a request that needs more
    pages than the rest of the pool: with nothing else in flight to give pages back, the engine
    lets the held prompt go (sched.let_go), the request runs, and the copy runs the prompt
    again. Pool of 100 pages of 4 tokens; prompt a needs 52 (200 + 6 tokens), c 77."""
    gen = torch.Generator().manual_seed(8)
    a, c = (torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (200, 300))
    _, tokens_run, forks = _shared_and_not([a, c, a], [None] * 3, monkeypatch, max_tokens=400, chunk_size=128)
    assert forks == [{3: 0}] and tokens_run[True] == tokens_run[False] == 700


@pytest.mark.parametrize("mode", ["plain", "speculative"])
def test_prompts_with_a_common_prefix_prefill_it_once(mode, monkeypatch):
    """Prompts that begin with the same 70 tokens (a system prompt; pages of 4): the engine
    prefills the shared 68 (17 whole pages) once, holds them, and each prompt forks them and
    prefills only its own rest, copies of a prompt included (they copy that prompt whole). A
    second group shares 14 tokens, 12 in whole pages: one of its prompts is those 14 and one
    more. Outputs equal the unshared engine's
    (_shared_and_not), with a batch cap that admits the group's prompts over several passes and a
    chunk smaller than the shared prefix."""
    gen = torch.Generator().manual_seed(9)
    rand = lambda n: torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    system, other = rand(70), rand(14)
    tails = [rand(n) for n in (5, 30, 1, 17)]
    prompts = [system + tails[0], other + rand(9), system + tails[1], system + tails[0], rand(20),
               system + tails[2], other + [7], system + tails[3], system + tails[0]]
    sp = mf.SamplingParams(temperature=1.0, seed=5)
    extra = {"plain": {}, "speculative": {"num_draft_tokens": 3}}[mode]
    outs, tokens_run, forks = _shared_and_not(prompts, [None, sp, sp] * 3, monkeypatch, chunk_size=32, max_batch=4,
                                              **extra)
    distinct = {tuple(p) for p in prompts}
    if mode == "plain":  # (verify steps run through prefill too)
        assert tokens_run[False] == sum(map(len, prompts))
        assert tokens_run[True] == 68 + 12 + sum(len(p) for p in distinct) - 4 * 68 - 2 * 12
    assert tokens_run[True] < tokens_run[False]
    prefixes = (len(prompts), len(prompts) + 1)  # the ids of the two prefixes' sequences
    assert sum(src in prefixes for f in forks for src in f.values()) == 4 + 2  # each distinct prompt forks one


def test_a_held_prefix_gives_way_to_a_request_it_would_starve(monkeypatch):
    """As a held prompt does (above): prompts a and b begin with the same 196 tokens, c needs 77
    of the pool's 100 pages (of 4 tokens). a forks the held prefix; once a is done the prefix's 49
    pages keep c from running with nothing in flight, so the engine lets it go, c runs, and b
    prefills its whole prompt."""
    gen = torch.Generator().manual_seed(8)
    system, c = (torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (196, 300))
    prompts = [system + [1, 2, 3, 4], c, system + [5, 6, 7, 8]]
    _, tokens_run, forks = _shared_and_not(prompts, [None] * 3, monkeypatch, max_tokens=400, chunk_size=128)
    assert forks == [{0: 3}] and tokens_run[True] == 196 + 4 + 300 + 200 and tokens_run[False] == 700


@pytest.mark.parametrize("pools", ["large", "tight_kv", "tight_swa"])
def test_copies_of_a_long_prompt_prefill_once(pools, monkeypatch):
    """Copies of a prompt longer than a chunk: the first prefills it over three passes, and the
    copies are admitted in the pass that finishes it, spending no chunk budget, and take its
    K/V. "tight_kv": 100 pages, where each request needs 77 (prompt and output): the copies fit
    only as they hold the prompt's pages in common (2 pages of their own each). "tight_swa": a
    sliding-window pool that holds two sequences in flight, 40 pages (a 128-token prefill pass's
    32 and 4 for each: swa_pool_pages), fewer than the prompt's 75: a copy takes only the pages
    inside the window; the third copy finds no slot until both
    have finished, so it prefills the prompt itself."""
    from mimo_fn.cache import swa_pool_pages

    gen = torch.Generator().manual_seed(4)
    long, short = (torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (300, 9))
    pool = {"large": {}, "tight_kv": {"max_tokens": 400},
            "tight_swa": {"max_swa_tokens": 4 * swa_pool_pages(CFG, 4, 2, 128)}}[pools]
    sp = mf.SamplingParams(temperature=1.0, seed=5)
    outs, tokens_run, forks = _shared_and_not([long, long, short, long], [None, sp, sp, sp], monkeypatch,
                                              chunk_size=128, **pool)
    assert tokens_run[False] == 3 * 300 + 9
    if pools != "tight_swa":
        assert forks == [{1: 0, 3: 0}] and tokens_run[True] == 300 + 9
    else:
        assert forks == [{1: 0}] and tokens_run[True] == 2 * 300 + 9
    assert outs[1].tokens != outs[3].tokens
