"""Deterministic mode (EngineConfig.deterministic, forward(..., deterministic=True)): a request's
tokens and log-probs are the same bits whatever shares its batch.

Legend: T / M rows, K input features, N output features, H hidden, E experts, I expert
intermediate, N heads, G kv heads, D / Dv head dims, P pages, S slots per page.

CPU: the kernels deterministic mode runs, under Triton's interpreter at tiny shapes (a row's bits
do not change with the rows around it; the kernel equals its plain-torch twin), and the flag's
plumbing. The decisive engine tests need CUDA (the CPU engine runs the plain-torch references):
`test_engine_rows_are_batch_invariant` and `test_forward_gives_the_engine_bits` compare, bit for
bit, one request's greedy tokens and log-probs alone against it beside 1 / 7 / 32 others,
chunked at 64 / 256 / whole, as shared prompt copies or not, from a prefix-cache hit or miss,
with DFlash / prompt-lookup drafts on or off, with and without CUDA graphs, and against
mf.forward(..., deterministic=True), in bf16 and FP8; `test_without_it_bits_differ` shows the
same comparisons differ with the flag off (so the property is not vacuous).
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at import below

import pytest  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn import options  # noqa: E402
from mimo_fn.kernels import fp8_linear as fl  # noqa: E402
from mimo_fn.kernels import fixed_gemm as fg  # noqa: E402
from mimo_fn.kernels.attention.prefill import deterministic_prefill_config, launch_prefill  # noqa: E402
from mimo_fn.kernels.attention.ref import paged_attention_ref  # noqa: E402
from mimo_fn.kernels.moe import gemm as moe_gemm  # noqa: E402
from mimo_fn.kernels.moe.gemm import fused_moe, fused_moe_fp8  # noqa: E402
from mimo_fn.kernels.moe.ref import fused_moe_fp8_ref, fused_moe_ref  # noqa: E402
from mimo_fn.layers.router import route  # noqa: E402
from mimo_fn.params import quantize_params  # noqa: E402
from mimo_fn.quant import quantize_fp8_act_ref, quantize_fp8_block  # noqa: E402
from mimo_fn.serve.args import ServerArgs, parse_args  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine runs the kernels on CUDA only")


def _skip_if_interpreter_fp32_dot_varies(dtype: torch.dtype) -> None:
    """Skip an fp32 bit check in the interpreter where numpy's matmul (its tl.dot) gives a row other
    bits with other rows beside it: OpenBLAS picks its kernels by the CPU (DYNAMIC_ARCH), and on some
    (an AMD EPYC, 2026-12-07) a row's sum order follows its place in the block. The property is the
    GPU kernel's; the GPU run keeps the check, and bf16 outputs round such last-bit differences away."""
    if DEV == "cuda" or dtype != torch.float32:
        return
    import numpy as np

    rng = np.random.default_rng(0)
    for m, k in ((16, 16), (32, 48), (16, 64)):  # the interpreter tests' tile shapes
        a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, 16), dtype=np.float32)
        full = a @ b
        for i in range(m):
            one = np.zeros_like(a)
            one[0] = a[i]
            if not np.array_equal((one @ b)[0], full[i]):
                pytest.skip("this CPU's numpy fp32 matmul is not row-invariant: the interpreter cannot show "
                            "the kernel's")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _poisoned_empty(monkeypatch, module):
    """`module`'s torch.empty hands out NaN-filled buffers: a row the kernel forgets stays NaN."""
    real = torch.empty

    def empty(*shape, **kw):
        t = real(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() and t.dtype.itemsize > 1 else t

    monkeypatch.setattr(module.torch, "empty", empty)


# ---------------------------------------------------------------------------------------------
# Kernels (the interpreter on CPU, natively on CUDA): a row's bits do not depend on the other rows
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [48, 40])  # whole K blocks (16 in the interpreter) and a tail
def test_fixed_gemm_rows_are_invariant_and_match_ref(dtype, k, monkeypatch):
    _skip_if_interpreter_fp32_dot_varies(dtype)
    g = _gen(k)
    x_MK = torch.randn(37, k, generator=g).to(DEV, dtype)
    w_NK = (torch.randn(24, k, generator=g) * 0.1).to(DEV, dtype)
    _poisoned_empty(monkeypatch, fg)
    y_MN = fg.fixed_gemm(x_MK, w_NK)
    ref = fg.fixed_gemm_ref(x_MK, w_NK, torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y_MN.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    for rows in (slice(5, 6), slice(0, 3), slice(17, 37), [36, 2, 20]):  # alone, a few, another tile phase
        assert torch.equal(fg.fixed_gemm(x_MK[rows], w_NK), y_MN[rows])
    logits = fg.fixed_gemm(x_MK, w_NK, torch.float32)  # the router's fp32 output
    assert logits.dtype == torch.float32 and torch.equal(fg.fixed_gemm(x_MK[3:4], w_NK, torch.float32), logits[3:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_gemm_tiles_by_m_give_the_same_bits(dtype, monkeypatch):
    """The tile's row count follows M (tiles_for); a row's bits must not: each tile runs the same MMA
    chain per row (on CUDA 64-row and 128-row tiles, in the interpreter 16 and 32 rows)."""
    _skip_if_interpreter_fp32_dot_varies(dtype)
    small = fg.tiles_for(torch.device(DEV), 1)
    large = fg.CUDA_TILES_LARGE_M if DEV == "cuda" else fg.FixedTiles(32, 16, 16, 4, 1)
    assert small != large and (small.block_n, small.block_k) == (large.block_n, large.block_k)
    if DEV == "cuda":
        assert fg.tiles_for(torch.device("cuda"), fg.LARGE_M - 1) == small
        assert fg.tiles_for(torch.device("cuda"), fg.LARGE_M) == large
    m, k, n = (1500, 4096 + 64, 384) if DEV == "cuda" else (70, 48, 40)  # tails in M, and in K on CUDA
    g = _gen(m)
    x_MK = torch.randn(m, k, generator=g).to(DEV, dtype)
    w_NK = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    _poisoned_empty(monkeypatch, fg)
    y_small = fg.fixed_gemm(x_MK, w_NK, tiles=small)
    assert torch.equal(fg.fixed_gemm(x_MK, w_NK, tiles=large), y_small)
    assert torch.equal(fg.fixed_gemm(x_MK, w_NK), y_small)  # whichever tiles_for picks at this M
    assert torch.equal(fg.fixed_gemm(x_MK[7:9], w_NK), y_small[7:9])  # a decode step's rows


def test_fixed_gemm_bad_inputs():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="K=8"):  # the shape check or the kernel's own
        fg.fixed_gemm(x, torch.randn(4, 6, device=DEV))
    with pytest.raises(ValueError, match="must share one of"):
        fg.fixed_gemm(x, torch.randn(4, 8, device=DEV, dtype=torch.bfloat16))
    assert fg.fixed_gemm(x[:0], torch.randn(4, 8, device=DEV)).shape == (0, 4)


def test_fp8_linear_deterministic_rows_are_invariant(monkeypatch):
    g = _gen(1)
    x_TK = (torch.randn(21, 384, generator=g) * torch.rand(21, 1, generator=g) * 4)
    w = quantize_fp8_block(torch.randn(200, 384, generator=g) * 0.02)
    q_TK, s_TG = (t.to(DEV) for t in quantize_fp8_act_ref(x_TK))
    _poisoned_empty(monkeypatch, fl)
    y_TN = fl.fp8_linear(q_TK, s_TG, w.data.to(DEV), w.scale.to(DEV), torch.bfloat16, deterministic=True)
    ref = fl.fp8_linear_ref(q_TK.cpu(), s_TG.cpu(), w.data, w.scale, torch.float32)
    torch.testing.assert_close(y_TN.float().cpu(), ref, rtol=2**-8, atol=2**-8 * ref.abs().max().item())
    for rows in (slice(0, 1), slice(7, 10), slice(4, 21)):
        got = fl.fp8_linear(q_TK[rows], s_TG[rows], w.data.to(DEV), w.scale.to(DEV), torch.bfloat16,
                            deterministic=True)
        assert torch.equal(got, y_TN[rows])
    with pytest.raises(ValueError, match="deterministic runs one K slice"):
        fl.fp8_linear(q_TK, s_TG, w.data.to(DEV), w.scale.to(DEV), torch.bfloat16, splits=2, deterministic=True)


def test_fp8_linear_deterministic_tiles_by_t_give_the_same_bits(monkeypatch):
    """As fixed_gemm's: the deterministic tile follows T (det_tiles), a row's bits do not (on CUDA
    64 x 128 and 64 x 256 tiles, one warpgroup and two; in the interpreter 16 and 32 rows)."""
    small, large = (fl.DET_TILES, fl.DET_TILES_LARGE_M) if DEV == "cuda" else ((16, 64, 4, 1), (32, 64, 4, 1))
    if DEV == "cuda":
        assert fl.det_tiles(fl.DET_LARGE_M - 1) == small and fl.det_tiles(fl.DET_LARGE_M) == large
    # N off 128 on CUDA: on Hopper a 128-multiple weight goes to fp8_gemm_ws (test_fp8_gemm_ws.py)
    t, k, n = (1500, 4096 + 128, 640 + 64) if DEV == "cuda" else (70, 256, 72)
    g = _gen(t)
    x_TK = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    w = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.02)
    q_TK, s_TG = (x.to(DEV) for x in quantize_fp8_act_ref(x_TK))
    w_q, w_s = w.data.to(DEV), w.scale.to(DEV)
    _poisoned_empty(monkeypatch, fl)
    y_small = fl.fp8_linear(q_TK, s_TG, w_q, w_s, torch.bfloat16, deterministic=True, tiles=small)
    assert torch.equal(fl.fp8_linear(q_TK, s_TG, w_q, w_s, torch.bfloat16, deterministic=True, tiles=large), y_small)
    if DEV == "cuda":  # whichever det_tiles picks, at this T and at a decode step's
        assert torch.equal(fl.fp8_linear(q_TK, s_TG, w_q, w_s, torch.bfloat16, deterministic=True), y_small)
        assert torch.equal(fl.fp8_linear(q_TK[5:7], s_TG[5:7], w_q, w_s, torch.bfloat16, deterministic=True),
                           y_small[5:7])


def _moe_case(t, hid, inter, num_experts, top_k, seed, dtype):
    g = _gen(seed)
    x_TH = torch.randn(t, hid, generator=g).to(DEV, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hid, generator=g) * hid**-0.5).to(DEV, dtype)
    w2 = (torch.randn(num_experts, hid, inter, generator=g) * inter**-0.5).to(DEV, dtype)
    ids_TK = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(t)]).sort(-1).values
    weights_TK = torch.rand(t, top_k, generator=g)
    return x_TH, w13, w2, ids_TK.to(DEV), weights_TK.to(DEV)


