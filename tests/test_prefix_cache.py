"""The prefix cache across generate calls (EngineConfig.prefix_cache, mimo_fn.engine.prefix_cache): a
later prompt that begins with some of a finished request's tokens forks their K/V, and every
output equals the engine without the cache."""

import pytest
import torch

import mimo_fn as mf
from mimo_fn.engine import prefix_cache
from mimo_fn.engine.prefix_cache import PrefixCache

CFG = mf.ModelConfig.tiny()  # sliding window 8; pages of 4 below
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(gen, n):
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


class _Spy:
    """Counts the prompt tokens the model runs (mf.engine.passes.prefill's batches)."""

    def __init__(self, monkeypatch):
        self.tokens, real = 0, mf.engine.passes.prefill

        def prefill(state, batch, **kw):
            self.tokens += batch.num_tokens
            return real(state, batch, **kw)

        monkeypatch.setattr(mf.engine.passes, "prefill", prefill)


def _assert_same(outs, want):
    for i, (o, w) in enumerate(zip(outs, want, strict=True)):
        assert o.tokens == w.tokens and o.finish_reason == w.finish_reason, i
        if w.logprobs is not None:
            torch.testing.assert_close(torch.tensor(o.prompt_logprobs + o.logprobs),
                                       torch.tensor(w.prompt_logprobs + w.logprobs), rtol=0, atol=1e-5)
        if w.routed_experts is not None:
            assert torch.equal(o.routed_experts, w.routed_experts), i


