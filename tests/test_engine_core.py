"""Engine core: paged cache, chunked prefill, decode, SWA pool bound, errors, donation, log-probs."""

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch

import mimo_fn as mf

CFG = mf.ModelConfig.tiny()  # window 8, full + SWA layers, sinks, grouped router


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=11)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def random_splits(n, rng, max_chunk):
    cuts, pos = [], 0
    while pos < n:
        step = rng.randint(1, max_chunk)
        cuts.append((pos, min(n, pos + step)))
        pos += step
    return cuts


@pytest.mark.parametrize("page_size", [4, 16])
def test_chunked_prefill_equals_one_shot_and_forward(params, page_size):
    rng = random.Random(page_size)
    gen = torch.Generator().manual_seed(page_size)
    seqs = {sid: torch.randint(0, CFG.vocab_size, (n,), generator=gen) for sid, n in enumerate([37, 23, 9])}
    refs = {sid: mf.forward(params, CFG, t) for sid, t in seqs.items()}

    one = mf.init_state(CFG, params, max_tokens=256, page_size=page_size)
    one, out = mf.prefill(one, mf.Batch.from_tokens(list(seqs), list(seqs.values())), all_logits=True)
    flat_ref = torch.cat([refs[s] for s in seqs])
    assert rel(out.logits_TV, flat_ref) <= 1e-5

    # chunked: every sequence split at random points (across pages and the window), interleaved
    state = mf.init_state(CFG, params, max_tokens=256, page_size=page_size)
    plans = {sid: random_splits(len(t), rng, 11) for sid, t in seqs.items()}
    got = {sid: [] for sid in seqs}
    while any(plans.values()):
        ids = [s for s in plans if plans[s] and rng.random() < 0.7] or [next(s for s in plans if plans[s])]
        chunks = [seqs[s][slice(*plans[s].pop(0))] for s in ids]
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids, chunks), all_logits=True)
        offs = [0, *torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()]
        for b, s in enumerate(ids):
            got[s].append(out.logits_TV[offs[b]:offs[b + 1]])
            assert torch.equal(out.logits_BV[b], out.logits_TV[offs[b + 1] - 1])
    for s in seqs:
        assert rel(torch.cat(got[s]), refs[s]) <= 1e-5


