"""Speculative decoding: truncate, the n-gram proposer, and greedy equality through Engine.
On a machine with CUDA the model runs there (the Triton kernels, verify steps in CUDA graphs)."""

import pytest
import torch

import mimo_fn as mf
from mimo_fn.cache import swa_pages_held
from mimo_fn.speculative.ngram import NgramProposer

CFG = mf.ModelConfig.tiny()  # sliding window 8: pages of 4 make truncate cross SWA pages
# repetitive prompts, so prompt lookup finds something to propose
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4], [11, 12, 11, 12, 11]]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=3, device=DEVICE)


def _engine(params, **kw):
    return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, **kw))


@pytest.fixture(scope="module")
def plain(params):
    """Plain greedy outputs: what every speculative run must reproduce."""
    return _engine(params).generate(PROMPTS, 20, return_logprobs=True, return_routed_experts=True)


class Oracle:
    """Proposes greedy's own continuation (correct drafts), or wrong tokens from draft `wrong_from` on."""

    def __init__(self, plain, wrong_from=None):
        self.full = [p + o.tokens for p, o in zip(PROMPTS, plain)]
        self.wrong_from = wrong_from

    def propose(self, rid, tokens, k):
        full = next(f for f in self.full if f[:len(tokens)] == list(tokens))
        d = full[len(tokens):len(tokens) + k]
        if self.wrong_from is not None:
            d = d[:self.wrong_from] + [(t + 1) % CFG.vocab_size for t in d[self.wrong_from:]]
        return d


def _check_equal(got, want):
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert torch.equal(g.routed_experts, w.routed_experts)


@pytest.mark.parametrize("proposer, k", [(None, 4), ("oracle", 3), ("oracle", 7), ("wrong", 4), ("half", 4)])
def test_speculative_greedy_equals_plain_greedy(params, plain, proposer, k):
    prop = {None: None, "oracle": Oracle(plain), "wrong": Oracle(plain, 0), "half": Oracle(plain, 2)}[proposer]
    engine = _engine(params, num_draft_tokens=k, proposer=prop)
    got = engine.generate(PROMPTS, 20, return_logprobs=True, return_routed_experts=True)
    _check_equal(got, plain)
    stats = engine.spec_stats()
    assert stats["drafted"] > 0
    if proposer == "oracle":  # every draft right: far fewer steps than 19 decode steps
        assert stats["accepted"] == stats["drafted"]
        assert stats["steps"] <= -(-19 // (k + 1)) + 1
    elif proposer == "wrong":
        assert stats["accepted"] == 0 and stats["steps"] == 19
    elif proposer == "half":  # two right drafts per request and step, while there is room for them
        assert 0 < stats["accepted"] <= 2 * len(PROMPTS) * stats["steps"] and stats["steps"] < 19
        assert all(n <= 3 for o in got for n in o.accept_lengths)
    # per request: one acceptance length a verify step, together every token but the prefill's first
    assert [sum(o.accept_lengths) for o in got] == [19] * len(PROMPTS)
    lengths = [n for o in got for n in o.accept_lengths]
    assert stats["verified"] == len(lengths) and stats["accepted"] == sum(lengths) - len(lengths)
    assert stats["histogram"] == {n: lengths.count(n) for n in range(1, k + 2)}
    assert stats["mean_accept_length"] == pytest.approx(sum(lengths) / len(lengths))
    if proposer == "wrong":
        assert stats["mean_accept_length"] == 1.0 and stats["histogram"][1] == 19 * len(PROMPTS)
    assert engine.state.seqs == {}  # every page back
    assert len(engine.state.cache.full.free) == engine.state.cache.full.num_pages


def test_stop_token_inside_accepted_drafts(params, plain):
    stop = plain[0].tokens[6]  # greedy's 7th token of prompt 0
    want = _engine(params).generate(PROMPTS, 20, stop_token_ids=[stop], return_logprobs=True,
                                    return_routed_experts=True)
    engine = _engine(params, num_draft_tokens=5, proposer=Oracle(plain))
    got = engine.generate(PROMPTS, 20, stop_token_ids=[stop], return_logprobs=True, return_routed_experts=True)
    assert got[0].tokens[-1] == stop and len(got[0].tokens) <= 7
    _check_equal(got, want)


def test_bad_speculative_calls(params, plain):
    with pytest.raises(ValueError, match="no propose"):
        mf.EngineConfig(max_tokens=64, num_draft_tokens=2, proposer=object())

    class TooMany:
        def propose(self, rid, tokens, k):
            return [1] * (k + 1)

    engine = _engine(params, num_draft_tokens=2, proposer=TooMany())
    with pytest.raises(ValueError, match=r"the proposer returned \[1, 1, 1\] for at most 2 tokens"):
        engine.generate(PROMPTS, 8)
    assert engine.state.seqs == {}  # the failed call freed what it held
    engine.proposer = Oracle(plain)
    _check_equal(engine.generate(PROMPTS, 20, return_logprobs=True, return_routed_experts=True), plain)


def test_truncate_equals_never_having_prefilled(params):
    toks = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want = mf.init_state(CFG, params, 256, page_size=4)
    want, ref = mf.prefill(want, mf.Batch.from_tokens([0], [toks]))
    state = mf.init_state(CFG, params, 256, page_size=4, swa_slack=7)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [toks[:30]]))
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [[1, 2, 3, 4, 5, 6, 7]]))  # 7 tokens to forget
    # 37 tokens, window 8: pages 7-9 hold the window, the slack of 7 keeps pages 5 and 6 too
    assert [p >= 0 for p in state.seqs[0].swa] == [False] * 5 + [True] * 5
    assert 5 <= swa_pages_held(CFG, 4, 7)  # within the per-sequence budget capacity() plans for
    free = len(state.cache.full.free)
    state = mf.truncate(state, {0: 30})
    assert state.seqs[0].length == 30 and len(state.cache.full.free) == free + 2  # 10 pages of 4 -> 8
    state, out = mf.prefill(state, mf.Batch.from_tokens([0], [toks[30:]]))
    torch.testing.assert_close(out.logits_BV, ref.logits_BV, atol=1e-5, rtol=0)


