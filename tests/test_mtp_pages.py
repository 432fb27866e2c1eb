"""The MTP proposer's keys and values live in pages of mimo_fn.cache's allocator: requests take
pages as they grow, a fork shares whole pages and copies the last partial one, forget gives them
back, and the engine's memory release frees the page tensors (kv_cache_tensors). On a GPU the
chain replayed from CUDA graphs drafts as the eager chain does."""

import pytest
import torch

import mimo_fn as mf
from mimo_fn.cache import KVCache
from mimo_fn.kernels.attention.ref import attend
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.model import decoder_layer
from mimo_fn.rl import memory
from mimo_fn.speculative.mtp import MTP_PAGE_SIZE, MTPProposer, init_mtp, mtp_model_config

CFG = mf.ModelConfig.tiny()
S = MTP_PAGE_SIZE
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the Triton kernels and CUDA graphs
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]


def _hidden(params, tokens):
    state = mf.init_state(CFG, params, 256, page_size=4)
    _, out = mf.prefill(state, mf.Batch.from_tokens([0], [tokens]), capture_hidden=(CFG.num_layers - 1,))
    return out.hidden_TLH


def _keys(mtp, params, li, tokens, hidden_TLH):
    """Layer li's keys and values of rows (x_{p+1}, h_p), p < n, computed densely."""
    layer, mcfg, eps = mtp.layers[li], mtp_model_config(CFG), CFG.rms_norm_eps
    n = hidden_TLH.shape[0]
    h = rms_norm(hidden_TLH[:, 0], params.norm, eps)
    x = linear(torch.cat([rms_norm(params.embed[torch.tensor(tokens[1:n + 1])], layer.enorm, eps),
                          rms_norm(h, layer.hnorm, eps)], dim=-1), layer.eh_proj)
    kv, pos = [], torch.arange(n)

    def attn_fn(_, q, k, v):
        kv.append((k, v))
        return attend(q, k, v, pos, pos, mcfg.scale, mcfg.window(0), layer.block.attn.sinks)

    decoder_layer(x, layer.block, mcfg, 0, pos, attn_fn)
    return kv[0]


def _used(prop):
    return prop.cache.full.num_pages - len(prop.cache.full.free)