def test_fork_equals_prefilling_the_same_tokens(params):
    """mf.fork: a sequence that takes another's K/V (one that holds a prefix of its tokens, ending
    mid-page, or a new one) decodes as if it had prefilled them itself. It holds the source's
    filled full-attention pages in common with it and copies the partly filled last one; its
    SWA pages behind the window are given back. Each sequence then writes only its own pages,
    after the source is gone too; a shared page is free once its last holder goes; bad calls
    raise and change nothing."""
    tokens = torch.randint(0, CFG.vocab_size, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    state = mf.init_state(CFG, params, max_tokens=256, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0, 1], [tokens, tokens[:9]]))
    free = (len(state.cache.full.free), len(state.cache.swa.free))
    state = mf.fork(state, {1: 0, 2: 0})
    src = state.seqs[0].full
    for s in (1, 2):
        assert state.seqs[s].length == 30 and state.seqs[s].full[7] not in src
        assert [p >= 0 for p in state.seqs[s].swa] == [p >= 0 for p in state.seqs[0].swa]  # the window's pages only
    # full pages 0-6 are filled: 1 keeps its own 0-2 (2 partly filled: copied into) and shares 3-6,
    # 2 shares 0-6; each takes a page 7 of its own. SWA (window 8): 0 holds pages 5-7; 1 and 2
    # share 5-6 and take a 7 of their own, and 1 gives back its 0-2, now behind the window
    assert state.seqs[1].full[:3] != src[:3] and state.seqs[1].full[3:7] == src[3:7] and state.seqs[2].full[:7] == src[:7]
    assert all(state.seqs[s].swa[5:7] == state.seqs[0].swa[5:7] for s in (1, 2))
    assert free[0] - len(state.cache.full.free) == 1 + 1 and free[1] - len(state.cache.swa.free) == (1 - 3) + 1
    state, out = mf.decode(state, mf.Batch.from_tokens([0, 1, 2], [[7], [7], [7]]))
    ref = mf.forward(params, CFG, torch.tensor(tokens + [7]))[-1]
    for b in range(3):
        assert rel(out.logits_BV[b], ref) <= 1e-5
    with pytest.raises(ValueError, match="page 6 holds K/V it shares with a fork"):
        mf.truncate(state, {2: 27})
    # each writes its own tokens into page 7 and a new page 8, then the source goes: the copies read on
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0, 1, 2], [[1, 2, 3], [4, 5, 6], [9, 10, 11]]))
    state = mf.release(state, [0])
    state, out = mf.decode(state, mf.Batch.from_tokens([1, 2], [[8], [8]]))
    for b, tail in enumerate(([4, 5, 6], [9, 10, 11])):
        assert rel(out.logits_BV[b], mf.forward(params, CFG, torch.tensor(tokens + [7] + tail + [8]))[-1]) <= 1e-5
    state = mf.release(state, [1, 2])
    assert len(state.cache.full.free) == state.cache.full.num_pages and not state.cache.full.holders
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0, 3], [tokens + [7], tokens + [7, 8]]))
    state = mf.fork(state, {1: 0})
    for sources, match in (({4: 9}, "sequence 4 cannot copy 9"), ({4: 0, 5: 4}, "sequence 5 cannot copy 4"),
                           ({3: 0}, r"sequence 3 \(32 tokens\) is longer than its source 0 \(31\)")):
        with pytest.raises(ValueError, match=match):
            mf.fork(state, sources)
    small = mf.init_state(CFG, params, max_tokens=36, page_size=4)  # 9 pages: 8 for the tokens, 1 for a decode
    small, _ = mf.prefill(small, mf.Batch.from_tokens([0, 1], [tokens, [1]]))
    with pytest.raises(mf.OutOfPages, match="full-attention KV pool"):  # the copy's own page 7
        mf.fork(small, {2: 0})
    assert list(small.seqs) == [0, 1] and len(small.cache.full.free) == 0 and not small.cache.full.holders
    small = mf.release(small, [1])  # unchanged, and still live
    small, out = mf.decode(small, mf.Batch.from_tokens([0], [[7]]))
    assert rel(out.logits_BV[0], ref) <= 1e-5


def test_fork_upto_takes_the_first_tokens_only(params):
    """mf.fork(..., upto): a new sequence takes a source's first 24 tokens (whole pages, held in
    common: nothing copied, nothing allocated) while the source holds their sliding-window pages
    (swa_slack 4: a window of 8 plus 4 tokens), and decodes as if it had prefilled those 24;
    further back the window's pages are gone and the fork raises, changing nothing."""
    tokens = torch.randint(0, CFG.vocab_size, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    state = mf.init_state(CFG, params, max_tokens=256, page_size=4, swa_slack=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [tokens[:26]]))
    free = (len(state.cache.full.free), len(state.cache.swa.free))
    state = mf.fork(state, {1: 0}, upto={1: 24})
    assert state.seqs[1].length == 24 and state.seqs[1].full == state.seqs[0].full[:6]
    assert (len(state.cache.full.free), len(state.cache.swa.free)) == free
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [tokens[26:]]))  # the source moves on
    for bad, match in (({1: 31}, "cannot take the first 31 tokens of 0, which has 30"),
                       ({2: 12}, "0 .30 tokens. no longer holds the sliding-window pages 2 needs at 12 tokens"),
                       ({1: 20}, r"sequence 1 \(24 tokens\) is longer than the 20 tokens of 0 it takes")):
        with pytest.raises(ValueError, match=match):
            mf.fork(state, {next(iter(bad)): 0}, upto=bad)
    state, out = mf.decode(state, mf.Batch.from_tokens([1], [[7]]))
    assert rel(out.logits_BV[0], mf.forward(params, CFG, torch.tensor(tokens[:24] + [7]))[-1]) <= 1e-5
    state = mf.release(state, [0, 1])
    assert len(state.cache.full.free) == state.cache.full.num_pages and not state.cache.full.holders


