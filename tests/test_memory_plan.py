"""The launch memory plan: weights and KV cache counted as the loader and init_state lay them out."""

import dataclasses

import pytest
import torch

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.kernels.moe.mxfp4 import DEQUANT_MIN_PAIRS
from mimo_fn.memory_plan import GiB, activation_bytes, kv_cache_bytes, plan_memory, weight_bytes_per_rank
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params, weight_bytes

CFG = mf.ModelConfig.tiny()


@pytest.mark.parametrize("quant", ["none", "fp8", "mxfp4"])
@pytest.mark.parametrize("dp, tp, ep", [(1, 1, 1), (2, 2, 4), (1, 4, 2)])
def test_weight_bytes_equal_the_sharded_quantised_params(quant, dp, tp, ep):
    """Every rank's count equals the bytes of the params prefill.py builds there (shard, then quantise)."""
    full = mf.init_params(CFG, seed=0, dtype=torch.bfloat16)
    for rank in range(dp * tp):
        mesh = Mesh(dp, tp, ep, rank)
        local = shard_params(full, CFG, mesh)
        if quant != "none":
            local = quantize_params(CFG, local, experts="mxfp4" if quant == "mxfp4" else "fp8")
        assert weight_bytes_per_rank(CFG, mesh, torch.bfloat16, quant) == weight_bytes(local), rank


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_cache_bytes_equal_init_state(tp):
    """The pools init_state allocates on a rank (the tiny config has 1 full and 2 SWA KV heads:
    at tp 2 and 4 the full layers keep their one head)."""
    for dp in (1, 2):
        mesh = Mesh(dp, tp, 1, 0)
        params = shard_params(mf.init_params(CFG, seed=0, dtype=torch.bfloat16), CFG, mesh)
        for tokens, page in ((100, 16), (37, 4)):
            state = mf.init_state(CFG, params, max_tokens=tokens, page_size=page, mesh=mesh)
            pools = (state.cache.full, state.cache.swa)
            held = sum(t.numel() * t.element_size() for pool in pools for t in (*pool.k, *pool.v))
            assert kv_cache_bytes(CFG, tokens, page, torch.bfloat16, tp) == held


def test_plan_check_names_the_parts():
    mesh = Mesh.single()
    flash = mf.ModelConfig.flash()
    plan = plan_memory(flash, mesh, torch.bfloat16, "fp8", max_tokens=65536, page_size=16, chunk=16384,
                       free=140 * GiB)
    # the released model in FP8 on one GPU: ~300 GiB of weights, far past one H200
    assert 280 * GiB < plan.weights < 340 * GiB and not plan.fits
    with pytest.raises(ValueError, match=r"does not fit: per rank: weights 2\d\d\.\d\d GiB \+ KV cache .*\(--tp / --ep\)"):
        plan.check()
    eight = plan_memory(flash, Mesh(2, 4, 8, 0), torch.bfloat16, "fp8", 65536, 16, 16384, free=140 * GiB)
    assert eight.fits and eight.weights < plan.weights / 6  # attention / 4, experts / 8
    mx = plan_memory(flash, Mesh(2, 4, 8, 0), torch.bfloat16, "mxfp4", 65536, 16, 16384, free=140 * GiB)
    assert mx.weights < eight.weights * 0.6  # the experts are most of the bytes, at half the size
    assert plan_memory(CFG, mesh, torch.float32, "none", 64, 4, 64, free=None).fits  # CPU: nothing to check
    with_ref = plan_memory(flash, Mesh(2, 4, 8, 0), torch.bfloat16, "fp8", 65536, 16, 16384, free=140 * GiB,
                           extra_weights=plan.weights)  # a whole reference copy beside the shard
    assert with_ref.weights == eight.weights + plan.weights and not with_ref.fits
    assert activation_bytes(flash, 16384, torch.bfloat16) > activation_bytes(flash, 4096, torch.bfloat16)


