"""A confidence cut on DFlash and MTP drafts (mimo_fn.speculative.draft_cut): each request verifies
only the leading drafts its draft model believes in, the rows past them route to no expert, and
decoding keeps greedy's tokens."""

from dataclasses import replace

import pytest
import torch

import mimo_fn as mf
from mimo_fn.engine import passes
from mimo_fn.layers.moe import moe
from mimo_fn.layers.sampling import SamplingParams
from mimo_fn.speculative.accept import accept_each
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.draft_cut import confident_drafts
from mimo_fn.speculative.mtp import MTPProposer, init_mtp

CFG = mf.ModelConfig.tiny()
DCFG = DFlashConfig(target_layers=(1, 3), mask_token_id=CFG.vocab_size - 1, block_size=4, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=3, device=DEVICE)


def test_confident_drafts_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    logits_RJV = torch.randn(6, 5, 17, generator=gen) * torch.linspace(0.5, 6, 6)[:, None, None]
    for p in (0.0, 0.05, 0.3, 0.7, 0.95):
        want = []
        for r in range(6):
            n, belief = 0, 1.0
            for j in range(5):
                belief *= torch.softmax(logits_RJV[r, j].double(), dim=-1).max().item()
                if belief < p:
                    break
                n += 1
            want.append(n)
        assert confident_drafts(logits_RJV, p).tolist() == want, p
    assert confident_drafts(logits_RJV, 0.0).tolist() == [5] * 6
    with pytest.raises(ValueError, match="min_confidence 1.0, expected a probability in"):
        DFlashProposer(init_dflash(CFG, DCFG), DCFG, mf.init_params(CFG), CFG, min_confidence=1.0)


def test_moe_rows_route_no_expert_past_the_mask(params):
    """moe(rows_T=mask): the kept rows as without a mask, the others no expert (ids -1, the
    residual alone)."""
    layer = next(lay for lay in params.layers if not isinstance(lay.mlp, mf.params.DenseMLP))
    gen = torch.Generator().manual_seed(1)
    x_TH = torch.randn(10, CFG.hidden_size, generator=gen).to(DEVICE, params.embed.dtype)
    res_TH = torch.randn(10, CFG.hidden_size, generator=gen).to(DEVICE, params.embed.dtype)
    rows_T = torch.tensor([1, 1, 0, 1, 0, 0, 1, 1, 1, 0], dtype=torch.bool, device=DEVICE)
    want_TH, want_ids = moe(x_TH, layer.mlp, CFG, residual_TH=res_TH)
    got_TH, got_ids = moe(x_TH, layer.mlp, CFG, residual_TH=res_TH, rows_T=rows_T)
    assert torch.equal(got_ids[rows_T], want_ids[rows_T]) and (got_ids[~rows_T] == -1).all()
    torch.testing.assert_close(got_TH[rows_T], want_TH[rows_T])
    assert torch.equal(got_TH[~rows_T], res_TH[~rows_T])


def test_accept_each_skips_rows_past_the_cut():
    """Rows fed past a request's drafts (fed[b] > 1 + len(drafts[b])) are skipped: greedy and
    sampled decisions equal those over the rows without them."""
    gen = torch.Generator().manual_seed(2)
    V, drafts, fed = 12, [[3, 5], [], [7, 7, 1]], [4, 4, 4]
    logits_TV = torch.randn(sum(fed), V, generator=gen)
    logits_TV[0, 3] = logits_TV[1, 5] = 50.0  # request 0's drafts are greedy's
    keep = [0, 1, 2, 4, 8, 9, 10, 11]
    for sp in (None, SamplingParams(temperature=0.8)):
        sps = [sp] * 3
        got = accept_each(logits_TV, drafts, sps, [torch.Generator().manual_seed(i) for i in range(3)], fed)
        want = accept_each(logits_TV[keep], drafts, sps, [torch.Generator().manual_seed(i) for i in range(3)])
        assert got == want
        if sp is None:
            assert got[0][:2] == [3, 5]
    with pytest.raises(ValueError, match="fed rows"):
        accept_each(logits_TV, drafts, [None] * 3, [torch.Generator()] * 3, [2, 1, 4])


def _engine(params, proposer=None, k=3):
    return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=8,
                                                  num_draft_tokens=k if proposer else 0, proposer=proposer))