def test_keep_swa_keeps_the_window_of_a_fork_point(params):
    """mf.keep_swa: a sequence keeps the sliding-window pages a fork of its first 13 tokens reads
    (tokens 6..12: pages 1-3 of 4 tokens) after they fall behind its window, so a fork there works
    30 tokens later and decodes as if it had prefilled those 13; other pages behind the window go
    back as before, and a fork at 20 (not kept) raises. Setting a second point, or one whose pages
    are gone, raises; release returns every page."""
    tokens = torch.randint(0, CFG.vocab_size, (44,), generator=torch.Generator().manual_seed(7)).tolist()
    state = mf.init_state(CFG, params, max_tokens=256, max_swa_tokens=128, page_size=4, swa_slack=1)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [tokens[:14]]))
    state = mf.keep_swa(state, {0: 13})
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [tokens[14:]]))
    swa = state.seqs[0].swa  # 44 tokens: the window (from token 44 - 1 - 8 + 1 = 36) is pages 9-10
    assert [p >= 0 for p in swa] == [False, True, True, True] + [False] * 5 + [True, True]
    for bad, match in (({0: 30}, r"cannot keep the sliding-window pages of a fork at 30 tokens"),
                       ({0: 42}, r"keeping pages \(1, 4\)")):
        with pytest.raises(ValueError, match=match):
            mf.keep_swa(state, bad)
    with pytest.raises(ValueError, match="no longer holds the sliding-window pages 2 needs at 20 tokens"):
        mf.fork(state, {2: 0}, upto={2: 20})
    state = mf.fork(state, {1: 0}, upto={1: 13})
    state, out = mf.decode(state, mf.Batch.from_tokens([1], [[7]]))
    assert rel(out.logits_BV[0], mf.forward(params, CFG, torch.tensor(tokens[:13] + [7]))[-1]) <= 1e-5
    state = mf.release(state, [0, 1])
    for pool in (state.cache.full, state.cache.swa):
        assert len(pool.free) == pool.num_pages and not pool.holders


def test_greedy_decode_matches_forward_in_mixed_batches(params):
    gen = torch.Generator().manual_seed(3)
    prompts = {0: torch.randint(0, CFG.vocab_size, (21,), generator=gen),
               1: torch.randint(0, CFG.vocab_size, (5,), generator=gen),
               2: torch.randint(0, CFG.vocab_size, (13,), generator=gen)}
    state = mf.init_state(CFG, params, max_tokens=512, page_size=4)
    seq = {s: p.tolist() for s, p in prompts.items()}
    # seq 0 prefills whole; seq 1 and 2 join later, seq 2 in chunks while the others decode
    state, out = mf.prefill(state, mf.Batch.from_tokens([0], [prompts[0]]))
    nxt = {0: int(out.logits_BV[0].argmax())}
    steps = 0
    pending2 = [prompts[2][:6], prompts[2][6:]]
    while steps < 40:
        ids, chunks = [], []
        for s in sorted(nxt):
            ids.append(s)
            chunks.append([nxt[s]])
            seq[s].append(nxt[s])
        if steps == 3:
            ids.append(1)
            chunks.append(prompts[1])
        if steps in (5, 9):
            ids.append(2)
            chunks.append(pending2.pop(0))
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids, chunks))
        for b, s in enumerate(ids):
            if s != 2 or steps >= 9:
                nxt[s] = int(out.logits_BV[b].argmax())
        steps += 1
    for s in seq:
        assert len(seq[s]) - len(prompts[s]) >= 26
        logits = mf.forward(params, CFG, torch.tensor(seq[s]))
        n = len(prompts[s])
        assert seq[s][n:] == logits[n - 1:-1].argmax(-1).tolist()


def test_swa_pool_bounded_full_pool_linear(params):
    page, chunk = 4, 6
    state = mf.init_state(CFG, params, max_tokens=400, page_size=page)
    bound = math.ceil((CFG.sliding_window + chunk) / page) + 1
    toks = torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    full_free0 = len(state.cache.full.free)
    for start in range(0, 300, chunk):
        state, _ = mf.prefill(state, mf.Batch.from_tokens([7], [toks[start:start + chunk]]))
        seq = state.seqs[7]
        live_swa = sum(p >= 0 for p in seq.swa)
        assert live_swa <= bound
        assert len(seq.full) == math.ceil(seq.length / page)
        assert full_free0 - len(state.cache.full.free) == len(seq.full)
    assert sum(p >= 0 for p in state.seqs[7].swa) <= bound