def _pages_balance(engine):
    """Every page is free or held by the cache's entries (nothing else lives between calls), which
    hold every sliding-window page of their tokens, or with a bounded sliding-window pool those
    that forks at their Entry.forks read, and no more than the pool leaves them."""
    cache, entries = engine.state.cache, engine.prefix_cache.entries
    bounded = engine.prefix_cache.swa_slack is not None
    assert set(engine.state.seqs) == set(entries) and len(entries) <= engine.prefix_cache.max_entries
    for kind in ("full", "swa"):
        pool = getattr(cache, kind)
        held = {p for s in engine.state.seqs.values() for p in getattr(s, kind)} - ({-1} if bounded else set())
        assert -1 not in held and len(pool.free) + len(held) == pool.num_pages, kind
        assert len(set(pool.free) | held) == pool.num_pages, kind
    page = cache.page_size
    for seq, e in entries.items():  # a fork of n tokens reads pages (n - W + 1) // P .. ceil(n / P) - 1
        swa = engine.state.seqs[seq].swa
        assert e.forks and all(0 <= lo <= hi <= e.length for lo, hi in e.forks)
        assert all(p >= 0 for lo, hi in e.forks for p in swa[max(0, lo - cache.window + 1) // page:-(-hi // page)])
        assert bounded or e.forks == ((0, e.length),)
    if bounded:  # entries hold no more than the pool leaves beside the requests in flight and a prefill pass
        per_seq, entry = PrefixCache.swa_pages(CFG, page, cache.swa_slack, engine.config.num_draft_tokens + 1)
        assert engine.sched_config.max_running_requests * per_seq + engine.prefix_cache.max_entries * entry + (
            -(-engine.config.chunk_size // page)) <= cache.swa.num_pages
        assert all(sum(p >= 0 for p in engine.state.seqs[s].swa) <= entry for s in entries)


@pytest.mark.parametrize("mode", ["plain", "speculative", "no_overlap", "bounded", "bounded_speculative"])
def test_each_turn_forks_the_turn_before(mode, monkeypatch):
    """Three multi-turn conversations, three turns each (the next prompt is the last prompt, its
    answer and a new message), greedy and sampled, one of them twice (copies, as GRPO draws),
    stop tokens, chunks shorter than the history: from turn 2 each prompt forks the whole pages of
    the turn before (all of its K/V: the last prompt and answer, less the last token) and prefills
    the rest, also with a bounded sliding-window pool (the entry's last window is all a turn needs).
    Tokens, log-probs (prompt and output) and routed experts equal an engine without the cache;
    between calls only the entries hold pages, one entry per conversation (a turn's entry holds
    the turn before's), and with the bounded pool the turns before too, as many as it leaves room
    for."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    extra = {"plain": {}, "speculative": {"num_draft_tokens": 3}, "no_overlap": {"overlap": False},
             # 64 pages: a prefill pass's 8, 2 requests of 7 and 7 entries of 6 (speculative: 2 of 8, 5 of 7)
             "bounded": {"max_swa_tokens": 256},
             "bounded_speculative": {"max_swa_tokens": 256, "num_draft_tokens": 3}}[mode]
    config = dict(max_tokens=2048, page_size=4, chunk_size=32, max_batch=3, **extra)
    cached = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, **config))
    plain = mf.Engine(CFG, params, mf.EngineConfig(**config))
    sp = mf.SamplingParams(temperature=1.0, seed=4)
    talks = [_rand(gen, n) for n in (37, 50, 9)]
    talks.append(list(talks[0]))  # a copy of the first conversation: its own samples
    sps = [None, sp, None, sp]
    kw = dict(max_new_tokens=[9, 6, 12, 9], sampling=sps, return_logprobs=True, return_routed_experts=True,
              stop_token_ids=[3])
    for turn in range(3):
        spy.tokens = 0
        want = plain.generate(talks, **kw)
        ran_plain, spy.tokens = spy.tokens, 0
        outs = cached.generate(talks, **kw)
        _assert_same(outs, want)
        _pages_balance(cached)
        if "speculative" not in mode:  # (verify steps run through prefill too)
            assert (spy.tokens < ran_plain) == (turn > 0)
            if turn:  # the new message and the last answer's last token
                assert spy.tokens == sum(len(m) + 1 for m in news)
        if turn:  # every prompt forks the turn before (copies included: each has its own answer)
            assert cached.prefix_stats["hits"] == 4
            assert cached.prefix_stats["tokens"] == sum(len(t) - 1 - len(m) for t, m in zip(talks, news))
        kept = sorted(tuple(e.tokens) for e in cached.prefix_cache.entries.values())
        this_turn = sorted(tuple(t + o.tokens) for t, o in zip(talks, outs))
        if "bounded" in mode:  # and the turns before, least recently used first, up to max_entries
            assert set(this_turn) <= set(kept) and len(kept) == min(cached.prefix_cache.max_entries, 4 + 4 * turn)
        else:
            assert kept == this_turn
        news = [_rand(gen, 5 + 3 * i) for i in range(4)]
        talks = [t + o.tokens + m for t, o, m in zip(talks, outs, news)]


def test_entries_keep_the_outputs_their_call_returned(monkeypatch):
    """An entry made without log-probs or routed experts serves only requests that ask for none;
    then the call that asked for them makes the entry that serves them."""
    gen = torch.Generator().manual_seed(12)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4, prefix_cache=True))
    ref = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4))
    first = _rand(gen, 30)
    out = engine.generate([first], max_new_tokens=6)
    talk = first + out[0].tokens + _rand(gen, 4)
    longer = talk + ref.generate([talk], max_new_tokens=1)[0].tokens  # forks the entry the calls on talk leave
    for prompt, logprobs, experts, hit in ((talk, True, False, False), (talk, False, True, False),
                                           (talk, False, False, True), (talk, True, True, False),
                                           (longer, True, True, True), (longer, False, False, True)):
        got = engine.generate([prompt], max_new_tokens=3, return_logprobs=logprobs, return_routed_experts=experts)
        assert (engine.prefix_stats["hits"] == 1) == hit, (len(prompt), logprobs, experts)
        _assert_same(got, ref.generate([prompt], max_new_tokens=3, return_logprobs=logprobs,
                                       return_routed_experts=experts))
    # each entry went once one with its tokens and outputs, and more, was added (the first call's at the
    # first call on talk, the entries of talk's calls at the call with both outputs, that one's at the
    # first call on longer): one is left, longer's 43 tokens of K/V with both outputs
    (e,) = engine.prefix_cache.entries.values()
    assert e.length == len(longer) + 2 and e.logprobs is not None and e.experts is not None


def test_entries_give_way_to_requests_that_need_their_pages(monkeypatch):
    """A 64-page pool (pages of 4): four conversations leave an entry of each finished request (11
    pages). A request that needs 42 pages waits; the engine lets entries go least recently used
    first (not the one this call's other prompt forks, which is held for it) until it fits: two
    (22 pages). The request runs, and once it is an entry too the other prompt needs 3 pages: the
    third entry goes. Outputs equal the engine without the cache; the entry the other prompt forked
    goes at the end of the call (its own entry holds all of it)."""
    gen = torch.Generator().manual_seed(13)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    config = dict(max_tokens=256, page_size=4, chunk_size=64)
    engine = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, **config))
    ref = mf.Engine(CFG, params, mf.EngineConfig(**config))
    talks = [_rand(gen, 40) for _ in range(4)]
    outs = engine.generate(talks, max_new_tokens=5)
    assert sorted(e.length for e in engine.prefix_cache.entries.values()) == [44] * 4
    used = engine.prefix_cache.match(talks[1] + outs[1].tokens + [1], False, False)[0].seq  # touched: most recent
    big, follow = _rand(gen, 160), talks[2] + outs[2].tokens + [9, 9]
    prompts = [big, follow]
    got = engine.generate(prompts, max_new_tokens=6)
    _assert_same(got, ref.generate(prompts, max_new_tokens=6))
    assert engine.prefix_stats["hits"] == 1  # follow forked its entry
    _pages_balance(engine)
    # big's entry (id 4) and follow's (5), which holds all of 2's
    assert sorted(engine.prefix_cache.entries) == [4, 5] and used == 1


def test_the_same_prompts_again_fork_their_prompts(monkeypatch):
    """GRPO groups drawn again with the same weights (more samples of the same prompts, as dynamic
    sampling asks): each distinct prompt forks an entry its samples left and prefills only its last
    token; its copies copy it. Outputs equal the engine without the cache."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(15)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4, prefix_cache=True))
    ref = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4))
    prompts = [p for p in (_rand(gen, 30), _rand(gen, 17)) for _ in range(4)]
    sp = mf.SamplingParams(temperature=1.0, seed=8)
    engine.generate(prompts, max_new_tokens=6, sampling=sp, return_logprobs=True)
    spy.tokens = 0
    got = engine.generate(prompts, max_new_tokens=6, sampling=mf.SamplingParams(temperature=1.0, seed=9),
                          return_logprobs=True)
    assert engine.prefix_stats == {"hits": 2, "tokens": 29 + 16} and spy.tokens == 2
    _assert_same(got, ref.generate(prompts, max_new_tokens=6, sampling=mf.SamplingParams(temperature=1.0, seed=9),
                                   return_logprobs=True))


def test_weight_sync_and_memory_release_empty_the_cache():
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, prefix_cache=True))
    prompt = list(range(1, 30))
    out = engine.generate([prompt], max_new_tokens=4)
    assert len(engine.prefix_cache) == 1 and engine.state.seqs  # the request's
    engine.release_memory(["kv_cache"])
    assert not engine.prefix_cache.entries and not engine.state.seqs
    engine.resume_memory()
    engine.generate([prompt], max_new_tokens=4)
    assert engine.prefix_stats["hits"] == 0 and len(engine.prefix_cache) == 1
    engine.generate([prompt], max_new_tokens=4)  # the same prompt again forks all but its last token
    assert engine.prefix_stats == {"hits": 1, "tokens": 28}
    with pytest.raises(ValueError, match="unknown weight 'model.nope'"):  # bad input: the cache stays
        engine.update_weights({"model.norm.weight": torch.ones(CFG.hidden_size), "model.nope": torch.ones(3)})
    assert len(engine.prefix_cache) == 1 and engine.state.seqs
    engine.update_weights({"model.norm.weight": torch.ones(CFG.hidden_size)})
    assert not engine.prefix_cache.entries and len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    again = engine.generate([prompt + out[0].tokens + [1]], max_new_tokens=4)
    assert engine.prefix_stats["hits"] == 0 and len(again[0].tokens) == 4


def test_a_group_prefix_forks_an_entry(monkeypatch):
    """Two prompts continue the same conversation with one long shared message, then their own:
    the group's prefix (rule 6 of the adder) forks the conversation's entry, and each prompt forks
    the group's prefix. Outputs equal the engine without the cache."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(14)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4, prefix_cache=True))
    ref = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4))
    talk = _rand(gen, 33)
    talk += engine.generate([talk], max_new_tokens=8, return_logprobs=True,
                            return_routed_experts=True)[0].tokens  # an entry of 40 tokens
    shared = talk + _rand(gen, 30)
    prompts = [shared + _rand(gen, 5), shared + _rand(gen, 7)]
    spy.tokens = 0
    got = engine.generate(prompts, max_new_tokens=5, return_logprobs=True, return_routed_experts=True)
    assert engine.prefix_stats == {"hits": 1, "tokens": 40}
    assert spy.tokens == (len(shared) // 4 * 4 - 40) + sum(len(p) - len(shared) // 4 * 4 for p in prompts)
    _assert_same(got, ref.generate(prompts, max_new_tokens=5, return_logprobs=True, return_routed_experts=True))


def test_prefix_cache_config_errors():
    params = mf.init_params(CFG, seed=7)
    with pytest.raises(ValueError, match=r"prefix_cache with max_swa_tokens = 60: the sliding-window pool holds 15 "
                                         r"pages of 4 tokens, fewer than one request in flight \(7: its window, "
                                         r"slack 1 and a step's tokens, and the window kept at its prompt's end\), "
                                         r"two entries \(6 each\) and a 16-token prefill pass need: give it at "
                                         r"least 92 tokens"):
        mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, max_swa_tokens=60, page_size=4, chunk_size=16,
                                               prefix_cache=True))

    class Hidden:
        target_layers = (1,)

        def propose(self, rid, tokens, k):
            return []

    with pytest.raises(ValueError, match=r"prefix_cache needs a proposer that reads no hidden states or has "
                                         r"fork\(sources, upto\) and forget\(rid\) \(Hidden reads layers \(1,\)\)"):
        mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4, num_draft_tokens=2, proposer=Hidden(),
                                               prefix_cache=True))


def test_match_takes_the_longest_entry_and_checks_its_tokens(monkeypatch):
    """PrefixCache alone: a prompt forks n = (tokens it shares with an entry) - 1 of the entry's K/V,
    at most F and its own length - 1, at least a page, from the entry that gives the most; found
    through page hashes but decided by the tokens (every hash equal here). An entry whose tokens and
    outputs another holds all of is not kept (or goes, unless in use); past max_entries the least
    recently used go."""
    cache = PrefixCache(page_size=4, max_entries=3)
    t = list(range(100, 130))
    assert cache.add(1, t[:17], None, None, set()) == []  # F = 16
    assert cache.add(2, t[:10] + [0] * 7, None, None, set()) == []  # shares 10 tokens with 1
    assert cache.add(3, t[:4], None, None, set()) == [3]  # F = 3: shorter than a page
    hit = lambda prompt, lp=False: (lambda m: m and (m[0].seq, m[1]))(cache.match(prompt, lp, False))  # noqa: E731
    assert hit(t[:20]) == (1, 16) and hit(t[:16]) == (1, 15)  # all of F; all but the prompt's last token
    assert hit(t[:12] + [5] * 8) == (1, 11)  # one short of the 12 shared tokens
    assert hit(t[:10] + [0, 0, 0] + [7] * 5) == (2, 12)  # 2 shares 13, 1 only 10
    assert hit(t[:4] + [9] * 10) is None and hit(t[:5] + [9] * 10) == (2, 4)  # a page at least; 2 used last
    assert hit(t[:20], lp=True) is None  # no entry holds log-probs
    monkeypatch.setattr(prefix_cache, "hash", lambda x: 0, raising=False)  # every page hash collides
    colliding = PrefixCache(page_size=4, max_entries=3)
    colliding.add(1, t[:17], None, None, set())
    assert colliding.match([0] * 8 + t[8:18], False, False) is None and colliding.match(t[:18], False, False)[1] == 16
    monkeypatch.undo()
    lp = torch.zeros(20)
    assert cache.add(4, t[:13], None, None, set()) == [4]  # 1 holds all of it
    assert cache.add(5, t[:21], lp, None, set()) == [1]  # holds all of 1, and log-probs
    assert cache.add(6, t[:17], None, None, set()) == [6] and hit(t[:20], lp=True) == (5, 19)
    assert cache.add(7, t[:25], lp, None, {5}) == []  # 5 is in use: stays
    cache.drop_covered([5, 2])
    assert sorted(cache.entries) == [2, 7]
    assert cache.add(8, [1] * 9, None, None, set()) == [] and cache.add(9, [2] * 9, None, None, set()) == [2]
    assert sorted(cache.clear()) == [7, 8, 9] and not cache.entries and cache.match(t, False, False) is None


def test_a_system_prompt_is_shared_across_calls(monkeypatch):
    """Prompts that share only a system prompt (37 tokens, not whole pages) with an earlier call's
    fork its K/V across calls: all of it but its last token, from whichever earlier request, since
    every sliding-window page stays with the entries. One prompt alone, then two (each forks the
    entry: the group they form in their call would share no more). Outputs, log-probs and routed
    experts equal the engine without the cache."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(16)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    config = dict(max_tokens=1024, page_size=4, chunk_size=16)
    engine = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, **config))
    ref = mf.Engine(CFG, params, mf.EngineConfig(**config))
    system = _rand(gen, 37)
    kw = dict(max_new_tokens=5, return_logprobs=True, return_routed_experts=True)
    for call, sizes in enumerate(((9, 14), (11,), (6, 20))):
        prompts = [system + [10 + call * 3 + i] + _rand(gen, n - 1) for i, n in enumerate(sizes)]
        spy.tokens = 0
        got = engine.generate(prompts, **kw)
        if call:  # each forks 36 and runs the rest
            assert engine.prefix_stats == {"hits": len(sizes), "tokens": 36 * len(sizes)}
            assert spy.tokens == sum(sizes) + len(sizes)
        _assert_same(got, ref.generate(prompts, **kw))
        _pages_balance(engine)
    assert len(engine.prefix_cache) == 5