def test_truncate_refuses_what_it_cannot_undo(params):
    state = mf.init_state(CFG, params, 256, page_size=4, swa_slack=2)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [list(range(30))]))
    with pytest.raises(ValueError, match="unknown sequence ids"):
        mf.truncate(state, {1: 3})
    with pytest.raises(ValueError, match="has 30 tokens, cannot take it to 31"):
        mf.truncate(state, {0: 31})
    with pytest.raises(ValueError, match=r"pages it would read again are freed; it can go back to 27 tokens at the "
                                         r"least \(swa_slack = 2 tokens"):
        mf.truncate(state, {0: 26})
    state = mf.truncate(state, {0: 28})  # within the slack; nothing before changed the state
    assert state.seqs[0].length == 28
    # the slack counts from the longest the sequence has been: 28 -> 27 still reads kept pages
    # (27 is the least the message named), 26 does not, even after a step forward to 29
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [[5]]))
    with pytest.raises(ValueError, match=r"\(29 tokens\) cannot go back to 26: .* go back to 27 tokens"):
        mf.truncate(state, {0: 26})
    assert mf.truncate(state, {0: 27}).seqs[0].length == 27


def _lookup_ref(tokens, k, min_n=2, max_n=4):
    """Prompt lookup written plainly: the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def test_ngram_proposer_grows_with_the_sequence():
    """Fed the same sequence grown a step at a time (as the engine does), and after a switch to
    another sequence under the same id, the proposer's drafts equal the plain lookup's."""
    rng = torch.Generator().manual_seed(0)
    p = NgramProposer()
    for trial in range(6):
        seq = torch.randint(0, 3 + trial, (300,), generator=rng).tolist()  # small vocabularies: many repeats
        for length in range(1, 300, 7):
            k = 1 + length % 5
            assert p.propose(trial % 2, seq[:length], k) == _lookup_ref(seq[:length], k), (trial, length)
    p.propose(5, [1, 2, 3, 4], 2)
    other = [9, 9, 9, 9, 9, 1, 2, 9, 9]  # longer, and not [1, 2, 3, 4] plus more: converted afresh
    assert p.propose(5, other, 2) == _lookup_ref(other, 2) == [1, 2]
    p.forget(0)
    assert p._seqs.keys() == {1, 5}


def test_ngram_proposer():
    p = NgramProposer()
    assert p.propose(0, [1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]  # longest suffix first: 1 2 3
    assert p.propose(0, [1, 2, 9, 1, 2, 7, 1, 2], 4) == [7, 1, 2]  # the latest occurrence
    assert p.propose(0, [1, 2, 3], 2) == [] and p.propose(0, [1, 2, 1, 2], 0) == []
    assert NgramProposer(min_n=1, max_n=1).propose(0, [4, 1, 5, 4], 2) == [1, 5]
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(min_n=3, max_n=2)


def _chi2(tokens, probs_V):
    """Pearson's statistic of observed tokens against probs_V over its support, and the support size."""
    probs_V = probs_V.cpu()
    support = probs_V.nonzero().flatten().tolist()
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs_V)).double()
    assert counts.sum() == counts[support].sum()  # nothing drawn outside the support
    expected = probs_V.double()[support] * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), len(support)