def _advance_scanning_every_page(kv, seqs, new_tokens):
    """cache.advance as it was before 2026-11-30: looks at every page behind the window, each step."""
    from dataclasses import replace

    from mimo_fn.cache import SeqPages, _first_live_swa_page
    seqs, freed = dict(seqs), []
    for sid, n in new_tokens.items():
        seq = seqs[sid]
        length = seq.length + n
        first = _first_live_swa_page(max(0, length - kv.swa_slack), kv.window, kv.page_size)
        behind = [p for p in seq.swa[:first] if p >= 0]
        freed += behind
        swa = (-1,) * first + seq.swa[first:] if behind else seq.swa
        seqs[sid] = SeqPages(length, seq.full, swa)
    return (replace(kv, swa=replace(kv.swa, free=kv.swa.free + tuple(freed))) if freed else kv), seqs


@pytest.mark.parametrize("slack", [0, 6])
def test_advance_frees_the_pages_a_full_scan_frees(params, slack):
    """advance looks only at the SWA pages that fell behind the window in this step; over random
    chunks, decodes and truncations its pages and free lists equal a scan of every page's."""
    from mimo_fn import cache as C
    rng = random.Random(slack)
    kv = mf.init_state(CFG, params, max_tokens=4000, page_size=4, swa_slack=slack).cache
    fast, ref = (kv, {}), (kv, {})
    for _ in range(400):
        seqs = fast[1]
        sid = rng.randrange(3)
        if rng.random() < 0.15 and seqs.get(sid) and seqs[sid].length:
            cut = {sid: max(0, seqs[sid].length - rng.randint(0, slack))}
            try:  # refused where a truncation before this one used up the slack: by both, then
                fast = C.truncate(*fast, cut)
            except ValueError:
                with pytest.raises(ValueError):
                    C.truncate(*ref, cut)
                continue
            ref = C.truncate(*ref, cut)
        else:
            new = {s: rng.choice([1, 1, 1, 3, 9]) for s in rng.sample(range(3), rng.randint(1, 3))}
            fast, ref = C.extend(*fast, new), C.extend(*ref, new)
            fast, ref = C.advance(*fast, new), _advance_scanning_every_page(*ref, new)
        assert fast[1] == ref[1] and fast[0].swa.free == ref[0].swa.free and fast[0].full.free == ref[0].full.free
    assert any(p == -1 for seq in fast[1].values() for p in seq.swa)  # pages did fall behind


def test_out_of_pages_leaves_others_intact(params):
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, CFG.vocab_size, (30,), generator=gen), torch.randint(0, CFG.vocab_size, (30,), generator=gen)

    def run(state, seq_id, first, steps):
        state, out = mf.prefill(state, mf.Batch.from_tokens([seq_id], [first]))
        toks = []
        for _ in range(steps):
            toks.append(int(out.logits_BV[0].argmax()))
            state, out = mf.decode(state, mf.Batch.from_tokens([seq_id], [[toks[-1]]]))
        return state, toks

    _, expected = run(mf.init_state(CFG, params, max_tokens=48, page_size=4), 0, a, 6)
    state = mf.init_state(CFG, params, max_tokens=48, page_size=4)
    state, out = mf.prefill(state, mf.Batch.from_tokens([0], [a]))
    free_before = (state.cache.full.free, state.cache.swa.free)
    with pytest.raises(mf.OutOfPages, match=r"full-attention KV pool: this step needs 8 more pages of 4 tokens, 4 of 12 are free"):
        mf.prefill(state, mf.Batch.from_tokens([1], [b]))
    assert (state.cache.full.free, state.cache.swa.free) == free_before and 1 not in state.seqs
    toks = []
    for _ in range(6):  # the failed call did not consume the state: continue sequence 0
        toks.append(int(out.logits_BV[0].argmax()))
        state, out = mf.decode(state, mf.Batch.from_tokens([0], [[toks[-1]]]))
    assert toks == expected


def test_release_returns_every_page_and_stale_state_raises(params):
    state0 = mf.init_state(CFG, params, max_tokens=128, page_size=4)
    n_full, n_swa = len(state0.cache.full.free), len(state0.cache.swa.free)
    state1, _ = mf.prefill(state0, mf.Batch.from_tokens([0, 1], [list(range(1, 30)), [3, 4, 5]]))
    with pytest.raises(mf.StaleStateError):
        mf.prefill(state0, mf.Batch.from_tokens([2], [[1, 2]]))
    state2 = mf.release(state1, [0, 1])
    assert sorted(state2.cache.full.free) == list(range(n_full))
    assert sorted(state2.cache.swa.free) == list(range(n_swa))
    assert not state2.seqs
    with pytest.raises(mf.StaleStateError):
        mf.release(state1, [0])
    with pytest.raises(ValueError, match=r"unknown sequence ids \[5\]"):
        mf.release(state2, [5])