def _scaled(scale: float, seed: int = 1):
    """Random draft weights whose final norm is scaled: 0 gives uniform logits (belief 1 / V, so
    a cut verifies nothing), a large scale near one-hot ones (a cut verifies every draft)."""
    d = init_dflash(CFG, DCFG, seed=seed, device=DEVICE)
    return replace(d, norm=d.norm * scale)


@pytest.mark.parametrize("scale, cut", [(30.0, 0.3), (60.0, 0.5), (0.0, 0.1), (1.0, 1e-9)])
def test_decoding_with_a_cut_keeps_greedy_tokens(params, scale, cut):
    """With a cut, three prompts decoded together (chunked prefill, CUDA graphs where there are)
    give plain greedy's tokens; a draft with uniform logits verifies no draft (every step one
    token), and a cut below (1 / V)^3 (a top probability is >= 1 / V) verifies every draft, as
    without a cut."""
    plain = [o.tokens for o in _engine(params).generate(PROMPTS, 14)]
    full = _engine(params, DFlashProposer(_scaled(scale), DCFG, params, CFG))
    cut_engine = _engine(params, DFlashProposer(_scaled(scale), DCFG, params, CFG, min_confidence=cut))
    assert [o.tokens for o in full.generate(PROMPTS, 14)] == plain
    outs = cut_engine.generate(PROMPTS, 14)
    assert [o.tokens for o in outs] == plain
    got, want = cut_engine.spec_stats(), full.spec_stats()
    assert got["drafted"] <= want["drafted"]
    if scale > 1:  # beliefs in between: some drafts verified, not all
        assert 0 < got["drafted"] < want["drafted"]
    if scale == 0.0:
        assert got["drafted"] == 0 and all(n == 1 for o in outs for n in o.accept_lengths)
    if cut < CFG.vocab_size ** -(DCFG.block_size - 1):
        assert got == want


def test_verify_rows_past_the_cut_are_masked(params, monkeypatch):
    """The verify step's batch carries the mask: each request's last token and its verified
    drafts (with uniform draft logits: the last token alone)."""
    seen = []
    real = passes.prefill

    def recording(state, batch, **kw):
        if batch.moe_rows_T is not None:
            seen.append((batch.lens, batch.moe_rows_T.tolist()))
        return real(state, batch, **kw)

    monkeypatch.setattr(passes, "prefill", recording)
    engine = _engine(params, DFlashProposer(_scaled(0.0), DCFG, params, CFG, min_confidence=0.1))
    engine.generate(PROMPTS, 6)
    assert seen
    for lens, rows in seen:
        assert rows == [i == 0 for n in lens for i in range(n)]


def test_propose_many_and_propose_device_cut_alike(params):
    """The host path (propose_many: requests asking different k) and the device path cut each
    request's drafts at the same place."""
    proposer = DFlashProposer(_scaled(30.0, seed=4), DCFG, params, CFG, min_confidence=0.3)
    gen = torch.Generator().manual_seed(5)
    asks = []
    for rid, n in ((0, 9), (1, 21), (2, 4)):
        proposer.observe(rid, torch.randn(n, 2, CFG.hidden_size, generator=gen).to(DEVICE))
        asks.append((rid, torch.randint(0, CFG.vocab_size, (n + 1,), generator=gen).tolist(), 3))
    drafts_RJ, n_R = proposer.propose_device(asks)
    want = [row[:n] for row, n in zip(drafts_RJ.tolist(), n_R.tolist())]
    assert proposer.propose_many(asks) == want
    assert len({len(w) for w in want}) > 1  # (the cut falls at different places)
    mixed = [(rid, tokens, k) for (rid, tokens, _), k in zip(asks, (3, 1, 2))]
    assert proposer.propose_many(mixed) == [w[:k] for w, (*_, k) in zip(want, mixed)]


