"""DFlash drafts: hidden-state capture, the draft's context cache, and lossless decoding through Engine
(on the GPU where there is one: the Triton kernels, CUDA graphs).
"""

import pytest
import torch
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from mimo_fn.model import lm_head
from mimo_fn.rl import memory
from mimo_fn.speculative import dflash, dflash_checkpoint
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash

CFG = mf.ModelConfig.tiny()
DCFG = DFlashConfig(target_layers=(1, 3), mask_token_id=CFG.vocab_size - 1, block_size=4, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the Triton kernels and CUDA graphs


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=3, device=DEVICE)


def _drafter(seed=1):
    return init_dflash(CFG, DCFG, seed=seed, device=DEVICE)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _tokens(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_hidden_capture_is_the_residual_stream(params):
    toks = _tokens(19, 0)
    state = mf.init_state(CFG, params, 128, page_size=4)
    state, out = mf.prefill(state, mf.Batch.from_tokens([0], [toks]), all_logits=True, capture_hidden=(3, 1))
    assert out.hidden_TLH.shape == (19, 2, CFG.hidden_size)
    # the last layer's output, through the final norm and the LM head, is the logits
    torch.testing.assert_close(lm_head(out.hidden_TLH[:, 0], params, CFG), out.logits_TV, atol=1e-6, rtol=0)
    chunked = mf.init_state(CFG, params, 128, page_size=4)
    parts = []
    for a, b in ((0, 7), (7, 8), (8, 19)):
        chunked, o = mf.prefill(chunked, mf.Batch.from_tokens([0], [toks[a:b]]), capture_hidden=(3, 1))
        parts.append(o.hidden_TLH)
    torch.testing.assert_close(torch.cat(parts), out.hidden_TLH, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"capture_hidden layer 4 is not in \[0, 4\)"):
        mf.prefill(chunked, mf.Batch.from_tokens([0], [[1]]), capture_hidden=(4,))


def test_draft_context_cache_equals_one_pass(params):
    """Observing the context in pieces gives the drafts (and logits) of observing it at once."""
    drafter = _drafter()
    hidden_CLH = _randn(13, 2, CFG.hidden_size, seed=2)
    whole, pieces = DFlashProposer(drafter, DCFG, params, CFG), DFlashProposer(drafter, DCFG, params, CFG)
    whole.observe(7, hidden_CLH)
    for a, b in ((0, 1), (1, 6), (6, 13)):
        pieces.observe(7, hidden_CLH[a:b])
    tokens = _tokens(14, 3)
    assert whole.propose(7, tokens, 3) == pieces.propose(7, tokens, 3)
    args = (torch.tensor([tokens[-1]] + [DCFG.mask_token_id] * 3, device=DEVICE), torch.arange(13, 17, device=DEVICE))
    torch.testing.assert_close(dflash.draft_logits(drafter, DCFG, params, pieces.context(7), *args),
                               dflash.draft_logits(drafter, DCFG, params, whole.context(7), *args), atol=1e-5, rtol=0)
    assert len(whole.propose(7, tokens, 9)) == DCFG.block_size - 1  # a block holds block_size - 1 drafts
    with pytest.raises(ValueError, match="has 13 observed tokens, expected 14"):
        whole.propose(7, tokens + [1], 2)
    whole.forget(7)
    assert whole.context_len(7) == 0


def test_batched_drafts_equal_one_sequence_drafts(params):
    """propose_many (one batched forward over the paged contexts) gives each sequence the
    logits and drafts of the plain one-sequence `draft_logits`, for contexts of different
    lengths observed in pieces, the page pool grown (and copied) twice on the way."""
    drafter = _drafter()
    gen = torch.Generator().manual_seed(5)
    lens = {4: 5, 9: 70, 2: 1}
    hidden = {rid: torch.randn(n, 2, CFG.hidden_size, generator=gen).to(DEVICE) for rid, n in lens.items()}
    proposer = DFlashProposer(drafter, DCFG, params, CFG)
    proposer.observe_many([(rid, h[:len(h) // 2]) for rid, h in hidden.items()])
    pool = proposer.cache.full.num_pages
    proposer.observe_many([(rid, h[len(h) // 2:]) for rid, h in hidden.items()])
    assert proposer.cache.full.num_pages > pool
    asks = [(rid, _tokens(n + 1, rid), k) for (rid, n), k in zip(lens.items(), (3, 2, 0))]
    got = proposer.propose_many(asks)
    assert got[2] == [] and [len(d) for d in got[:2]] == [3, 2]
    B = DCFG.block_size
    blocks_RB = torch.tensor([[tokens[-1]] + [DCFG.mask_token_id] * (B - 1) for _, tokens, _ in asks], device=DEVICE)
    pos_RB = torch.tensor([[n] for n in lens.values()], device=DEVICE) + torch.arange(B, device=DEVICE)
    batched_RJV = proposer.logits_many([(rid, tokens, B - 1) for rid, tokens, _ in asks])
    for r, (rid, n) in enumerate(lens.items()):
        ctx = dflash.context_kv(drafter, DCFG, hidden[rid], torch.arange(n, device=DEVICE))
        want_BV = dflash.draft_logits(drafter, DCFG, params, ctx, blocks_RB[r], pos_RB[r])
        torch.testing.assert_close(batched_RJV[r], want_BV[1:], atol=1e-5, rtol=0)
        assert got[r] == want_BV[1:1 + asks[r][2]].argmax(-1).tolist()


def test_draft_attends_to_the_context(params):
    """A different context gives different draft logits: the target's hidden states are read."""
    drafter = _drafter()
    a, b = (dflash.context_kv(drafter, DCFG, _randn(5, 2, CFG.hidden_size, seed=s), torch.arange(5, device=DEVICE))
            for s in (4, 5))
    args = (torch.tensor([3] + [DCFG.mask_token_id] * 3, device=DEVICE), torch.arange(5, 9, device=DEVICE))
    assert not torch.allclose(dflash.draft_logits(drafter, DCFG, params, a, *args),
                              dflash.draft_logits(drafter, DCFG, params, b, *args))


def test_dflash_speculative_equals_plain_greedy(params):
    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4)).generate(
        PROMPTS, 16, return_logprobs=True)
    proposer = DFlashProposer(_drafter(), DCFG, params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    got = engine.generate(PROMPTS, 16, return_logprobs=True)
    for g, w in zip(got, plain):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    assert engine.spec_stats()["drafted"] > 0
    assert proposer.seqs == {} and len(proposer.cache.full.free) == proposer.cache.full.num_pages  # all back


def test_copies_of_a_prompt_start_from_its_draft_context(params):
    """Identical prompts prefill once (EngineConfig.share_prompts): each copy's draft context is
    a copy of the one that ran (DFlashProposer.fork), equal to what it observes prefilling the
    prompt itself. The prompt spans three passes and the last has no room left for the second
    prompt, so the copies wait: the prompt is held (sequence 4, forked before rid 0 decodes) and
    the copies fork that, context included, a pass later. Prompts that begin alike fork their
    prefix's context the same way (rule 6)."""
    class Recorder(DFlashProposer):
        def propose_many(self, asks):  # each request's context when it first drafts
            for rid, _, _ in asks:
                self.first.setdefault(rid, [kv.clone() for layer in self.context(rid) for kv in layer])
            return super().propose_many(asks)

    def forks_and_same_contexts(prompts, chunk_size):
        """The forks of the sharing engine; its tokens and first draft contexts equal the other's."""
        got, contexts, forks = {}, {}, []
        for share in (False, True):
            rec = Recorder(_drafter(), DCFG, params, CFG)
            rec.first = {}
            real_fork = rec.fork
            rec.fork = lambda sources, upto=None: (forks.append(dict(sources)), real_fork(sources, upto))
            engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=chunk_size,
                                                            num_draft_tokens=3, proposer=rec, share_prompts=share))
            got[share], contexts[share] = [o.tokens for o in engine.generate(prompts, 8)], rec.first
            assert rec.seqs == {}
        assert got[True] == got[False]
        for rid in range(len(prompts)):
            for a, b in zip(contexts[True][rid], contexts[False][rid], strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        return forks

    assert forks_and_same_contexts([PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1]], 4) == [{4: 0}, {2: 4, 3: 4}]
    # prompts that begin with PROMPTS[1]'s 11 tokens: the 8 of whole pages are prefilled once (the
    # prefix is sequence 3) and each prompt forks their context before it prefills the rest
    assert forks_and_same_contexts([PROMPTS[1] + [7, 7], PROMPTS[0], PROMPTS[1] + [2]], 8) == [{0: 3}, {2: 3}]
    proposer = DFlashProposer(_drafter(), DCFG, params, CFG)
    proposer.observe(0, _randn(6, len(DCFG.target_layers), CFG.hidden_size, seed=4))
    proposer.fork({1: 0})
    assert all(torch.equal(x, y) for a, b in zip(proposer.context(0), proposer.context(1)) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="sequence 1 holds context already"):
        proposer.fork({1: 0})


def test_forked_draft_contexts_hold_whole_pages_in_common(params):
    """The draft's context pages come from mimo_fn.cache, as the target's K/V do: a fork holds
    the pages its source filled (no copy) and copies the last, partly filled one; each goes on
    writing past its own context only, so neither changes the other's; a page shared by both is
    free once both are forgotten, and not before."""
    S = dflash.DRAFT_PAGE_SIZE
    proposer = DFlashProposer(_drafter(), DCFG, params, CFG)
    proposer.observe(0, _randn(2 * S + 5, 2, CFG.hidden_size, seed=8))
    before = [kv.clone() for layer in proposer.context(0) for kv in layer]
    proposer.fork({1: 0, 2: 0}, upto={2: 2 * S})
    src, one, two = (proposer.seqs[rid].full for rid in (0, 1, 2))
    assert one[:2] == two == src[:2] and one[2] != src[2]  # whole pages held in common, the partial one copied
    assert proposer.cache.full.holders == {src[0]: 3, src[1]: 3}
    for rid, seed in ((0, 9), (1, 10), (2, 11)):  # each writes on past its own context
        proposer.observe(rid, _randn(S, 2, CFG.hidden_size, seed=seed))
    got = [kv for layer in proposer.context(1) for kv in layer]
    for a, b in zip(got, before, strict=True):  # rid 1's first 2S + 5 tokens are the ones it forked
        assert torch.equal(a[:2 * S + 5], b)
    for rid, first in ((0, before), (2, [kv[:2 * S] for kv in before])):  # and so are the others'
        assert all(torch.equal(a[:len(b)], b) for a, b in zip((kv for layer in proposer.context(rid)
                                                                for kv in layer), first, strict=True))
    proposer.forget(0)
    proposer.forget(2)
    pool = proposer.cache.full  # every page but rid 1's is free: the shared two are its alone now
    assert pool.holders == {} and sorted(pool.free + proposer.seqs[1].full) == list(range(pool.num_pages))
    assert all(torch.equal(a[:2 * S + 5], b) for a, b in zip((kv for layer in proposer.context(1) for kv in layer),
                                                             before, strict=True))
    proposer.forget(1)
    assert proposer.seqs == {} and len(proposer.cache.full.free) == proposer.cache.full.num_pages


def test_the_prefix_cache_forks_draft_contexts(params):
    """With EngineConfig.prefix_cache a DFlash engine keeps each finished request's draft context
    beside its K/V: a later turn forks the part it shares (DFlashProposer.fork up to that many
    tokens: all of the turn before, then, for a prompt that shares only the first 20 tokens of
    one, 19 of them), so its first draft context equals the one an engine without the cache
    observes prefilling the whole prompt, and its tokens and log-probs, greedy and sampled, equal
    that engine's. Between calls the entries alone hold draft pages, each its K/V's length of
    context, and they go with the entries."""
    class Recorder(DFlashProposer):
        def propose_many(self, asks):  # each request's context when it first drafts
            for rid, _, _ in asks:
                self.first.setdefault(rid, [kv.clone() for layer in self.context(rid) for kv in layer])
            return super().propose_many(asks)

    recs, engines = {}, {}
    for cache in (False, True):
        recs[cache] = Recorder(_drafter(), DCFG, params, CFG)
        engines[cache] = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=1024, page_size=4, chunk_size=16,
                                                                num_draft_tokens=3, proposer=recs[cache],
                                                                prefix_cache=cache))
    talks = [_tokens(23, 5), _tokens(14, 6)]
    sampling = [None, mf.SamplingParams(temperature=1.0, seed=2)]
    for turn in range(4):
        if turn == 3:  # a prompt that shares the first 20 tokens of an entry
            talks, sampling = [talks[0][:20] + _tokens(5, 20)], sampling[:1]
        outs = {}
        for cache in (False, True):
            recs[cache].first = {}
            outs[cache] = engines[cache].generate(talks, max_new_tokens=7, sampling=sampling, return_logprobs=True)
        for a, b in zip(outs[True], outs[False], strict=True):
            assert a.tokens == b.tokens
            torch.testing.assert_close(torch.tensor(a.prompt_logprobs + a.logprobs),
                                       torch.tensor(b.prompt_logprobs + b.logprobs), atol=1e-5, rtol=0)
        firsts = [[recs[cache].first[rid] for rid in sorted(recs[cache].first)] for cache in (True, False)]
        assert len(firsts[0]) == len(talks)  # (only the requests draft)
        for a, b in zip(*firsts, strict=True):
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        entries = engines[True].prefix_cache.entries
        # (a turn forks all of the one before but its last drawn token, which has no K/V: not the new 3)
        assert engines[True].prefix_stats == ({"hits": 0, "tokens": 0} if turn == 0 else {"hits": 1, "tokens": 19}
                                              if turn == 3 else {"hits": 2, "tokens": sum(len(t) - 4 for t in talks)})
        assert set(recs[True].seqs) == set(entries) and recs[False].seqs == {}
        assert all(recs[True].context_len(seq) == e.length for seq, e in entries.items())
        talks = [t + o.tokens + _tokens(3, 10 + turn) for t, o in zip(talks, outs[True])]
    engines[True].update_weights({})  # the cache empties, draft contexts too
    assert recs[True].seqs == {} and len(recs[True].cache.full.free) == recs[True].cache.full.num_pages


@pytest.mark.parametrize("chunk", [16384, 4])  # 4: prompts prefilled over several passes
def test_observed_context_is_every_kept_token(params, chunk):
    """The engine feeds the drafter exactly the tokens whose KV it keeps, prompt chunks and
    accepted drafts: here the draft model runs, and then greedy's own continuation is proposed,
    so steps keep several tokens."""
    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4)).generate(PROMPTS, 12)
    full = [p + o.tokens for p, o in zip(PROMPTS, plain)]

    class Recorder(DFlashProposer):
        seen = []

        def propose_many(self, asks):
            self.seen += [(len(tokens), self.context_len(rid)) for rid, tokens, _ in asks]
            super().propose_many(asks)
            follow = [next(f for f in full if f[:len(tokens)] == list(tokens)) for _, tokens, _ in asks]
            return [f[len(tokens):len(tokens) + k] for f, (_, tokens, k) in zip(follow, asks)]

    rec = Recorder(_drafter(), DCFG, params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=chunk,
                                                    num_draft_tokens=3, proposer=rec))
    assert [o.tokens for o in engine.generate(PROMPTS, 12)] == [o.tokens for o in plain]
    assert engine.spec_stats()["accepted"] == engine.spec_stats()["drafted"] > 0
    assert len(rec.seen) >= 6 and all(context == n - 1 for n, context in rec.seen)


def test_bad_dflash_configs(params):
    with pytest.raises(ValueError, match=r"target_layers = \(4,\): expected layers of the target, in \[0, 4\)"):
        init_dflash(CFG, DFlashConfig(target_layers=(4,), mask_token_id=0))
    with pytest.raises(ValueError, match="block_size = 1"):
        init_dflash(CFG, DFlashConfig(target_layers=(1,), mask_token_id=0, block_size=1))
    with pytest.raises(ValueError, match=r"fc is \[64, 128\], expected \[64, 64\]"):
        DFlashProposer(_drafter(0), DFlashConfig(target_layers=(1,), mask_token_id=0), params, CFG)


def _zlab_config(**changes):
    """A config.json as z-lab writes it for a plain DFlash draft (transformers 5 rope layout)."""
    hf = {"architectures": ["DFlashDraftModel"], "attention_bias": False, "is_causal": False,
          "dflash_config": {"block_size": 4, "mask_token_id": CFG.vocab_size - 1, "target_layer_ids": [1, 3]},
          "head_dim": 16, "hidden_act": "silu", "hidden_size": CFG.hidden_size, "intermediate_size": 48,
          "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
          "tie_word_embeddings": False, "vocab_size": CFG.vocab_size}
    hf.update(changes)
    return hf


def test_zlab_config_fields():
    assert dflash_checkpoint.dflash_config_from_hf(_zlab_config(), CFG) == DCFG
    old_rope = _zlab_config(rope_theta=5e5)
    del old_rope["rope_parameters"]
    assert dflash_checkpoint.dflash_config_from_hf(old_rope, CFG).rope_theta == 5e5
    refused = [
        (_zlab_config(architectures=["DFlash2DraftModel"]), "DFlash2"),
        (_zlab_config(layer_types=["sliding_attention"] * 2, sliding_window=2048), "sliding-window or causal"),
        (_zlab_config(hidden_size=2 * CFG.hidden_size), "differs from the target's"),
        (_zlab_config(dflash_config={"mask_token_id": 0}), "'target_layer_ids' is missing"),
        (_zlab_config(dflash_config={"target_layer_ids": [1], "mask_token_id": 0, "final_logit_softcapping": 20.0}),
         "final_logit_softcapping"),
    ]
    for hf, match in refused:
        with pytest.raises(ValueError, match=match):
            dflash_checkpoint.dflash_config_from_hf(hf, CFG)


def test_dflash_checkpoint_round_trip(params, tmp_path):
    """save_dflash writes z-lab's names; load_dflash gives back every tensor and the same drafts."""
    drafter = _drafter()
    norms = {"self_attn.q_norm": 2.0, "self_attn.k_norm": 3.0, "input_layernorm": 4.0, "post_attention_layernorm": 5.0}
    for field, value in zip(("q_norm", "k_norm", "attn_norm", "mlp_norm"), norms.values()):
        getattr(drafter.layers[1], field).fill_(value)  # which norm lands under which name
    dflash_checkpoint.save_dflash(drafter, DCFG, CFG, tmp_path / "d")
    saved = load_file(tmp_path / "d" / "model.safetensors")
    assert len(saved) == 3 + 11 * DCFG.num_layers
    for name, value in norms.items():
        assert (saved[f"layers.1.{name}.weight"] == value).all()
    # the projections' shapes as z-lab's checkpoints hold them: [out, in]
    assert {n: list(saved[f"layers.0.{n}.weight"].shape) for n in ("self_attn.q_proj", "self_attn.k_proj",
            "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")} == {
        "self_attn.q_proj": [64, 64], "self_attn.k_proj": [32, 64], "self_attn.o_proj": [64, 64],
        "mlp.gate_proj": [48, 64], "mlp.down_proj": [64, 48]}
    assert list(saved["fc.weight"].shape) == [64, 128]
    dcfg, loaded = dflash_checkpoint.load_dflash(tmp_path / "d", CFG, dtype=torch.float32, device=DEVICE)
    assert dcfg == DCFG
    def leaves(p):
        return [p.fc, p.hidden_norm, p.norm] + [getattr(layer, f) for layer in p.layers for f in vars(layer)]

    assert len(leaves(loaded)) == 3 + 11 * DCFG.num_layers
    assert all(torch.equal(a, b) for a, b in zip(leaves(drafter), leaves(loaded)))
    hidden = _randn(9, 2, CFG.hidden_size, seed=6)
    got = []
    for p in (drafter, loaded):
        proposer = DFlashProposer(p, DCFG, params, CFG)
        proposer.observe(0, hidden)
        got.append(proposer.propose(0, _tokens(10, 7), 3))
    assert got[0] == got[1]
    weights = load_file(tmp_path / "d" / "model.safetensors")
    weights["layers.0.self_attn.k_proj.weight"] = weights["layers.0.self_attn.k_proj.weight"][:-1]
    save_file(weights, tmp_path / "d" / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj.weight has shape \[31, 64\], expected \[32, 64\]"):
        dflash_checkpoint.load_dflash(tmp_path / "d", CFG)
    del weights["norm.weight"]
    save_file(weights, tmp_path / "d" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight'\]"):
        dflash_checkpoint.load_dflash(tmp_path / "d", CFG)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_draft_graph_equals_eager(params):
    """The draft replayed from CUDA graphs (3 sequences padded to 4, tables to 16 or 32 pages)
    gives the eager draft's logits and drafts, also after the page pool grew (its graphs
    dropped and captured again at the new addresses)."""
    drafter = _drafter()
    eager, graphed = (DFlashProposer(drafter, DCFG, params, CFG, cuda_graphs=g) for g in (False, True))
    lens = {1: 3, 2: 40, 3: 9}
    for p in (eager, graphed):
        p.observe_many([(rid, _randn(n, 2, CFG.hidden_size, seed=rid)) for rid, n in lens.items()])
    asks = [(rid, _tokens(n + 1, rid), 3) for rid, n in lens.items()]
    torch.testing.assert_close(graphed.logits_many(asks), eager.logits_many(asks), atol=1e-5, rtol=0)
    assert len(graphed._graphs) == 1
    pool = graphed.cache.full.num_pages
    for p in (eager, graphed):
        p.observe_many([(2, _randn(300, 2, CFG.hidden_size, seed=9))])
    assert graphed.cache.full.num_pages > pool and not graphed._graphs
    asks[1] = (2, _tokens(341, 2), 3)
    torch.testing.assert_close(graphed.logits_many(asks), eager.logits_many(asks), atol=1e-5, rtol=0)
    assert graphed.cuda_graphs and len(graphed._graphs) == 1  # captured again, not fallen back to eager
    assert graphed.propose_many(asks) == eager.propose_many(asks)


def test_observe_verified_equals_observing_the_kept_rows(params):
    """After a verify step the engine hands the drafter every fed row and how many stay
    (observe_verified): its next drafts equal those of observing the kept rows alone, though
    the rejected rows' keys and values (and, for the shorter feeds, padding rows) were written
    past the context. The same when observe_fed wrote those rows during the step (then
    observe_verified writes nothing), and when observe_fed had other rows (it writes again)."""
    drafter = _drafter()
    # (eager: a CUDA graph's capture would call _write_context more than once)
    kept_only, all_rows, fed_first, fed_other = (DFlashProposer(drafter, DCFG, params, CFG, cuda_graphs=False)
                                                 for _ in range(4))
    lens = {1: 6, 2: 19, 3: 2}
    writes = []
    for p in (kept_only, all_rows, fed_first, fed_other):
        p.observe_many([(rid, _randn(n, 2, CFG.hidden_size, seed=rid)) for rid, n in lens.items()])
        write = p._write_context
        p._write_context = lambda *a, p=p, write=write: (writes.append(p), write(*a))
    fed = [(rid, _randn(q, 2, CFG.hidden_size, seed=10 + rid), kept) for rid, q, kept in zip(lens, (2, 4, 3), (1, 4, 2))]
    kept_only.observe_many([(rid, h[:kept]) for rid, h, kept in fed])
    all_rows.observe_verified(fed)
    fed_first.observe_fed([(rid, h) for rid, h, _ in fed])
    fed_first.observe_verified(fed)
    fed_other.observe_fed([(rid, torch.randn_like(h)) for rid, h, _ in fed])
    fed_other.observe_verified(fed)
    assert writes.count(fed_first) == 1 and writes.count(fed_other) == 2
    asks = [(rid, _tokens(lens[rid] + kept + 1, rid), 3) for rid, _, kept in fed]
    for p in (all_rows, fed_first, fed_other):
        assert [p.context_len(rid) for rid in lens] == [n + kept for n, (_, _, kept) in zip(lens.values(), fed)]
        torch.testing.assert_close(p.logits_many(asks), kept_only.logits_many(asks), atol=1e-5, rtol=0)
        assert p.propose_many(asks) == kept_only.propose_many(asks)


def test_release_memory_frees_the_draft_context_pages(params):
    """Engine.release_memory("kv_cache") frees the draft's page pools with the target's KV pools
    (on CUDA also the graphs' memory, which any release drops); after resume_memory the same
    prompts give the same tokens (the pools back at full size, the draft's graphs captured
    again on the GPU). Not while a sequence holds draft pages."""
    proposer = DFlashProposer(_drafter(), DCFG, params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    want = [o.tokens for o in engine.generate(PROMPTS, 10)]
    pools = proposer.kv_cache_tensors()
    assert len(pools) == 2 * DCFG.num_layers and all(t.untyped_storage().nbytes() > 0 for t in pools)
    target = sum(t.untyped_storage().nbytes() for t in memory.tagged_tensors(engine.state, "kv_cache"))
    draft = sum(t.untyped_storage().nbytes() for t in pools)
    freed = engine.release_memory("kv_cache")
    assert freed == target + draft if DEVICE == "cpu" else freed >= target + draft  # CUDA: the graphs' pools too
    assert all(t.untyped_storage().nbytes() == 0 for t in pools) and not proposer._graphs
    engine.resume_memory()
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in pools)
    assert [o.tokens for o in engine.generate(PROMPTS, 10)] == want
    assert bool(proposer._graphs) == (DEVICE == "cuda") and proposer.cuda_graphs  # captured again
    proposer.observe(7, _randn(3, 2, CFG.hidden_size, seed=7))  # a sequence that holds pages
    with pytest.raises(ValueError, match="hold draft context pages"):
        engine.release_memory("kv_cache")
    assert all(t.untyped_storage().nbytes() > 0 for t in pools)  # nothing was freed


def test_release_memory_frees_the_draft_weights_with_a_backup(params, tmp_path):
    """release_memory("weights") frees the draft's weights too, through a host backup even
    without backup=True (update_weights does not write them): once the target's weights are
    rewritten, the same prompts give the same tokens and the same drafts."""
    mf.save_checkpoint(params, CFG, tmp_path)
    proposer = DFlashProposer(_drafter(), DCFG, params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    want = [o.tokens for o in engine.generate(PROMPTS, 10)]
    drafted = engine.spec_stats()["drafted"]
    draft = proposer.weight_tensors()
    before = [t.clone() for t in draft]
    target = sum(t.untyped_storage().nbytes() for t in memory.tagged_tensors(engine.state, "weights"))
    freed = engine.release_memory("weights")
    assert freed == target + sum(t.untyped_storage().nbytes() for t in before) if DEVICE == "cpu" else freed > target
    assert all(t.untyped_storage().nbytes() == 0 for t in draft)
    engine.resume_memory()
    assert all(torch.equal(t, b) for t, b in zip(draft, before))
    engine.update_weights(load_file(tmp_path / "model.safetensors").items())
    assert [o.tokens for o in engine.generate(PROMPTS, 10)] == want
    assert engine.spec_stats()["drafted"] == drafted


def test_drafts_left_on_the_device_verify_as_the_listed_ones(params):
    """propose_device (drafts queued on the device, read while the verify step runs) gives the
    tokens, acceptance and draft contexts of propose_many's lists, and greedy's own tokens; a
    proposer's tensor of the wrong shape or dtype is a ValueError naming it."""
    used = []

    class Listed(DFlashProposer):
        def propose_device(self, asks):
            return None

    class Counted(DFlashProposer):
        def propose_device(self, asks):
            out = super().propose_device(asks)
            used.append(out is not None)
            return out

    def run(cls, draft=None):
        rec = cls(draft or _drafter(), DCFG, params, CFG)
        engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3, proposer=rec))
        outs = engine.generate(PROMPTS, 13)
        return [o.tokens for o in outs], [o.accept_lengths for o in outs], engine.spec_stats()

    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4)).generate(PROMPTS, 13)
    listed, counted = run(Listed), run(Counted)
    assert listed == counted and counted[0] == [o.tokens for o in plain]
    assert used and all(used)  # every step's requests asked for the same k (fewer near the end)

    class Bad(DFlashProposer):
        def propose_device(self, asks):
            return torch.zeros(len(asks), 9, dtype=torch.long, device=DEVICE)

    with pytest.raises(ValueError, match=r"propose_device returned torch.int64 \[3, 9\]; expected int64 \[3, 1 .. 3\]"):
        run(Bad)