def test_batch_from_any_token_containers():
    """Lists of ints (the fast path), tensors, tuples, numpy ints and nested lists give one layout."""
    import numpy as np

    for chunks in ([[3, 4, 5], [6]], [(3, 4, 5), (6,)], [torch.tensor([3, 4, 5]), [6]], [[np.int64(3), 4, 5], [6]],
                   [[3, 4, 5], torch.tensor([6])], [torch.tensor([[3, 4, 5]]), [6]]):
        b = mf.Batch.from_tokens([7, 8], chunks)
        assert b.tokens_T.tolist() == [3, 4, 5, 6] and b.tokens_T.dtype == torch.long and b.lens == (3, 1)
    b = mf.Batch.from_tokens([7, 8], [[[3, 4], [5, 6]], [7]])  # nested: flattened, as before
    assert b.tokens_T.tolist() == [3, 4, 5, 6, 7] and b.lens == (4, 1)
    for chunks in ([[1], []], [torch.tensor([1]), []]):
        with pytest.raises(ValueError, match="sequence 8 has an empty chunk"):
            mf.Batch.from_tokens([7, 8], chunks)


def test_step_meta_tables_follow_the_page_tuples():
    """step_meta reuses each page tuple's packed row while the tuple is the same object: over
    random steps (pages appended, SWA pages freed, pages swapped, equal tuples rebuilt, random
    subsets of the sequences in each batch) its tables equal ones built from the tuples afresh."""
    from types import SimpleNamespace

    from mimo_fn.batch import step_meta
    from mimo_fn.cache import PageTables, SeqPages

    rng = random.Random(5)
    cache = SimpleNamespace(page_size=4, page_tables=PageTables())  # the tables' owner: a KVCache's
    # lengths one short of whole pages: each step's token lands on the last page
    seqs = {s: SeqPages(4 * (s + 1) - 1, tuple(range(10 * s, 10 * s + s + 1)), tuple(range(s + 1))) for s in range(6)}
    for _ in range(200):
        # prior holds lengths only, so replaced tuples are freed and their ids can come back
        prior = {s: SeqPages(sp.length, (), ()) for s, sp in seqs.items()}
        for s, sp in list(seqs.items()):
            r = rng.random()
            if r < 0.3:  # a new page; the oldest live SWA page freed
                swa = list(sp.swa) + [rng.randrange(100)]
                swa[swa.index(next(p for p in swa if p >= 0))] = -1
                seqs[s] = SeqPages(sp.length + 4, sp.full + (rng.randrange(1000),), tuple(swa))
            elif r < 0.4:  # equal contents, new objects
                seqs[s] = SeqPages(sp.length, tuple(list(sp.full)), tuple(list(sp.swa)))
            elif r < 0.6:  # same length, other contents
                full = list(sp.full)
                full[rng.randrange(len(full))] = rng.randrange(1000)
                seqs[s] = SeqPages(sp.length, tuple(full), tuple(rng.choice([-1, p]) for p in sp.swa))
        ids = tuple(sorted(rng.sample(sorted(seqs), rng.randint(1, len(seqs)))))
        batch = mf.Batch.from_tokens(ids, [[1] for _ in ids])
        meta = step_meta(batch, prior, seqs, cache, torch.device("cpu"))
        width = max(len(seqs[s].full) for s in ids)
        for kind, got in (("full", meta.full_table_BL), ("swa", meta.swa_table_BL)):
            want = [list(getattr(seqs[s], kind)) + [-1] * (width - len(getattr(seqs[s], kind))) for s in ids]
            assert got.dtype == torch.int32 and got.tolist() == want