def test_sampling_under_a_cut_keeps_the_target_distribution():
    """Speculative sampling with cut drafts (each request verifies 0, 1 or 2 of the same two
    drafts, by its id, the rows past the cut fed but unrouted) draws every token from plain
    sampling's distribution (Pearson's chi-square over the top-k support, as test_spec's)."""
    from test_spec import check_second_and_third

    from mimo_fn.layers.sampling import filtered_probs
    from mimo_fn.speculative.proposer import Proposer

    params = mf.init_params(CFG, seed=0)
    sp = mf.SamplingParams(temperature=1.0, top_k=6, seed=0)
    prompt, n = [5, 6, 7], 3000

    def dist(tokens):
        p_V = filtered_probs(mf.forward(params, CFG, torch.tensor(tokens))[-1:], sp)[0]
        return p_V / p_V.sum()

    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4))
    t0 = int(torch.bincount(torch.tensor([o.tokens[0] for o in plain.generate([prompt] * 64, 1, sampling=sp)]),
                            minlength=CFG.vocab_size).argmax())  # the samples below are conditioned on it
    c1 = int(dist(prompt + [t0]).argmax())
    c2 = int(dist(prompt + [t0, c1]).argmax())

    calls = []

    class CutFixed(Proposer):
        def propose(self, rid, tokens, k):
            return [c1, c2][:min(k, rid % 3)]

        def propose_device(self, asks):
            k = asks[0][2]
            calls.append(len(asks))
            return (torch.tensor([[c1, c2][:k]] * len(asks)), torch.tensor([min(k, rid % 3) for rid, *_ in asks]))

    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=10 * n, page_size=4, max_batch=n,
                                                    num_draft_tokens=2, proposer=CutFixed()))
    outs = [o.tokens for o in engine.generate([prompt] * n, 4, sampling=sp)]
    st = engine.spec_stats()
    assert calls == [n]  # the one verify step with room for drafts took them from the device path
    assert 0 < st["accepted"] < st["drafted"] < 2 * st["verified"]  # cut, kept and rejected drafts all ran
    check_second_and_third(outs, prompt, t0, c1, dist)


def test_mtp_cut_follows_the_chains_own_probabilities():
    """MTPProposer(min_confidence=p): the drafts of the plain chain (test_mtp's dense reference),
    cut where the running product of each draft's probability under its step's logits falls
    below p; propose_device gives the same drafts and counts."""
    from test_mtp import _dense_drafts, _hidden

    params = mf.init_params(CFG, seed=3)
    mtp = init_mtp(CFG, 1, seed=4)
    tokens = torch.randint(0, CFG.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = _hidden(params, tokens)
    drafts, beliefs = _dense_drafts(mtp, params, tokens[:13], 4, probs=True)
    products = torch.tensor(beliefs, dtype=torch.float64).cumprod(0).tolist()
    cuts = [products[0] * 1.01, (products[1] + products[2]) / 2, products[-1] * 0.99]  # 0, 2 and 4 kept
    for p, n in zip(cuts, (0, 2, 4)):
        prop = MTPProposer(mtp, params, CFG, min_confidence=p)
        prop.observe(0, hidden[:12])
        assert prop.propose(0, tokens[:13], 4) == drafts[:n]
        got, n_R = prop.propose_device([(0, tokens[:13], 4)])
        assert got.tolist() == [drafts] and n_R.tolist() == [n]
    with pytest.raises(ValueError, match="MTPProposer: min_confidence -0.1, expected a probability in"):
        MTPProposer(mtp, params, CFG, min_confidence=-0.1)


def test_mtp_decoding_with_a_cut_keeps_greedy_tokens(params):
    """MTP drafts under a cut, three prompts decoded together (chunked prefill, CUDA graphs where
    there are): plain greedy's tokens, fewer drafts verified than without the cut but some; a cut
    below (1 / V)^3 verifies every draft, as without a cut."""
    plain = [o.tokens for o in _engine(params).generate(PROMPTS, 14)]
    mtp = init_mtp(CFG, 2, seed=5, device=DEVICE)
    full = _engine(params, MTPProposer(mtp, params, CFG))
    assert [o.tokens for o in full.generate(PROMPTS, 14)] == plain
    for cut in (1e-3, 1e-9):
        engine = _engine(params, MTPProposer(mtp, params, CFG, min_confidence=cut))
        assert [o.tokens for o in engine.generate(PROMPTS, 14)] == plain
        got, want = engine.spec_stats(), full.spec_stats()
        if cut > CFG.vocab_size ** -3:
            assert 0 < got["drafted"] < want["drafted"], (got, want)
        else:
            assert got == want