def test_mxfp4_temporaries_count_the_dequantised_copy(monkeypatch):
    """From kernels.moe.mxfp4.DEQUANT_MIN_PAIRS pairs an expert (every DP rank's chunk reaches each
    expert) a step holds the bf16 copy of a rank's w13: E / ep experts of [2I, H]."""
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, mxfp4_dequant=None))
    flash = mf.ModelConfig.flash()
    w13 = 2 * flash.num_experts * 2 * flash.moe_intermediate_size * flash.hidden_size  # bf16 bytes
    at = DEQUANT_MIN_PAIRS * flash.num_experts // flash.top_k  # the first chunk that takes the path
    for chunk, dp, ep, copy in ((at, 1, 1, w13), (at - 16, 1, 1, 0), (at // 2, 2, 8, w13 // 8), (at // 2, 1, 8, 0)):
        extra = (activation_bytes(flash, chunk, torch.bfloat16, 1, "mxfp4", dp, ep)
                 - activation_bytes(flash, chunk, torch.bfloat16, 1, "fp8", dp, ep))
        assert extra == copy, (chunk, dp, ep)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_attention_temporaries_equal_the_quantisers_buffers(tp):
    """With MIMO_FN_ATTENTION_FP8=1 a full-attention call holds its layer's pool requantised:
    the count equals the buffers quantize_paged_kv_fp8 allocates for a rank's real pool (an empty
    batch: it allocates them and launches nothing), and the plan and the server's KV sizing take it in."""
    from mimo_fn.kernels.attention.fp8 import quantize_paged_kv_fp8
    from mimo_fn.memory_plan import fp8_attention_bytes, fp8_attention_page_bytes
    from mimo_fn.serve.launch import kv_tokens_that_fit

    mesh = Mesh(1, tp, 1, 0)
    params = shard_params(mf.init_params(CFG, seed=0, dtype=torch.bfloat16), CFG, mesh)
    state = mf.init_state(CFG, params, max_tokens=100, page_size=16, mesh=mesh)
    k, v = state.cache.full.k[0], state.cache.full.v[0]
    none = torch.zeros(0, 1, dtype=torch.int32)
    held = sum(t.numel() * t.element_size() for t in quantize_paged_kv_fp8(k, v, none, none[:, 0]))
    chunk, heads = 64, max(1, CFG.num_heads // tp)
    assert fp8_attention_bytes(CFG, 100, 16, chunk, tp) == 0  # off by default
    plain = plan_memory(CFG, mesh, torch.bfloat16, "none", 100, 16, chunk, free=None)
    fit = kv_tokens_that_fit(CFG, mesh, torch.bfloat16, 16, 1 << 30)
    with options.override(attention_fp8=True):
        q8 = chunk * heads * (CFG.head_dim + 4)  # Q8 [C, N, D] and its fp32 scale per row
        assert fp8_attention_bytes(CFG, 100, 16, chunk, tp) == held + q8
        assert 7 * fp8_attention_page_bytes(CFG, 16, tp) == held  # ceil(100 / 16) pages
        fp8_plan = plan_memory(CFG, mesh, torch.bfloat16, "none", 100, 16, chunk, free=None)
        assert fp8_plan.activations - plain.activations == held + q8
        assert kv_tokens_that_fit(CFG, mesh, torch.bfloat16, 16, 1 << 30) < fit


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"quant = 'int4'; expected one of \('none', 'fp8', 'mxfp4'\)"):
        weight_bytes_per_rank(CFG, Mesh.single(), torch.bfloat16, "int4")
    with pytest.raises(ValueError, match="headroom"):
        plan_memory(CFG, Mesh.single(), torch.bfloat16, "none", 64, 4, 64, free=GiB, headroom=1.0)
    with pytest.raises(ValueError, match="must divide by tp"):
        plan_memory(CFG, Mesh(1, 8, 1, 0), torch.bfloat16, "none", 64, 4, 64, free=GiB)


@pytest.mark.parametrize("quant", ["none", "mxfp4"])
def test_prefill_script_prints_its_plan(quant):
    """The README's main command (on the tiny random model): plans, prefills, and reports."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))  # keeps what finds the deps
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "prefill.py"), "--model", "tiny",
                           "--quant", quant, "--isl", "40", "--prompts", "2", "--check"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "memory plan per rank: weights" in done.stdout and "relative error 0.00e+00" in done.stdout


def test_a_cache_that_cannot_fit_is_a_value_error(monkeypatch):
    """init_state checks the pools against the device's free memory before allocating them (on
    CUDA; here the free-bytes probe is replaced) and says how many tokens would fit."""
    from mimo_fn import cache as cache_mod

    params = mf.init_params(CFG, seed=0, dtype=torch.bfloat16)
    full_b, swa_b = cache_mod.pool_page_bytes(CFG, 4, torch.bfloat16)
    need = kv_cache_bytes(CFG, 400, 4, torch.bfloat16)
    monkeypatch.setattr(cache_mod, "free_bytes", lambda device: need)
    state = mf.init_state(CFG, params, max_tokens=400, page_size=4)  # exactly fits
    assert sum(t.numel() * t.element_size() for p in (state.cache.full, state.cache.swa) for t in (*p.k, *p.v)) == need
    free = 100 * swa_b + 10 * full_b  # the 100-page SWA pool and 10 full pages: 40 tokens
    monkeypatch.setattr(cache_mod, "free_bytes", lambda device: free)
    with pytest.raises(ValueError, match=r"the KV cache \(100 full-attention pages \+ 100 sliding-window pages of 4 "
                                         r"tokens\) needs .* GiB on cpu, .*lower max_tokens \(about 40 tokens fit"):
        mf.init_state(CFG, params, max_tokens=400, page_size=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the driver's free-memory probe needs CUDA")
def test_the_free_memory_probe_on_cuda():
    """On a GPU the real probe: a cache of twice the free memory is a ValueError before anything
    is allocated; a small one is allocated on the GPU."""
    from mimo_fn import cache as cache_mod

    params = mf.init_params(CFG, seed=0, dtype=torch.bfloat16, device="cuda")
    free = cache_mod.free_bytes(torch.device("cuda"))
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory
    full_b, swa_b = cache_mod.pool_page_bytes(CFG, 16, torch.bfloat16)
    tokens = 2 * free // (full_b + swa_b) * 16
    held = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match=r"needs .* GiB on cuda.*, which has .* GiB free"):
        mf.init_state(CFG, params, max_tokens=tokens, page_size=16)
    assert torch.cuda.memory_allocated() == held
    state = mf.init_state(CFG, params, max_tokens=1024, page_size=16)
    assert state.cache.full.k[0].is_cuda