def test_step_meta_positions_and_slots_on_either_side(monkeypatch):
    """The per-token positions and slots, computed on the host (by a loop for a few tokens, by
    tensor ops for more) and on the device side (slots_on_device, what a long CUDA chunk takes),
    equal a per-token loop over random chunks."""
    from types import SimpleNamespace

    from mimo_fn import batch as batch_module
    from mimo_fn.batch import step_meta
    from mimo_fn.cache import PageTables, SeqPages

    rng = random.Random(7)
    page = 4
    for _ in range(30):
        cache = SimpleNamespace(page_size=page, page_tables=PageTables())
        ids = tuple(sorted(rng.sample(range(20), rng.randint(1, 6))))
        prior, seqs, chunks = {}, {}, []
        for s in ids:
            start, n = rng.randint(0, 13), rng.randint(1, 11)
            pages = -(-(start + n) // page)
            prior[s] = SeqPages(start, (), ())
            seqs[s] = SeqPages(start + n, tuple(rng.sample(range(500), pages)),
                               tuple(rng.choice([-1, rng.randrange(500)]) for _ in range(pages)))
            chunks.append([rng.randrange(CFG.vocab_size) for _ in range(n)])
        batch = mf.Batch.from_tokens(ids, chunks)
        host = step_meta(batch, prior, seqs, cache, torch.device("cpu"), slots_on_device=False)
        dev = step_meta(batch, prior, seqs, cache, torch.device("cpu"), slots_on_device=True)
        with monkeypatch.context() as m:
            m.setattr(batch_module, "HOST_LOOP_MAX", 0)
            ops = step_meta(batch, prior, seqs, cache, torch.device("cpu"), slots_on_device=False)
        want_pos = [prior[s].length + i for s, c in zip(ids, chunks) for i in range(len(c))]
        want_full = [seqs[s].full[p // page] * page + p % page for s, c in zip(ids, chunks)
                     for p in range(prior[s].length, prior[s].length + len(c))]
        want_swa = [seqs[s].swa[p // page] * page + p % page for s, c in zip(ids, chunks)
                    for p in range(prior[s].length, prior[s].length + len(c))]
        for meta in (host, dev, ops):
            assert meta.pos_T.dtype == torch.long and meta.kv_lens_B.dtype == meta.cu_q_B1.dtype == torch.int32
            assert meta.max_q_len == max(map(len, chunks))
            assert meta.pos_T.tolist() == want_pos
            assert meta.full_slot_T.tolist() == want_full and meta.swa_slot_T.tolist() == want_swa
            assert meta.kv_lens_B.tolist() == [seqs[s].length for s in ids]
            assert meta.cu_q_B1.tolist() == [0, *itertools.accumulate(map(len, chunks))]


def test_bad_batches(params):
    state = mf.init_state(CFG, params, max_tokens=64, page_size=4)
    with pytest.raises(ValueError, match="repeat an id"):
        mf.Batch.from_tokens([0, 0], [[1], [2]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mf.prefill(state, mf.Batch.from_tokens([0], [[1, CFG.vocab_size]]))
    for tokens in ([[1, 2.5]], [torch.tensor([1.0, 2.0])], [[True]]):  # no silent truncation to ints
        with pytest.raises(ValueError, match=r"Batch.from_tokens: sequence 0's tokens are torch.(float|bool)"):
            mf.Batch.from_tokens([0], tokens)
    with pytest.raises(ValueError, match="have no cache"):
        mf.decode(state, mf.Batch.from_tokens([3], [[1]]))
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [[1, 2]]))
    with pytest.raises(ValueError, match="one token per sequence"):
        mf.decode(state, mf.Batch.from_tokens([0], [[1, 2]]))


def test_sampling_draws_from_the_filtered_distribution():
    """sample(): 20,000 draws per row follow filtered_probs (Pearson's chi-square), tokens outside
    top-k / top-p never come, and a row's draws do not depend on the rows beside it."""
    from mimo_fn.layers.sampling import filtered_probs, sample

    logits_BV = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 2
    for sp in (mf.SamplingParams(temperature=1.0), mf.SamplingParams(temperature=1.5, top_k=8, top_p=0.9)):
        p_BV = filtered_probs(logits_BV, sp)
        p_BV = p_BV / p_BV.sum(-1, keepdim=True)
        gens = [torch.Generator().manual_seed(10 + b) for b in range(3)]
        draws_NB = torch.stack([sample(logits_BV, sp, gens) for _ in range(20000)])
        for b in range(3):
            counts = torch.bincount(draws_NB[:, b], minlength=50).double()
            support = p_BV[b] > 0
            assert counts[~support].sum() == 0
            expected = p_BV[b][support].double() * len(draws_NB)
            stat = float(((counts[support] - expected) ** 2 / expected).sum())
            dof = int(support.sum()) - 1
            assert dof >= 2 and stat < dof + 5 * (2 * dof) ** 0.5, (sp, b, stat, dof)  # ~5 sigma above the mean
        alone = [torch.Generator().manual_seed(11)]
        assert torch.equal(torch.stack([sample(logits_BV[1:2], sp, alone)[0] for _ in range(200)]), draws_NB[:200, 1])


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.5), "temperature = -0.5: expected >= 0"), (dict(top_k=-1), "top_k = -1: expected >= 0"),
    (dict(top_p=0.0), r"top_p = 0.0: expected in \(0, 1\]"), (dict(top_k=2.5), "top_k = 2.5: expected an int"),
    (dict(temperature="hot"), "temperature = 'hot': expected a number"), (dict(seed=1.5), "seed = 1.5: expected an int"),
    (dict(seed=True), "seed = True: expected an int"),
])
def test_bad_sampling_params(kw, match):
    """Checked when made, not as a TypeError in the middle of a generate call."""
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        mf.SamplingParams(**kw)