def test_a_bounded_sliding_window_pool_forks_at_a_prompts_end_and_an_entrys_end(monkeypatch):
    """With a bounded sliding-window pool an entry keeps the pages of two windows: the one at its
    prompt's end (model.keep_swa) and its last one. The same prompt again forks all of it but its
    last token, the next turn all of the entry's K/V; another question after its system prompt
    forks nothing, where an unbounded pool forks that too. The pool's 50 pages split into a
    prefill pass's 4, 2 requests in flight (7 pages each) and 5 entries (6 each), and outputs equal
    the engine without the cache on the same pool."""
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(17)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    config = dict(max_tokens=1024, page_size=4, chunk_size=16)
    engine = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, max_swa_tokens=200, **config))
    ref = mf.Engine(CFG, params, mf.EngineConfig(max_swa_tokens=200, **config))
    unbounded = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, **config))
    assert engine.sched_config.max_running_requests == 2 and engine.prefix_cache.max_entries == 5
    assert ref.sched_config.max_running_requests == 11  # (50 - 4) // 4: no entries, kept windows nor slack
    system = _rand(gen, 30)
    first = system + _rand(gen, 9)
    question = system + _rand(gen, 7)
    kw = dict(max_new_tokens=20, return_logprobs=True, return_routed_experts=True)
    out = engine.generate([first], **kw)
    unbounded.generate([first], **kw)
    (e,) = engine.prefix_cache.entries.values()
    # 58 tokens of K/V. Kept: pages 7-9 (tokens 31..37, the window of a fork at the prompt's 38), so
    # forks of 7 * 4 + 8 - 1 = 35 to 40 tokens; and the last window's pages 12-14 (from token
    # 58 - slack 1 - 8 + 1 = 50), forks of 55 to 58
    assert e.length == 58 and e.forks == ((35, 40), (55, 58))
    for prompt, forked in ((first, 38), (question, 0)):
        spy.tokens = 0
        got = engine.generate([prompt], **kw)
        assert engine.prefix_stats == {"hits": int(forked > 0), "tokens": forked}
        assert spy.tokens == len(prompt) - forked
        _assert_same(got, ref.generate([prompt], **kw))
        unbounded.generate([prompt], **kw)
        assert unbounded.prefix_stats["hits"] == 1
    turn = first + out[0].tokens + _rand(gen, 5)
    spy.tokens = 0
    got = engine.generate([turn], **kw)
    assert engine.prefix_stats == {"hits": 1, "tokens": 58} and spy.tokens == 6
    _assert_same(got, ref.generate([turn], **kw))
    _pages_balance(engine)


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_match_the_engine_without_the_cache(seed):
    """Random configs (pages, chunks, pool sizes that force evictions, bounded sliding-window pools,
    batch caps, overlap, drafts, sharing) and four calls of random prompts: continuations of
    earlier prompts and answers (each call's first prompt continues the call before's), repeats,
    new ones, copies; log-probs and routed experts asked for or not. Every output equals the
    engine without the cache; between calls only entries hold pages."""
    import random

    rng = random.Random(seed)
    config = dict(max_tokens=rng.choice([96, 160, 512]), page_size=rng.choice([2, 4, 8]),
                  chunk_size=rng.choice([8, 16, 64]), max_batch=rng.choice([2, 4, 256]),
                  overlap=rng.choice([True, False]), num_draft_tokens=rng.choice([0, 0, 2]),
                  share_prompts=rng.choice([True, False]))
    if rng.random() < 0.5:  # a bounded sliding-window pool: 1-4 requests in flight, 2-12 entries more
        swa_slack, page = max(config["num_draft_tokens"], 1), config["page_size"]
        per_seq, entry = PrefixCache.swa_pages(CFG, page, swa_slack, config["num_draft_tokens"] + 1)
        pages = (rng.randint(1, 4) * (per_seq + 2 * entry) + rng.randint(0, 10) * entry
                 + -(-config["chunk_size"] // page))
        config["max_swa_tokens"] = pages * config["page_size"] + rng.randint(0, 3)
    cap = config["max_tokens"] // 2 - 8  # prompt tokens at most (a request's new tokens fit beside them)
    params = mf.init_params(CFG, seed=7, device=DEVICE)
    cached = mf.Engine(CFG, params, mf.EngineConfig(prefix_cache=True, **config))
    plain = mf.Engine(CFG, params, mf.EngineConfig(**config))

    def tokens(n):
        return [rng.randrange(CFG.vocab_size) for _ in range(n)]

    history, hits = [tokens(20)], 0
    for call in range(4):
        prompts = []
        for j in range(rng.randint(1, 4)):
            short = [h for h in history if len(h) < cap - 1]
            kind = "continue" if j == 0 and call else rng.choice(["continue", "continue", "repeat", "new"])
            base = history[-1] if j == 0 and call else rng.choice(short or [[]])
            p = (base + tokens(rng.randint(1, 9)) if kind == "continue" else
                 list(base) if kind == "repeat" and base else tokens(rng.randint(1, 40)))
            prompts += [p[:cap]] * rng.choice([1, 1, 2])
        new = [rng.randint(1, 8) for _ in prompts]
        sampling = [rng.choice([None, mf.SamplingParams(temperature=1.0, seed=seed)]) for _ in prompts]
        logprobs, experts = rng.choice([True, False]), rng.choice([True, False])
        outs = cached.generate(prompts, new, sampling, return_logprobs=logprobs, return_routed_experts=experts)
        _assert_same(outs, plain.generate(prompts, new, sampling, return_logprobs=logprobs,
                                          return_routed_experts=experts))
        _pages_balance(cached)
        hits += cached.prefix_stats["hits"]
        history.append(prompts[0] + outs[0].tokens)
    assert hits, f"seed {seed}: no call forked an entry ({config})"