def _moe_rows_invariant(run, x_TH, ids_TK, weights_TK, y_TH):
    for rows in (slice(3, 4), slice(0, 5), slice(6, None)):
        assert torch.equal(run(x_TH[rows], ids_TK[rows], weights_TK[rows]), y_TH[rows]), rows


def test_moe_bf16_deterministic_rows_are_invariant():
    x_TH, w13, w2, ids_TK, weights_TK = _moe_case(19, 64, 32, 8, 2, seed=5, dtype=torch.bfloat16)

    def run(x, ids, w):
        return fused_moe(x, w13, w2, ids, w, deterministic=True)

    y_TH = run(x_TH, ids_TK, weights_TK)
    ref = fused_moe_ref(x_TH.float(), w13.float(), w2.float(), ids_TK, weights_TK)
    torch.testing.assert_close(y_TH.float(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())
    _moe_rows_invariant(run, x_TH, ids_TK, weights_TK, y_TH)
    with pytest.raises(ValueError, match="deterministic mode runs block_m"):
        fused_moe(x_TH, w13, w2, ids_TK, weights_TK, block_m=128, deterministic=True)


def test_moe_fp8_deterministic_rows_are_invariant():
    x_TH, w13, w2, ids_TK, weights_TK = _moe_case(19, 128, 128, 4, 2, seed=6, dtype=torch.float32)
    q13, q2 = quantize_fp8_block(w13.cpu()), quantize_fp8_block(w2.cpu())
    args = (q13.data.to(DEV), q13.scale.to(DEV), q2.data.to(DEV), q2.scale.to(DEV))
    x_TH = x_TH.to(torch.bfloat16)

    def run(x, ids, w):
        return fused_moe_fp8(x, *args, ids, w, deterministic=True)

    y_TH = run(x_TH, ids_TK, weights_TK)
    ref = fused_moe_fp8_ref(x_TH, *args, ids_TK, weights_TK).float()
    torch.testing.assert_close(y_TH.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    _moe_rows_invariant(run, x_TH, ids_TK, weights_TK, y_TH)


@pytest.mark.parametrize("kind", ["bf16", "fp32", "fp8"])
def test_moe_deterministic_blocks_by_pairs_give_the_same_bits(kind, monkeypatch):
    """As the linears' tiles: deterministic mode's MoE row block follows the pairs an expert gets on
    average (det_block_m: on CUDA 64 and 128 rows, in the interpreter 16 and 32), a row's bits do
    not. The same tokens with the block forced small and large; a decode step's rows alone (the
    small block) against the same rows in a batch past the threshold (the large one)."""
    on_cuda = DEV == "cuda"
    dev = "cuda" if on_cuda else "interpreter"
    small, large = moe_gemm.DET_BLOCK_M[dev], moe_gemm.DET_BLOCK_M_LARGE[dev]
    if on_cuda:  # the model's kind of dims; ~150 pairs an expert: padded tails at both block sizes
        t, hid, inter, num_experts, top_k = 600, 1024, 512, 32, 8
    else:
        t, hid, inter, num_experts, top_k = (136, 128, 128, 4, 2) if kind == "fp8" else (136, 32, 48, 4, 2)
    edge = moe_gemm.LARGE_BLOCK_PER_EXPERT * num_experts  # pairs
    assert moe_gemm.det_block_m(on_cuda, edge - 1, num_experts) == small < large
    assert moe_gemm.det_block_m(on_cuda, edge, num_experts) == large
    assert 2 * top_k < edge <= t * top_k  # the decode rows below, the batch past the threshold
    dtype = torch.float32 if kind in ("fp32", "fp8") else torch.bfloat16
    if kind == "fp32":
        _skip_if_interpreter_fp32_dot_varies(dtype)
    x_TH, w13, w2, ids_TK, weights_TK = _moe_case(t, hid, inter, num_experts, top_k, seed=7, dtype=dtype)
    if kind == "fp8":
        q13, q2 = quantize_fp8_block(w13.cpu()), quantize_fp8_block(w2.cpu())
        args = (q13.data.to(DEV), q13.scale.to(DEV), q2.data.to(DEV), q2.scale.to(DEV))
        x_TH = x_TH.to(torch.bfloat16)

        def run(x, ids, w, block=None):
            return fused_moe_fp8(x, *args, ids, w, deterministic=True, _det_block_m=block)

        ref = fused_moe_fp8_ref(x_TH, *args, ids_TK, weights_TK).float()
        tol = 0.05
    else:
        def run(x, ids, w, block=None):
            return fused_moe(x, w13, w2, ids, w, deterministic=True, _det_block_m=block)

        ref = fused_moe_ref(x_TH.float(), w13.float(), w2.float(), ids_TK, weights_TK)
        tol = 1e-4 if kind == "fp32" else 2**-6
    if kind == "fp32" and not on_cuda:
        # the interpreter's fp32 dot is numpy's matmul (OpenBLAS), which sums a transposed operand
        # (a TMA-loaded weight tile, 64 columns) in an order that follows the tile's row count: the
        # weights by pointer then, whose dot sums in one order (test_moe_kernels says the same)
        monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, moe_tma=False))
    _poisoned_empty(monkeypatch, moe_gemm)
    y_small = run(x_TH, ids_TK, weights_TK, small)
    torch.testing.assert_close(y_small.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert torch.equal(run(x_TH, ids_TK, weights_TK, large), y_small)
    assert torch.equal(run(x_TH, ids_TK, weights_TK), y_small)  # det_block_m's pick here: the large block
    assert torch.equal(run(x_TH[5:7], ids_TK[5:7], weights_TK[5:7]), y_small[5:7])  # a decode step's: the small
    if kind == "bf16":  # block_m must be det_block_m's pick; _det_block_m one of the device's two blocks
        with pytest.raises(ValueError, match=f"deterministic mode runs block_m={large} at {t * top_k} pairs"):
            fused_moe(x_TH, w13, w2, ids_TK, weights_TK, block_m=small, deterministic=True)
        with pytest.raises(ValueError, match="is not one of deterministic mode's blocks"):
            run(x_TH, ids_TK, weights_TK, 2 * large)


def _paged(k_LGD, v_LGE, page_size, num_pages, g):
    """One sequence's keys scattered over shuffled pages of a pool with garbage elsewhere."""
    num_keys = k_LGD.shape[0]
    pages_L = torch.randperm(num_pages, generator=g)[: -(-num_keys // page_size)]
    k_PSGD = torch.randn(num_pages, page_size, *k_LGD.shape[1:], generator=g).to(k_LGD)
    v_PSGE = torch.randn(num_pages, page_size, *v_LGE.shape[1:], generator=g).to(v_LGE)
    pos = torch.arange(num_keys)
    k_PSGD[pages_L[pos // page_size], pos % page_size] = k_LGD
    v_PSGE[pages_L[pos // page_size], pos % page_size] = v_LGE
    return k_PSGD, v_PSGE, pages_L


@pytest.mark.parametrize("window,sinks", [(0, False), (12, True)])
def test_attention_rows_are_invariant_across_chunks_and_batches(window, sinks):
    """A query row's output has the same bits computed in one pass over the sequence, in a later
    chunk, as a decode step, or beside another sequence (deterministic_prefill_config, the loop
    kernel's key blocks aligned to absolute positions), and matches the reference."""
    g = _gen(window)
    num_heads, num_kv, d, dv, page, num_keys = 4, 2, 24, 16, 8, 45
    dt = torch.bfloat16
    q_LND = torch.randn(num_keys, num_heads, d, generator=g).to(DEV, dt)
    k_LGD = torch.randn(num_keys, num_kv, d, generator=g).to(DEV, dt)
    v_LGE = torch.randn(num_keys, num_kv, dv, generator=g).to(DEV, dt)
    sinks_N = torch.randn(num_heads, generator=g).to(DEV) if sinks else None
    k_PSGD, v_PSGE, pages_L = _paged(k_LGD, v_LGE, page, 12, g)
    cfg = deterministic_prefill_config(num_heads, num_kv, window, DEV == "cuda", dt)
    scale = d**-0.5

    def run(chunks):
        """chunks: (first query, end) per sequence, each over the same keys up to `end`."""
        q = torch.cat([q_LND[a:b] for a, b in chunks])
        cu = torch.tensor([0, *torch.tensor([b - a for a, b in chunks]).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor([b for _, b in chunks], dtype=torch.int32)
        table = pages_L[None].expand(len(chunks), -1).to(torch.int32).contiguous()
        args = (q, k_PSGD, v_PSGE, table.to(DEV), cu.to(DEV), lens.to(DEV), scale, window, sinks_N)
        return launch_prefill(*args, config=cfg), paged_attention_ref(*args)

    whole, ref = run([(0, num_keys)])
    torch.testing.assert_close(whole.float(), ref.float(), rtol=2**-6, atol=2**-6)
    later, _ = run([(19, 33)])  # a middle chunk: keys of earlier chunks come from the cache
    assert torch.equal(later, whole[19:33])
    decode, _ = run([(44, 45)])  # one query, the whole prefix cached
    assert torch.equal(decode, whole[44:45])
    batch, _ = run([(3, 9), (40, 41), (20, 37)])  # three sequences of one call (sharing pages)
    assert torch.equal(batch, torch.cat([whole[3:9], whole[40:41], whole[20:37]]))


def test_router_sorts_ids_and_its_rows_are_invariant():
    cfg = mf.ModelConfig.tiny(num_experts=16, top_k=4, n_group=4, topk_group=2)
    g = _gen(2)
    x_TH = torch.randn(11, cfg.hidden_size, generator=g).to(DEV)
    router_XH = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g).to(DEV) * 0.1
    bias_X = torch.randn(cfg.num_experts, generator=g).to(DEV) * 0.01
    w_TK, ids_TK = route(x_TH, router_XH, bias_X, cfg, deterministic=True)
    assert torch.equal(ids_TK, ids_TK.sort(-1).values)
    plain_w, plain_ids = route(x_TH, router_XH, bias_X, cfg)
    order = plain_ids.sort(-1)
    assert torch.equal(order.values, ids_TK)
    torch.testing.assert_close(plain_w.gather(1, order.indices), w_TK, rtol=1e-6, atol=1e-6)
    w1, ids1 = route(x_TH[4:5], router_XH, bias_X, cfg, deterministic=True)
    assert torch.equal(ids1, ids_TK[4:5])
    if DEV == "cuda":  # the fixed-tiling logits; the CPU's reference matmul takes another path for one row
        assert torch.equal(w1, w_TK[4:5])


# ---------------------------------------------------------------------------------------------
# The flag's plumbing (CPU, cheap)
# ---------------------------------------------------------------------------------------------


def test_flag_plumbing_and_bad_values():
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=0)
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64, page_size=4, deterministic=True))
    assert engine.state.deterministic and not mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64)).state.deterministic
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match=r"EngineConfig.deterministic = .*expected True or False"):
            mf.EngineConfig(max_tokens=64, deterministic=bad)
        with pytest.raises(ValueError, match=r"forward: deterministic = .*expected True or False"):
            mf.forward(params, cfg, torch.tensor([1, 2]), deterministic=bad)
        with pytest.raises(ValueError, match=r"init_state: deterministic = .*expected (True or False|a bool)"):
            mf.init_state(cfg, params, max_tokens=16, deterministic=bad)
    assert parse_args(["--enable-deterministic-inference"]).enable_deterministic_inference
    assert not parse_args([]).enable_deterministic_inference
    with pytest.raises(ValueError, match="--enable-deterministic-inference = 'yes': expected a flag"):
        ServerArgs(enable_deterministic_inference="yes")
    tokens = torch.randint(0, cfg.vocab_size, (9,), generator=_gen(0))
    # the CPU runs the references either way: the flag changes no bits there
    assert torch.equal(mf.forward(params, cfg, tokens, deterministic=True), mf.forward(params, cfg, tokens))


def test_server_builds_a_deterministic_engine():
    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.serve.launch import build_engine

    args = parse_args(["--device", "cpu", "--max-total-tokens", "256", "--page-size", "16",
                       "--enable-deterministic-inference"])
    engine = build_engine(args, torch.device("cpu"), Mesh.single())[0]
    assert engine.config.deterministic and engine.state.deterministic


# ---------------------------------------------------------------------------------------------
# The engine: one request's bits alone and in every other setting (CUDA)
# ---------------------------------------------------------------------------------------------

# the released head dims (192 / 128, partial RoPE, sinks, window 128) at a small width
GPU_CFG = mf.ModelConfig.tiny(
    vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
    num_swa_kv_heads=4, head_dim=192, v_head_dim=128, sliding_window=128, num_experts=16, top_k=4,
    moe_intermediate_size=256, n_group=4, topk_group=2)
CPU_CFG = mf.ModelConfig.tiny()
NEW = 16


def _setting():
    """(cfg, target prompt, 32 other prompts, page size) for this device."""
    cfg, lo, hi, target_len = (GPU_CFG, 5, 400, 300) if DEV == "cuda" else (CPU_CFG, 3, 40, 37)
    g = _gen(7)
    target = torch.randint(0, cfg.vocab_size, (target_len,), generator=g).tolist()
    lengths = torch.randint(lo, hi, (32,), generator=g).tolist()
    others = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    return cfg, target, others, 16


def _params(cfg, fp8: bool):
    params = mf.init_params(cfg, seed=11, dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, device=DEV)
    return quantize_params(cfg, params) if fp8 else params


def _run(cfg, params, prompts, deterministic, index=0, times=1, **config):
    """The greedy (tokens, log-probs) of prompts[index] from a fresh engine (the last of `times`
    generate calls: the later ones hit the prefix cache), and the engine."""
    base = dict(max_tokens=16384, page_size=16, chunk_size=4096, cuda_graphs=False, deterministic=deterministic)
    engine = mf.Engine(cfg, params, mf.EngineConfig(**{**base, **config}))
    for _ in range(times):
        out = engine.generate(prompts, NEW, return_logprobs=True)[index]
    return (out.tokens, out.logprobs), engine


def _variants(cfg, params, target, others, deterministic):
    """name -> the target's (tokens, log-probs) in that setting."""
    from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash

    def beside(k, **config):
        prompts = others[: k // 2] + [target] + others[k // 2: k]
        return _run(cfg, params, prompts, deterministic, index=k // 2, **config)[0]

    out = {"alone": _run(cfg, params, [target], deterministic)[0]}
    for k in (1, 7, 32):
        out[f"with {k} others"] = beside(k)
    for chunk in (64, 256):
        out[f"chunk {chunk}"] = _run(cfg, params, [target], deterministic, chunk_size=chunk)[0]
        out[f"chunk {chunk}, 7 others"] = beside(7, chunk_size=chunk)
    out["page 128"] = _run(cfg, params, [target], deterministic, page_size=128)[0]
    out["cuda graphs, 7 others"] = beside(7, cuda_graphs=True)
    for share in (True, False):
        out[f"copies, shared={share}"] = _run(cfg, params, [target] * 3 + others[:2], deterministic, index=2,
                                              share_prompts=share)[0]
    out["prefix cache miss"], _ = _run(cfg, params, [target], deterministic, prefix_cache=True)
    out["prefix cache hit"], engine = _run(cfg, params, [target], deterministic, times=2, prefix_cache=True)
    assert engine.prefix_stats["hits"] == 1
    partial = target[: len(target) * 2 // 3] + others[0]
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=16384, page_size=16, chunk_size=4096, cuda_graphs=False,
                                                    prefix_cache=True, deterministic=deterministic))
    engine.generate([partial], NEW, return_logprobs=True)  # an entry serves requests that ask what it kept
    got = engine.generate([target], NEW, return_logprobs=True)[0]
    assert engine.prefix_stats["hits"] == 1
    out["prefix cache, partial hit"] = (got.tokens, got.logprobs)
    out["prompt-lookup drafts"] = _run(cfg, params, [target] + others[:3], deterministic, num_draft_tokens=3)[0]
    dcfg = DFlashConfig(target_layers=(1, 3), mask_token_id=cfg.vocab_size - 1, block_size=4, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=64 if DEV == "cuda" else 16, intermediate_size=256)
    drafter = init_dflash(cfg, dcfg, seed=1, dtype=params.embed.dtype, device=DEV)
    out["DFlash drafts"] = _run(cfg, params, [target] + others[:3], deterministic, num_draft_tokens=3,
                                proposer=DFlashProposer(drafter, dcfg, params, cfg, cuda_graphs=False))[0]
    return out


def _forward_logprobs(cfg, params, target, tokens, deterministic):
    seq = torch.tensor(target + tokens[:-1], device=DEV)
    with torch.no_grad():
        logits_TV = mf.forward(params, cfg, seq, deterministic=deterministic)[len(target) - 1:]
    return torch.log_softmax(logits_TV.float(), -1).gather(-1, torch.tensor(tokens, device=DEV)[:, None])[:, 0].tolist()


def _check_invariant(fp8: bool):
    cfg, target, others, _ = _setting()
    params = _params(cfg, fp8)
    got = _variants(cfg, params, target, others, deterministic=True)
    tokens, logprobs = got["alone"]
    assert len(tokens) == NEW
    got["forward"] = (tokens, _forward_logprobs(cfg, params, target, tokens, True))
    # CUDA: bits; the CPU's references (BLAS picks its kernel by shape) only round alike
    tol = 0.0 if DEV == "cuda" else 1e-4
    bad = {name: max(abs(a - b) for a, b in zip(lp, logprobs)) if t == tokens else "tokens differ"
           for name, (t, lp) in got.items() if (t, lp) != (tokens, logprobs)}
    bad = {name: d for name, d in bad.items() if isinstance(d, str) or d > tol}
    assert not bad, f"deterministic mode: the target's bits differ from alone in {bad}"


@cuda_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_engine_rows_are_batch_invariant(fp8):
    _check_invariant(fp8)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_engine_rows_are_batch_invariant_cpu_references():
    """The same matrix on the CPU, where the references run (the harness itself, and the
    references' own invariance at these sizes)."""
    _check_invariant(fp8=False)


@cuda_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_forward_gives_the_engine_bits(fp8):
    """mf.forward(..., deterministic=True) on prompt + output scores each output token as the
    engine did, bit for bit, in one pass (a trainer's scoring pass)."""
    cfg, target, others, _ = _setting()
    params = _params(cfg, fp8)
    (tokens, logprobs), _ = _run(cfg, params, others[:7] + [target], True, index=7)
    assert _forward_logprobs(cfg, params, target, tokens, True) == logprobs


@cuda_only
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_without_it_bits_differ(fp8):
    """The same comparisons with deterministic off: the default kernels (split-K decode whose
    split count follows the batch, cuBLAS, autotuned MoE launches) give other bits beside other
    requests, and the reference forward others still; so the tests above test something."""
    cfg, target, others, _ = _setting()
    params = _params(cfg, fp8)
    got = _variants(cfg, params, target, others, deterministic=False)
    tokens, logprobs = got["alone"]
    differ = [name for name, (t, lp) in got.items() if (t, lp) != (tokens, logprobs)]
    print(f"deterministic off: the target's bits differ from alone in {differ}")
    assert differ, "deterministic off, yet every setting gave the bits of alone: the tests above prove nothing"
    assert _forward_logprobs(cfg, params, target, tokens, False) != logprobs