def test_logprobs_match_forward(params):
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=7))
    prompts = [[5, 9, 3, 77, 1, 2, 8, 8, 13, 40, 41, 2, 3, 4, 5, 6], [3, 1, 4, 1, 5]]
    sp = mf.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1)
    outs = engine.generate(prompts, max_new_tokens=12, sampling=sp, return_logprobs=True)
    # 9 tokens in chunks of 8 and 1: a last chunk of one token scores no prompt token
    prompts.append([2, 7, 1, 8, 2, 8, 1, 8, 3])
    outs += mf.Engine(CFG, params, mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8)).generate(
        prompts[-1:], max_new_tokens=12, sampling=sp, return_logprobs=True)
    for p, o in zip(prompts, outs):
        full = torch.tensor(p + o.tokens)
        lp = torch.log_softmax(mf.forward(params, CFG, full), -1)
        want = lp[:-1].gather(-1, full[1:, None]).squeeze(-1)
        got = torch.tensor(o.prompt_logprobs + o.logprobs)
        assert torch.allclose(got, want, atol=1e-5)
    # same seed, same tokens, whatever shares the batch
    prompts = prompts[:2]
    again = engine.generate(prompts, max_new_tokens=12, sampling=sp)
    alone = engine.generate(prompts[:1], max_new_tokens=12, sampling=sp)
    assert [o.tokens for o in again] == [o.tokens for o in outs[:2]] and alone[0].tokens == outs[0].tokens


def test_engine_greedy_and_capacity_errors(params):
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=64, page_size=4, chunk_size=5))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    outs = engine.generate(prompts, max_new_tokens=20)
    for p, o in zip(prompts, outs):
        full = mf.forward(params, CFG, torch.tensor(p + o.tokens))
        assert o.tokens == full[len(p) - 1:-1].argmax(-1).tolist()
    with pytest.raises(ValueError, match="EngineConfig.max_tokens"):
        engine.generate([list(range(1, 60))], max_new_tokens=10)
    assert len(engine.state.cache.full.free) == engine.state.cache.full.num_pages
    with pytest.raises(ValueError, match="EngineConfig.chunk_size = 3 is smaller than page_size = 4"):
        mf.EngineConfig(max_tokens=64, page_size=4, chunk_size=3)
    for kw, match in ((dict(max_tokens=100.5), r"max_tokens = 100.5: expected an int >= 1"),
                      (dict(page_size=4.0), r"page_size = 4.0: expected an int >= 1"),
                      (dict(max_batch="4"), r"max_batch = '4': expected an int >= 1"),
                      (dict(max_swa_tokens=0), r"max_swa_tokens = 0: expected an int >= 1 or None"),
                      (dict(num_draft_tokens=1.5), r"num_draft_tokens = 1.5: expected an int >= 0"),
                      (dict(max_delay_passes=-1), r"max_delay_passes = -1: expected an int >= 0")):
        with pytest.raises(ValueError, match=f"EngineConfig.{match}"):
            mf.EngineConfig(**{"max_tokens": 64, **kw})
    with pytest.raises(ValueError, match=r"init_state: max_swa_tokens = 0, expected a positive int"):
        mf.init_state(CFG, params, max_tokens=64, max_swa_tokens=0)  # 0 was taken as "as large as max_tokens"
    with pytest.raises(ValueError, match=r"EngineConfig.scheduler\['chunk_size'\]: set by EngineConfig.chunk_size"):
        mf.EngineConfig(max_tokens=64, scheduler={"chunk_size": 8})
    with pytest.raises(ValueError, match=r"scheduler\['dp_size'\]: set by EngineConfig.chunk_size"):
        mf.EngineConfig(max_tokens=64, scheduler={"dp_size": 2})  # one scheduler per DP group already
    with pytest.raises(ValueError, match=r"scheduler\['polcy'\]: not a SchedulerConfig field; expected one "
                                         r"of .*'policy'"):
        mf.EngineConfig(max_tokens=64, scheduler={"polcy": "lof"})