def check_second_and_third(outs, prompt, t0, c1, dist):
    """Sampled outputs that begin with t0: their second token is distributed as dist(prompt + [t0]),
    and, where that is c1, their third as dist(prompt + [t0, c1]) (Pearson's chi-square, p = 0.001)."""
    first = [t for t in outs if t[0] == t0]
    stat, k = _chi2([t[1] for t in first], dist(prompt + [t0]))
    assert len(first) > 300 and stat < 20.5, (stat, k, len(first))  # 20.5: p = 0.001 at 5 degrees of freedom
    second = [t for t in first if t[1] == c1]
    stat, k = _chi2([t[2] for t in second], dist(prompt + [t0, c1]))
    assert len(second) > 40 and stat < 20.5, (stat, k, len(second))


def test_speculative_sampling_draws_from_the_target_distribution(params):
    """Drafts kept with probability p(d), a rejected one redrawn from p without d: each token
    is distributed as plain sampling's (Pearson's chi-square over the top-k support)."""
    from mimo_fn.layers.sampling import filtered_probs

    sp = mf.SamplingParams(temperature=1.0, top_k=6, seed=0)
    prompt, n = [5, 6, 7], 3000

    def dist(tokens):
        p_V = filtered_probs(mf.forward(params, CFG, torch.tensor(tokens))[-1:], sp)[0]
        return p_V / p_V.sum()

    t0_counts = torch.bincount(torch.tensor([o.tokens[0] for o in _engine(params).generate(
        [prompt] * 64, 1, sampling=sp)]), minlength=CFG.vocab_size)
    t0 = int(t0_counts.argmax())  # the commonest first token: the samples below are conditioned on it
    c1 = int(dist(prompt + [t0]).argmax())  # drafts: each position's likeliest token
    c2 = int(dist(prompt + [t0, c1]).argmax())

    class Fixed:
        def propose(self, rid, tokens, k):
            return [c1, c2][:k]

    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=8 * n, page_size=4, max_batch=1024,
                                                    num_draft_tokens=2, proposer=Fixed()))
    outs = [o.tokens for o in engine.generate([prompt] * n, 3, sampling=sp)]
    assert 0 < engine.spec_stats()["accepted"] < engine.spec_stats()["drafted"]  # both branches ran
    check_second_and_third(outs, prompt, t0, c1, dist)
    again = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=8 * n, page_size=4, max_batch=1024,
                                                   num_draft_tokens=2, proposer=Fixed()))
    assert [o.tokens for o in again.generate([prompt] * n, 3, sampling=sp)] == outs  # same seeds, same tokens


def test_proposers_see_prompt_and_tokens_as_one_sequence():
    """The engine hands proposers prompt + generated tokens as one read-only view (no copy)."""
    from mimo_fn.speculative.ngram import JoinedTokens

    j = JoinedTokens([0, 1, 2, 3, 4], [7, 8])
    assert list(j) == [0, 1, 2, 3, 4, 7, 8] and len(j) == 7 and j[-1] == 8 and j[5] == 7 and j[-3] == 4
    assert j[2:6] == [2, 3, 4, 7] and j[::-3] == [8, 3, 0] and 7 in j and j.index(8) == 6
    with pytest.raises(IndexError, match="token index 7 out of range for 7 tokens"):
        j[7]
    assert NgramProposer().propose(0, JoinedTokens([5, 6, 7], [8, 5, 6]), 2) == [7, 8]