def test_mtp_kv_lives_in_cache_pages():
    params = mf.init_params(CFG, seed=3)
    mtp = init_mtp(CFG, 2, seed=4)
    prop = MTPProposer(mtp, params, CFG)
    assert isinstance(prop.cache, KVCache) and prop.kv_cache_tensors() == []  # no pages before a proposal
    tokens = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    hidden = _hidden(params, tokens)
    prop.observe(0, hidden[:20])
    drafts = prop.propose(0, tokens[:21], 3)
    assert prop.cached_len(0) == 20 and _used(prop) == 2  # 20 positions + 2 chain rows: 2 pages of 16
    for li in range(2):  # the pages hold each layer's keys and values of the verified rows
        k_TGD, v_TGE = _keys(mtp, params, li, tokens, hidden[:20])
        slots = torch.tensor([prop.pages[0].full[p // S] * S + p % S for p in range(20)])
        k_pages, v_pages = prop.cache.full.k[li], prop.cache.full.v[li]
        torch.testing.assert_close(k_pages.view(-1, *k_pages.shape[2:])[slots], k_TGD, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_pages.view(-1, *v_pages.shape[2:])[slots], v_TGE, atol=1e-5, rtol=1e-5)

    prop.fork({1: 0}, {1: 20})  # keys below position 19: page 0 shared, page 1 (3 rows) copied
    assert prop.cached_len(1) == 19 and prop.context_len(1) == 20
    assert prop.pages[1].full[0] == prop.pages[0].full[0] and prop.pages[1].full[1] != prop.pages[0].full[1]
    assert prop.cache.full.holders == {prop.pages[0].full[0]: 2} and _used(prop) == 3
    other = tokens[:20] + [(t + 1) % CFG.vocab_size for t in tokens[20:]]
    prop.observe(1, _hidden(params, other)[20:30])
    prop.propose(1, other[:31], 3)
    assert prop.propose(0, tokens[:21], 3) == drafts  # the fork wrote no page request 0 reads
    prop.observe(2, hidden[:5])
    prop.propose(2, tokens[:6], 2)
    used = _used(prop)
    assert used == 2 + 1 + 1  # request 1 (30 + 2 rows): the shared page and its own; request 2: one
    with pytest.raises(ValueError, match="requests hold MTP state"):
        prop.kv_cache_tensors()
    prop.forget(0)
    assert _used(prop) == used - 1 and prop.cache.full.holders == {}  # page 0 stays request 1's
    prop.forget(1)
    prop.forget(2)
    assert _used(prop) == 0 and prop._seqs == {} and prop.pages == {}
    pool = prop.kv_cache_tensors()
    assert len(pool) == 4 and pool[0].shape[1:] == (S, CFG.num_swa_kv_heads, CFG.head_dim)
    assert pool[2].shape[1:] == (S, CFG.num_swa_kv_heads, CFG.v_head_dim)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_chain_graph_equals_eager():
    """The chain replayed from CUDA graphs (3 requests padded to 4; 3 layers, so a layer's keys
    close up over the steps before it) drafts as the eager chain, also after the page pool grew
    (its graphs dropped and captured again at the new addresses)."""
    params = mf.init_params(CFG, seed=3, device="cuda")
    mtp = init_mtp(CFG, 3, seed=4, device="cuda")
    eager, graphed = (MTPProposer(mtp, params, CFG, cuda_graphs=g) for g in (False, True))
    gen = torch.Generator().manual_seed(5)
    tokens = {rid: torch.randint(0, CFG.vocab_size, (250,), generator=gen).tolist() for rid in (1, 2, 3)}
    hidden = {rid: _hidden(params, t[:249]) for rid, t in tokens.items()}
    lens = {1: 3, 2: 40, 3: 9}
    for p in (eager, graphed):
        p.observe_many([(rid, hidden[rid][:n]) for rid, n in lens.items()])
    asks = [(rid, tokens[rid][:n + 1], 5) for rid, n in lens.items()]
    assert graphed.propose_many(asks) == eager.propose_many(asks)
    assert len(graphed._graphs) == 1
    pool = graphed.cache.full.num_pages
    for p in (eager, graphed):
        p.observe(2, hidden[2][40:240])
    asks[1] = (2, tokens[2][:241], 5)
    assert graphed.propose_many(asks) == eager.propose_many(asks)
    assert graphed.cache.full.num_pages > pool
    assert graphed.cuda_graphs and len(graphed._graphs) == 1  # captured again, not fallen back to eager


def test_release_memory_frees_the_mtp_pages():
    """Engine.release_memory("kv_cache") frees the MTP pages with the target's KV pools (on
    CUDA also the chain's graphs); after resume_memory the same prompts give the same tokens
    (on the GPU the graphs captured again)."""
    params = mf.init_params(CFG, seed=3, device=DEVICE)
    proposer = MTPProposer(init_mtp(CFG, 2, seed=5, device=DEVICE), params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    want = [o.tokens for o in engine.generate(PROMPTS, 10)]
    assert engine.spec_stats()["drafted"] > 0 and bool(len(proposer._graphs)) == (DEVICE == "cuda")
    pools = proposer.kv_cache_tensors()
    assert len(pools) == 4 and all(t.untyped_storage().nbytes() > 0 for t in pools)
    target = sum(t.untyped_storage().nbytes() for t in memory.tagged_tensors(engine.state, "kv_cache"))
    freed = engine.release_memory("kv_cache")
    draft = sum(t.numel() * t.element_size() for t in pools)
    assert freed == target + draft if DEVICE == "cpu" else freed >= target + draft  # CUDA: the graphs' pools too
    assert all(t.untyped_storage().nbytes() == 0 for t in pools) and not len(proposer._graphs)
    engine.resume_memory()
    assert [o.tokens for o in engine.generate(PROMPTS, 10)] == want
    assert bool(len(proposer._graphs)) == (DEVICE == "cuda") and proposer.cuda_graphs