@pytest.mark.parametrize("drafts", [0, 3])
def test_bounded_swa_pool_caps_requests_in_flight(params, drafts):
    """A sliding-window pool smaller than the full one holds a few sequences' windows: the
    engine admits no more at once than fit (it ran the pool dry mid-generate before), gives
    the tokens of an unbounded pool, and refuses a pool smaller than one sequence needs. What
    fits: each sequence's last window (window 8 + slack, in pages of 4, + 1) and the pages a step
    adds to it (1, or 1 for a verify step of 4 tokens), and once a prefill pass's 16 tokens (4
    pages): 2 x (3 + 1) + 4 = 12 pages without drafts, 2 x (4 + 1) + 4 = 14 with 3 (slack 3)."""
    from mimo_fn.cache import swa_pool_pages

    pool = swa_pool_pages(CFG, 4, 2, 16, slack=drafts, step_tokens=drafts + 1)
    assert pool == (12, 14)[drafts > 0]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (30, 25, 40, 12, 33)]
    config = mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=16, cuda_graphs=False, num_draft_tokens=drafts)
    want = mf.Engine(CFG, params, config).generate(prompts, max_new_tokens=10)
    bounded = mf.Engine(CFG, params, replace(config, max_swa_tokens=pool * 4))
    assert bounded.sched_config.max_running_requests == 2
    assert [o.tokens for o in bounded.generate(prompts, max_new_tokens=10)] == [o.tokens for o in want]
    assert len(bounded.state.cache.swa.free) == bounded.state.cache.swa.num_pages
    need = pool - (pool - 4) // 2
    with pytest.raises(ValueError, match=rf"holds {need - 1} pages of 4 tokens, fewer than the {need} one "
                                         rf"sequence in flight can hold .* at least {need * 4} tokens"):
        mf.Engine(CFG, params, replace(config, max_swa_tokens=(need - 1) * 4))


def test_capacity_splits_bytes_between_pools():
    from mimo_fn.cache import capacity, page_bytes, swa_pool_pages

    cfg = mf.ModelConfig.flash()
    full_b, swa_b = page_bytes(cfg, 16, torch.bfloat16)
    # a full page: 9 full layers x 4 KV heads x 16 slots x (192 + 128) x 2 bytes
    assert full_b == 9 * 4 * 16 * 320 * 2 and swa_b == 39 * 8 * 16 * 320 * 2
    full_pages, swa_pages = capacity(cfg, 40 * 2**30, page_size=16, max_seqs=8, chunk=16384)
    # each sequence its last window (127 tokens: 8 pages + 1) and a step's page; one 16K-token pass
    assert swa_pages == swa_pool_pages(cfg, 16, 8, 16384) == 8 * (9 + 1) + 1024
    assert capacity(cfg, 40 * 2**30, page_size=16, max_seqs=8, chunk=16384, swa_slack=40)[1] == \
        swa_pool_pages(cfg, 16, 8, 16384, 40) == swa_pages + 8 * 3  # 40 more tokens: 3 more pages
    assert full_pages * full_b + swa_pages * swa_b <= 40 * 2**30 < (full_pages + 1) * full_b + swa_pages * swa_b
    with pytest.raises(ValueError, match="fewer than the"):
        capacity(cfg, 2**20, max_seqs=8)
