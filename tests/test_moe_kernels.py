"""MoE kernels against their plain-torch twins: bf16 / fp32 grouped GEMM, FP8 grouped GEMM (the
alignment: test_moe_align.py, with this file's helpers).

Legend: T tokens, H hidden, I expert intermediate, E experts, K experts per token.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tiny shapes); on CUDA natively.
Every buffer the kernels allocate is poisoned (NaN / garbage ints) while they run, so a slot
the kernels forget to write shows up in the output. Routing cases: balanced (distinct experts
per token), skewed (one expert takes ~90% of the pairs, duplicates within a token allowed),
sparse (most experts empty, -1 padding, one token with no expert at all).
"""

import contextlib
import dataclasses
import os
import zlib

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at import below

import pytest  # noqa: E402
import triton  # noqa: E402

from mimo_fn import options  # noqa: E402
from mimo_fn.kernels.fp8_quant import quant_fp8_act  # noqa: E402
from mimo_fn.kernels.moe import gemm as moe_gemm  # noqa: E402
from mimo_fn.kernels.moe.align import moe_align  # noqa: E402
from mimo_fn.kernels.moe.dispatch import moe_experts  # noqa: E402
from mimo_fn.kernels.moe.gemm import fused_moe, fused_moe_fp8  # noqa: E402
from mimo_fn.kernels.moe.ref import fused_moe_fp8_ref, fused_moe_ref, qdq_act_fp8  # noqa: E402
from mimo_fn.quant import FP8_DTYPE, dequantize, quantize_fp8_act_ref, quantize_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROUTINGS = ["balanced", "skewed", "sparse"]


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    # numerics, not speed: one config per kernel keeps CUDA compile time down (the bench tunes)
    set_options(monkeypatch, moe_autotune=False)


def set_options(monkeypatch, **changes):
    """The kernel switches (mimo_fn.options) with `changes` for the rest of the test."""
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, **changes))


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like return NaN- or garbage-filled buffers inside the block."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-123456789)
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())  # stable across processes, unlike hash()


def make_routing(kind: str, t: int, k: int, e: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T, K] int64, topk_weights [T, K] fp32) on DEV."""
    if kind == "balanced":
        ids_TK = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k]
    elif kind == "skewed":
        hot = int(torch.randint(e, (1,), generator=gen))
        ids_TK = torch.where(torch.rand(t, k, generator=gen) < 0.9, hot, torch.randint(e, (t, k), generator=gen))
    elif kind == "sparse":
        live = torch.tensor([1, e - 3, e - 1])  # every other expert gets no pair
        ids_TK = live[torch.randint(3, (t, k), generator=gen)]
        ids_TK[torch.rand(t, k, generator=gen) < 0.25] = -1
        ids_TK[t // 2] = -1
    else:
        raise AssertionError(kind)
    weights_TK = torch.rand(t, k, generator=gen) + 0.1
    return ids_TK.to(DEV), weights_TK.to(DEV)


def make_experts(t: int, h: int, i: int, e: int, gen: torch.Generator, dtype: torch.dtype):
    x_TH = torch.randn(t, h, generator=gen).to(DEV, dtype)
    w13_E2IH = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(DEV, dtype)
    w2_EHI = (torch.randn(e, h, i, generator=gen) / i**0.5).to(DEV, dtype)
    return x_TH, w13_E2IH, w2_EHI


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and bool(torch.isfinite(out).all()), "non-finite output (unwritten slot?)"
    ref = ref.float()
    assert float(ref.abs().max()) > 0
    return float((out.float() - ref).abs().max() / ref.abs().max())


# ------------------------------------------------------------------------------- bf16 / fp32


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_ref(kind, dtype):
    gen = torch.Generator().manual_seed(seed(kind, str(dtype)))
    x_TH, w13_E2IH, w2_EHI = make_experts(48, 256, 128, 8, gen, dtype)
    ids_TK, weights_TK = make_routing(kind, 48, 4, 8, gen)
    with poisoned():
        out_TH = fused_moe(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)
    assert out_TH.dtype == dtype
    # fp32 reference on the same (bf16-valued) operands: the bf16 reference rounds every
    # intermediate and is itself ~0.5% off; the kernel rounds only h, the per-pair rows and out
    ref_TH = fused_moe_ref(x_TH.float(), w13_E2IH.float(), w2_EHI.float(), ids_TK, weights_TK)
    assert rel_err(out_TH, ref_TH) <= (1e-4 if dtype == torch.float32 else 1e-2)
    if kind == "sparse":
        assert bool((out_TH[24] == 0).all())  # a token routed nowhere gets zeros


@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_moe_ragged_dims_and_block_m(block_m):
    # H, I not multiples of the tiles: masked K tails and N edges; several blocks per expert
    gen = torch.Generator().manual_seed(block_m)
    x_TH, w13_E2IH, w2_EHI = make_experts(40, 192, 96, 8, gen, torch.float32)
    ids_TK, weights_TK = make_routing("skewed", 40, 4, 8, gen)
    with poisoned():
        out_TH = fused_moe(x_TH, w13_E2IH, w2_EHI, ids_TK.to(torch.int32), weights_TK, block_m=block_m)
    assert rel_err(out_TH, fused_moe_ref(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)) <= 1e-4


def test_fused_moe_bf16_close_to_bf16_ref():
    # the contract's own bf16 evaluation, with the looser per-step rounding it implies
    gen = torch.Generator().manual_seed(7)
    x_TH, w13_E2IH, w2_EHI = make_experts(32, 128, 128, 8, gen, torch.bfloat16)
    ids_TK, weights_TK = make_routing("balanced", 32, 4, 8, gen)
    out_TH = fused_moe(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)
    assert rel_err(out_TH, fused_moe_ref(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)) <= 2e-2


# ------------------------------------------------------------------------------- fp8
#
# Why the FP8 kernel and its fp32 simulation (fused_moe_fp8_ref) differ by a few % on a GPU:
# both quantise h = SiLU(gate) * up to e4m3 before the down GEMM, and e4m3 steps are 6-12% of
# a value. Hopper's FP8 MMA accumulates at reduced precision, so the kernel's gate / up
# differ from exact sums by up to ~FP8_ACC_REL * sum|x||w|; an h that sits within that
# distance of a rounding midpoint rounds to the other neighbour, and one such flip of a large
# h moves an output row by up to a few % of the layer's largest output. The checks below
# bound each stage separately against exact (float64) arithmetic on the kernels' own inputs:
#   up, unquantised: |h - h_exact| <= the accumulation bound        (proves the error size)
#   up, quantised:   the group scale and every e4m3 code are a correct rounding of some h
#                    inside that bound (a flip is allowed only next to a midpoint)
#   down:            y from the kernel's own h codes: accumulation bound + bf16 rounding
#   layer vs sim:    |out - sim| <= sum_k w |h_kernel - h_sim| |W2|^T + rounding terms
# so a wrong scale, index or mask fails at its own stage, and the layer's distance from the
# simulation is exactly what the flips allow.

# Relative accumulation error of one FP8 GEMM output against sum_k |x_k w_k| (scales folded
# in). Interpreter: fp32 dots of the exact fp8 values, measured <= 6e-8. H200 (triton 3.6,
# 2026-11-30): the up GEMM measured 2^-15.8 at the model's shapes (H = 4096) and up to
# 2^-13.3 at these small ones, the down GEMM (heavy-tailed h codes) up to 2^-12.9: the
# ~2^-13 resolution of an accumulator that keeps ~14 bits. The error halves with each halving
# of max_num_imprecise_acc (python -m mimo_fn.bench moe --mode numerics), i.e. it is the MMA's.
FP8_ACC_REL = 2.0**-11 if torch.cuda.is_available() else 2.0**-20


def dq64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact float64 dequantisation on CPU: [..., N, K] fp8 with [..., Nb, Kb] block scales,
    or [T, K] with [T, G] group scales (pass the [T, G] view)."""
    n, k = q.shape[-2:]
    s = scale.cpu().double()
    if s.shape[-2] != n:  # block scales: expand rows too
        s = s.repeat_interleave(128, dim=-2)[..., :n, :]
    return q.cpu().double() * s.repeat_interleave(128, dim=-1)[..., :k]


def slot_layout(al) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot, pair, expert) of every slot holding a real pair, on CPU."""
    n = int(al.num_tokens_post_pad_1)
    pair_M = al.sorted_ids_M[:n].cpu().long()
    expert_M = al.expert_of_block_NB.cpu().long().repeat_interleave(al.block_m)[:n]
    slot_S = torch.nonzero(pair_M < al.num_pairs).view(-1)
    return slot_S, pair_M[slot_S], expert_M[slot_S]


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest-even e4m3 (float64 in, float64 out), saturating at +-448."""
    return v.clamp(-448.0, 448.0).float().to(torch.float8_e4m3fn).double()


def check_fp8_stages(x_TH, w13, w2, ids_TK, weights_TK, block_m, up_cfg=None, down_cfg=None, tma=None) -> dict:
    """The up and down kernels against float64 on their own inputs (see the section comment).
    Returns the kernel's dequantised h per pair [P, I] (float64, CPU) and statistics."""
    num_experts, top_k = w13.data.shape[0], ids_TK.shape[1]
    xq_TH, xs_TG = quant_fp8_act(x_TH)
    al = moe_align(ids_TK, num_experts, block_m)
    with poisoned():
        h32_MI, _ = moe_gemm._moe_up(xq_TH, xs_TG, w13.data, w13.scale, al, top_k, torch.float32, cfg=up_cfg, tma=tma)
        hq_MI, hs_MIb = moe_gemm._moe_up(xq_TH, xs_TG, w13.data, w13.scale, al, top_k, FP8_DTYPE, cfg=up_cfg, tma=tma)
        y_PH = moe_gemm._moe_down(hq_MI, hs_MIb, w2.data, w2.scale, al, weights_TK, torch.bfloat16, cfg=down_cfg, tma=tma)
    slot_S, pair_S, expert_S = slot_layout(al)
    x64_TH, w13_64, w2_64 = dq64(xq_TH, xs_TG), dq64(w13.data, w13.scale), dq64(w2.data, w2.scale)
    inter = w2_64.shape[-1]
    x_SH = x64_TH[pair_S // top_k]
    gu_S2I = torch.zeros(len(slot_S), 2 * inter, dtype=torch.float64)
    gu_abs_S2I = torch.zeros_like(gu_S2I)  # sum_k |x_k w_k|: the scale of any accumulation error
    for e in expert_S.unique().tolist():
        r = expert_S == e
        gu_S2I[r] = x_SH[r] @ w13_64[e].T
        gu_abs_S2I[r] = x_SH[r].abs() @ w13_64[e].abs().T
    g, u = gu_S2I.split(inter, dim=1)
    g_abs, u_abs = gu_abs_S2I.split(inter, dim=1)
    sig = torch.sigmoid(g)
    h64_SI = g * sig * u
    dsilu = sig * (1 + g * (1 - sig))
    # first-order error of h from the gate / up errors, plus the fp32 epilogue (exp, products)
    hb_SI = FP8_ACC_REL * ((dsilu * u).abs() * g_abs + (g * sig).abs() * u_abs) + 2.0**-18 * h64_SI.abs()

    # up, unquantised: the accumulation error itself
    h32_SI = h32_MI.cpu().double()[slot_S]
    acc_err = (h32_SI - h64_SI).abs()
    assert bool((acc_err <= hb_SI).all()), f"h off by {float((acc_err / hb_SI).max()):.3g} x its bound"

    # up, quantised: scales and codes are correct roundings of some h within the bound
    groups = -(-inter // 128)
    hs_SG = hs_MIb.cpu().double()[slot_S]
    pad = groups * 128 - inter
    amax_SG = F.pad(h64_SI.abs(), (0, pad)).view(-1, groups, 128).amax(-1)
    hb_max_SG = F.pad(hb_SI, (0, pad)).view(-1, groups, 128).amax(-1)
    scale_err = (hs_SG - amax_SG.clamp_min(1e-10) / 448).abs()
    assert bool((scale_err <= hb_max_SG / 448 + 2.0**-22 * hs_SG).all()), "h group scales"
    hs_SI = hs_SG.repeat_interleave(128, dim=1)[:, :inter]
    q_SI = hq_MI.cpu().double()[slot_S]
    lo, hi = e4m3((h64_SI - hb_SI) / hs_SI), e4m3((h64_SI + hb_SI) / hs_SI)
    assert bool(((lo <= q_SI) & (q_SI <= hi)).all()), "an h code is no rounding of h within the bound"
    flips = int((q_SI != e4m3(h64_SI / hs_SI)).sum())

    # down, on the kernel's own h codes: accumulation bound + bf16 rounding of each row
    hk_SI = q_SI * hs_SI
    w_S = weights_TK.cpu().double().reshape(-1)[pair_S]
    y64_SH = torch.zeros(len(slot_S), w2_64.shape[1], dtype=torch.float64)
    y_abs_SH = torch.zeros_like(y64_SH)
    for e in expert_S.unique().tolist():
        r = expert_S == e
        y64_SH[r] = hk_SI[r] @ w2_64[e].T
        y_abs_SH[r] = hk_SI[r].abs() @ w2_64[e].abs().T
    y64_SH *= w_S[:, None]
    y_bound = FP8_ACC_REL * w_S[:, None] * y_abs_SH + 2.0**-8 * y64_SH.abs()
    y_err = (y_PH.cpu().double()[pair_S] - y64_SH).abs()
    assert bool((y_err <= y_bound).all()), f"y off by {float((y_err / y_bound).max()):.3g} x its bound"

    hk_PI = torch.zeros(al.num_pairs, inter, dtype=torch.float64)
    hk_PI[pair_S] = hk_SI
    return {
        "hk_PI": hk_PI,
        "acc_rel_max": float((acc_err / (hb_SI / FP8_ACC_REL)).max()),  # observed error / sum|x||w|-term
        "flips": flips,
        "num_h": q_SI.numel(),
    }


def check_fp8_layer(out_TH, x_TH, w13, w2, ids_TK, weights_TK, hk_PI) -> float:
    """|out - fused_moe_fp8_ref| within what the h differences allow (see the section comment);
    returns the max-abs-relative distance."""
    sim_TH = fused_moe_fp8_ref(x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
    # the simulation's own h, computed as fused_moe_fp8_ref does
    w13_f32, w2_64 = dequantize(w13, torch.float32), dq64(w2.data, w2.scale)
    x32_TH = qdq_act_fp8(x_TH)
    top_k, inter = ids_TK.shape[1], w2_64.shape[-1]
    hsim_PI = torch.zeros_like(hk_PI)
    ids_P = ids_TK.reshape(-1).cpu()
    for e in ids_P.unique().tolist():
        if e < 0:
            continue
        p = torch.nonzero(ids_P == e).view(-1)
        gate, up = F.linear(x32_TH[p.to(DEV) // top_k], w13_f32[e]).split(inter, dim=-1)
        hsim_PI[p] = qdq_act_fp8(F.silu(gate) * up).cpu().double()
    w_P = weights_TK.cpu().double().reshape(-1)
    bound_P = torch.zeros(ids_P.numel(), w2_64.shape[1], dtype=torch.float64)
    for e in ids_P.unique().tolist():
        if e < 0:
            continue
        p = ids_P == e
        dh, h = (hk_PI[p] - hsim_PI[p]).abs(), hk_PI[p].abs()
        # h differences, the kernel's accumulation, fp32 noise in the simulation, and the
        # bf16 rounding of the kernel's per-pair rows
        bound_P[p] = w_P[p, None] * (
            (dh + (FP8_ACC_REL + 2.0**-16) * h) @ w2_64[e].abs().T + 2.0**-8 * (hk_PI[p] @ w2_64[e].T).abs()
        )
    sim = sim_TH.cpu().double()
    t = x_TH.shape[0]
    # + bf16 rounding of the output and of the simulation's output
    bound_TH = bound_P.view(t, top_k, -1).sum(1) + 2.0**-7 * sim.abs()
    err_TH = (out_TH.cpu().double() - sim).abs()
    assert bool((err_TH <= bound_TH + 1e-30).all()), f"out vs sim off by {float((err_TH / bound_TH).max()):.3g} x"
    return float(err_TH.max() / sim.abs().max())


def test_quant_fp8_act_bitwise():  # the activation quantiser fused_moe_fp8 runs
    gen = torch.Generator().manual_seed(3)
    x_TH = (torch.randn(20, 320, generator=gen) * torch.logspace(-3, 3, 20)[:, None]).to(DEV, torch.bfloat16)
    with poisoned():
        q_TH, s_TG = quant_fp8_act(x_TH)
    # reference on CPU: torch on CUDA divides by the scalar 448 as a multiply by fp32(1/448),
    # one ulp away from the IEEE division the format specifies (and the kernel does)
    q_ref, s_ref = quantize_fp8_act_ref(x_TH.cpu())
    assert torch.equal(s_TG.cpu(), s_ref)
    assert torch.equal(q_TH.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def make_fp8_case(kind: str, t: int, hid: int, inter: int, e: int, k: int, gen: torch.Generator):
    x_TH, w13_E2IH, w2_EHI = make_experts(t, hid, inter, e, gen, torch.float32)
    ids_TK, weights_TK = make_routing(kind, t, k, e, gen)
    return x_TH.bfloat16(), quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI), ids_TK, weights_TK


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dims", [(256, 128), (192, 160)])  # (H, I); the second has partial 128-groups
def test_fused_moe_fp8_matches_sim(kind, dims):
    gen = torch.Generator().manual_seed(seed(kind, dims))
    x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case(kind, 32, *dims, 8, 4, gen)
    args = (x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
    block_m = 64  # what production runs at small T (a wgmma tile on Hopper); skewed: several blocks
    with poisoned():
        out_TH = fused_moe_fp8(*args, block_m=block_m)
    assert out_TH.dtype == torch.bfloat16
    # the simulation is a sane approximation of the unquantised layer
    w13_f32, w2_f32 = dequantize(w13, torch.float32), dequantize(w2, torch.float32)
    ref_TH = fused_moe_ref(x_TH.float(), w13_f32, w2_f32, ids_TK, weights_TK)
    assert rel_err(out_TH, ref_TH) <= 0.1
    stages = check_fp8_stages(x_TH, w13, w2, ids_TK, weights_TK, block_m)
    check_fp8_layer(out_TH, x_TH, w13, w2, ids_TK, weights_TK, stages["hk_PI"])


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_tma_and_pointer_paths(kind):
    # weights (and h in the down GEMM) load through TMA descriptors where their strides allow,
    # else through pointers: both paths meet the bounds; under the interpreter they agree bitwise
    gen = torch.Generator().manual_seed(seed("tma", kind))
    x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case("skewed", 32, 192, 160, 8, 4, gen)
    assert moe_gemm._tma_2d(w13.data, None) is not None  # the default path here is TMA
    al = moe_align(ids_TK, 8, 64)
    valid_P = ids_TK.reshape(-1) >= 0
    outs = []
    for tma in (True, False):
        if kind == "fp8":
            stages = check_fp8_stages(x_TH, w13, w2, ids_TK, weights_TK, 64, tma=tma)
            outs.append(stages["hk_PI"])
        else:
            w13_E2IH, w2_EHI = dequantize(w13), dequantize(w2)  # bf16 weights
            with poisoned():
                h_MI, _ = moe_gemm._moe_up(x_TH, None, w13_E2IH, None, al, 4, torch.bfloat16, tma=tma)
                y_PH = moe_gemm._moe_down(h_MI, None, w2_EHI, None, al, weights_TK, torch.bfloat16, tma=tma)
            out_TH = moe_gemm._moe_sum_topk(y_PH, ids_TK, 8, torch.bfloat16)
            ref_TH = fused_moe_ref(x_TH.float(), w13_E2IH.float(), w2_EHI.float(), ids_TK, weights_TK)
            assert rel_err(out_TH, ref_TH) <= 1e-2
            # padding rows of an expert's last block may be left unwritten (HALF_TAILS): real slots only
            outs.append(torch.cat([h_MI[slot_layout(al)[0]].float().flatten(), y_PH[valid_P].float().flatten()]))
    if not torch.cuda.is_available():
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_persistent_launch_matches_one_tile_per_program(kind):
    # PERSISTENT: one program per SM (3 under the interpreter) walks the used tiles; each tile's
    # arithmetic is the same as with one program per tile, so h and y agree bit for bit
    gen = torch.Generator().manual_seed(seed("persistent", kind))
    x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case("skewed", 32, 256, 256, 8, 4, gen)
    al = moe_align(ids_TK, 8, 64)
    slot_S, valid_P = slot_layout(al)[0], ids_TK.reshape(-1) >= 0  # padding rows may stay unwritten
    up0, down0 = (cfgs[0] for cfgs in moe_gemm._CONFIGS[kind])
    outs = []
    for persistent in (False, True):
        up, down = (triton.Config({**c.kwargs, "PERSISTENT": persistent}, num_warps=c.num_warps,
                                  num_stages=c.num_stages, pre_hook=c.pre_hook) for c in (up0, down0))
        with poisoned():
            if kind == "fp8":
                xq_TH, xs_TG = quant_fp8_act(x_TH)
                h_MI, hs_MIb = moe_gemm._moe_up(xq_TH, xs_TG, w13.data, w13.scale, al, 4, FP8_DTYPE, cfg=up)
                y_PH = moe_gemm._moe_down(h_MI, hs_MIb, w2.data, w2.scale, al, weights_TK, torch.bfloat16, cfg=down)
                h_MI = torch.cat([h_MI[slot_S].view(torch.uint8).float().flatten(), hs_MIb[slot_S].flatten()])
            else:
                w13_E2IH, w2_EHI = dequantize(w13), dequantize(w2)
                h_MI, _ = moe_gemm._moe_up(x_TH, None, w13_E2IH, None, al, 4, torch.bfloat16, cfg=up)
                y_PH = moe_gemm._moe_down(h_MI, None, w2_EHI, None, al, weights_TK, torch.bfloat16, cfg=down)
                h_MI = h_MI[slot_S].float().flatten()
        outs.append(torch.cat([h_MI, y_PH[valid_P].float().flatten()]))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_half_tails_switch(monkeypatch):
    # unset: where it paid (few pairs per expert); 1: at any size; 0: never; never below
    # 128-row blocks on the GPU (a 64-row half is one wgmma M tile a warpgroup)
    set_options(monkeypatch, moe_half_tails=None)
    assert moe_gemm._half_tails(128, True, 128, False) and not moe_gemm._half_tails(128, True, 2048, False)
    assert moe_gemm._half_tails(128, True, 512, True) and not moe_gemm._half_tails(128, True, 512, False)
    set_options(monkeypatch, moe_half_tails=True)
    assert moe_gemm._half_tails(128, True, 2048, False) and not moe_gemm._half_tails(64, True, 2048, False)
    set_options(monkeypatch, moe_half_tails=False)
    assert not moe_gemm._half_tails(128, True, 128, False)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_half_tail_blocks_match_whole_blocks(kind, monkeypatch):
    # HALF_TAILS: a block whose second half is padding computes its first half only. The rows
    # it keeps must come out exactly as when the whole block is computed.
    block_m, t = (128, 128) if torch.cuda.is_available() else (32, 48)  # where moe_gemm turns it on
    gen = torch.Generator().manual_seed(seed("half", kind))
    # a hot expert with several blocks, the other experts' pairs in short last blocks
    x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case("skewed", t, 256, 256, 8, 4, gen)
    al = moe_align(ids_TK, 8, block_m)
    n, valid_P = int(al.num_tokens_post_pad_1), ids_TK.reshape(-1) >= 0
    second_half = al.sorted_ids_M[:n].view(-1, block_m)[:, block_m // 2:].cpu()
    half_blocks = int((second_half[:, 0] >= al.num_pairs).sum())
    assert 0 < half_blocks < n // block_m  # both kinds of block occur
    slot_S = slot_layout(al)[0]
    outs = []
    for on in ("0", "1"):
        set_options(monkeypatch, moe_half_tails=on == "1")
        assert moe_gemm._half_tails(block_m, torch.cuda.is_available(), al.num_pairs / 8, kind == "fp8") == (on == "1")
        with poisoned():
            if kind == "fp8":
                xq_TH, xs_TG = quant_fp8_act(x_TH)
                h_MI, hs_MIb = moe_gemm._moe_up(xq_TH, xs_TG, w13.data, w13.scale, al, 4, FP8_DTYPE)
                y_PH = moe_gemm._moe_down(h_MI, hs_MIb, w2.data, w2.scale, al, weights_TK, torch.bfloat16)
                h_SI = torch.cat([h_MI[slot_S].view(torch.uint8).float(), hs_MIb[slot_S]], dim=1)
            else:
                w13_E2IH, w2_EHI = dequantize(w13).bfloat16(), dequantize(w2).bfloat16()
                h_MI, _ = moe_gemm._moe_up(x_TH, None, w13_E2IH, None, al, 4, torch.bfloat16)
                y_PH = moe_gemm._moe_down(h_MI, None, w2_EHI, None, al, weights_TK, torch.bfloat16)
                h_SI = h_MI[slot_S].float()
        outs.append(torch.cat([h_SI.flatten(), y_PH[valid_P].float().flatten()]))
    assert not outs[1].isnan().any()  # every kept row was written
    differ = outs[0] != outs[1]
    print(f"half tails: {int(differ.sum())} of {differ.numel()} values differ")  # shown with -s
    if kind == "fp8":
        assert torch.equal(outs[0], outs[1])
    else:  # the interpreter's fp32 dot (numpy) may sum a 16-row block in another order: one bf16 step at most
        assert float(differ.float().mean()) <= 1e-3
        assert bool(((outs[0] - outs[1]).abs() <= outs[0].abs() * 2.0**-7).all())


def test_dense_padding_rows_are_zero(monkeypatch):
    # the dense up GEMM loads zeros for padding slots (cheaper at the power cap than token 0's
    # row): with every block computed whole, h is written there and is exactly 0
    set_options(monkeypatch, moe_half_tails=False)
    gen = torch.Generator().manual_seed(seed("zero padding"))
    x_TH, w13_E2IH, w2_EHI = make_experts(24, 128, 96, 8, gen, torch.bfloat16)
    ids_TK, _ = make_routing("skewed", 24, 4, 8, gen)
    al = moe_align(ids_TK, 8, 32)
    n = int(al.num_tokens_post_pad_1)
    pad_S = torch.nonzero(al.sorted_ids_M[:n].cpu() >= al.num_pairs).view(-1)
    assert len(pad_S) > 0
    with poisoned():
        h_MI, _ = moe_gemm._moe_up(x_TH, None, w13_E2IH, None, al, 4, torch.bfloat16)
    assert bool((h_MI[pad_S.to(h_MI.device)] == 0).all())
    assert bool((h_MI[slot_layout(al)[0].to(h_MI.device)] != 0).any())


def test_tuning_lists_prune_what_a_launch_cannot_use():
    # FUSED_GU needs the TMA descriptor; a PERSISTENT loop flattens over one tile shape only, so
    # HALF_TAILS launches (two shapes) drop it. Every launch keeps some config.
    for kind, lists in [*moe_gemm._CONFIGS.items(), *moe_gemm._SMALL_M_CONFIGS.items()]:
        for configs in lists:
            for tma in (True, False):
                for half in (True, False):
                    kept = moe_gemm._prune(configs, {}, W_DESC=tma, HALF_TAILS=half)
                    assert kept, (kind, tma, half)
                    assert not any(c.kwargs.get("PERSISTENT") for c in kept) or not half
                    assert not any(c.kwargs.get("FUSED_GU") for c in kept) or tma
                    dropped = [c for c in configs if c not in kept]
                    assert all((half and c.kwargs.get("PERSISTENT")) or (not tma and c.kwargs.get("FUSED_GU"))
                               for c in dropped)
    assert any(c.kwargs.get("PERSISTENT") for c in moe_gemm._prune(moe_gemm._CONFIGS["bf16"][1], {}, HALF_TAILS=False))
    assert "HALF_TAILS" in moe_gemm._TUNE_KEY  # on and off are tuned apart


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_every_tuning_config(kind, monkeypatch):
    # the autotuner may pick any of them on the GPU: run each (up, down) config once
    gen = torch.Generator().manual_seed(seed(kind))
    x_TH, w13_E2IH, w2_EHI = make_experts(32, 256, 256, 8, gen, torch.float32)
    ids_TK, weights_TK = make_routing("skewed", 32, 4, 8, gen)
    x_TH = x_TH.bfloat16()
    if kind == "fp8":
        w13, w2 = quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI)
        args = (x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
        fn, ref_TH, block_m = fused_moe_fp8, None, 64
    else:
        args = (x_TH, w13_E2IH.bfloat16(), w2_EHI.bfloat16(), ids_TK, weights_TK)
        fn, ref_TH, block_m = fused_moe, fused_moe_ref(*(a.float() for a in args[:3]), *args[3:]), 128
    runs = [(moe_gemm._CONFIGS, block_m)]
    if kind in moe_gemm._SMALL_M_CONFIGS:  # decode sizes: 16-row blocks, their own lists
        runs.append((moe_gemm._SMALL_M_CONFIGS, 16))
    pairs = [(lists, bm, ups[i % len(ups)], downs[i % len(downs)])
             for lists, bm in runs for ups, downs in [lists[kind]] for i in range(max(len(ups), len(downs)))]
    for lists, block_m, up_cfg, down_cfg in pairs:
        monkeypatch.setitem(lists, kind, ([up_cfg], [down_cfg]))
        out_TH = fn(*args, block_m=block_m)
        if kind == "fp8":
            stages = check_fp8_stages(x_TH, w13, w2, ids_TK, weights_TK, block_m, up_cfg, down_cfg)
            check_fp8_layer(out_TH, x_TH, w13, w2, ids_TK, weights_TK, stages["hk_PI"])
        else:
            assert rel_err(out_TH, ref_TH) <= 1e-2, (block_m, up_cfg, down_cfg)


# ------------------------------------------------------------------------------- dispatch


def test_moe_experts_dispatch():
    gen = torch.Generator().manual_seed(11)
    x_TH, w13_E2IH, w2_EHI = make_experts(16, 128, 128, 8, gen, torch.bfloat16)
    ids_TK, weights_TK = make_routing("balanced", 16, 4, 8, gen)
    w13_q, w2_q = quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI)
    dense_ref = fused_moe_ref(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)
    fp8_ref = fused_moe_fp8_ref(x_TH, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK)
    assert torch.equal(moe_experts(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK, use_triton=False), dense_ref)
    assert torch.equal(moe_experts(x_TH, w13_q, w2_q, ids_TK, weights_TK, use_triton=False), fp8_ref)
    dense = moe_experts(x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)  # default: Triton iff CUDA
    assert rel_err(dense, dense_ref) <= 2e-2
    with pytest.raises(ValueError, match="both be QTensor"):
        moe_experts(x_TH, w13_q, w2_EHI, ids_TK, weights_TK)
    out_TH = moe_experts(x_TH, w13_q, w2_q, ids_TK, weights_TK, use_triton=True)
    block_m = moe_gemm.default_block_m(ids_TK.numel(), 8, fp8=True)
    stages = check_fp8_stages(x_TH, w13_q, w2_q, ids_TK, weights_TK, block_m)
    check_fp8_layer(out_TH, x_TH, w13_q, w2_q, ids_TK, weights_TK, stages["hk_PI"])


def test_fused_moe_rejects_bad_input():
    gen = torch.Generator().manual_seed(0)
    x_TH, w13_E2IH, w2_EHI = make_experts(4, 128, 128, 8, gen, torch.bfloat16)
    ids_TK, weights_TK = make_routing("balanced", 4, 2, 8, gen)
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x_TH, w13_E2IH, w2_EHI[:, :, :64], ids_TK, weights_TK)
    with pytest.raises(ValueError, match="must match x's dtype"):
        fused_moe(x_TH, w13_E2IH.float(), w2_EHI, ids_TK, weights_TK)
    w13 = quantize_fp8_block(w13_E2IH.float())
    w2 = quantize_fp8_block(w2_EHI.float())
    with pytest.raises(ValueError, match="w13_scale"):
        fused_moe_fp8(x_TH, w13.data, w13.scale[:, :1], w2.data, w2.scale, ids_TK, weights_TK)


def test_fused_moe_no_tokens():
    gen = torch.Generator().manual_seed(0)
    x_TH, w13_E2IH, w2_EHI = make_experts(0, 128, 128, 8, gen, torch.bfloat16)
    ids_TK = torch.zeros(0, 4, dtype=torch.int64, device=DEV)
    out_TH = fused_moe(x_TH, w13_E2IH, w2_EHI, ids_TK, torch.zeros(0, 4, device=DEV))
    assert out_TH.shape == (0, 128)


# ------------------------------------------------------------------------------- residual
#
# residual_TH: the decoder layer's residual add, done in the experts' sum over k. It must give
# the bits of torch's `residual + out`, in the kernels and the references alike.


def make_residual(t: int, h: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Residual rows of the output's size and larger (the residual stream): the add rounds."""
    return (torch.randn(t, h, generator=gen) * 4).to(DEV, dtype)


def same_ref_sums(a_TH: torch.Tensor, b_TH: torch.Tensor) -> None:
    """Two results of the references: the same bits on the CPU; on a GPU index_add_ sums a token's
    pairs with atomics, in an order that varies from call to call, so there within rounding (in
    bf16 about an ulp of the residual stream's values, std 4: 0.0039 seen on an H100)."""
    if a_TH.device.type == "cpu":
        assert torch.equal(a_TH, b_TH)
    elif a_TH.dtype == torch.bfloat16:
        torch.testing.assert_close(a_TH, b_TH, atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(a_TH, b_TH)


@pytest.mark.parametrize("kind", ["balanced", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_residual_bits(kind, dtype):
    gen = torch.Generator().manual_seed(seed("residual", kind, str(dtype)))
    x_TH, w13_E2IH, w2_EHI = make_experts(48, 256, 128, 8, gen, dtype)
    ids_TK, weights_TK = make_routing(kind, 48, 4, 8, gen)
    res_TH = make_residual(48, 256, dtype, gen)
    args = (x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)
    with poisoned():
        out_TH = fused_moe(*args, residual_TH=res_TH)
    plain_TH = fused_moe(*args)
    assert torch.equal(out_TH, res_TH + plain_TH)
    if kind == "sparse":
        assert torch.equal(out_TH[24], res_TH[24])  # a token routed nowhere keeps its residual
    ref_TH = fused_moe_ref(*args, residual_TH=res_TH)
    same_ref_sums(ref_TH, res_TH + fused_moe_ref(*args))
    same_ref_sums(moe_experts(*args, use_triton=False, residual_TH=res_TH), ref_TH)
    assert torch.equal(moe_experts(*args, use_triton=True, residual_TH=res_TH), out_TH)


def test_fused_moe_fp8_residual_bits():
    gen = torch.Generator().manual_seed(seed("residual fp8"))
    x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case("sparse", 32, 192, 160, 8, 4, gen)
    res_TH = make_residual(32, 192, torch.bfloat16, gen)
    args = (x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
    with poisoned():
        out_TH = fused_moe_fp8(*args, block_m=64, residual_TH=res_TH)
    assert torch.equal(out_TH, res_TH + fused_moe_fp8(*args, block_m=64))
    ref_TH = fused_moe_fp8_ref(*args, residual_TH=res_TH)
    same_ref_sums(ref_TH, res_TH + fused_moe_fp8_ref(*args))
    same_ref_sums(moe_experts(x_TH, w13, w2, ids_TK, weights_TK, use_triton=False, residual_TH=res_TH), ref_TH)


def test_residual_with_no_tokens_and_bad_residuals():
    gen = torch.Generator().manual_seed(seed("residual edges"))
    x_TH, w13_E2IH, w2_EHI = make_experts(4, 128, 128, 8, gen, torch.bfloat16)
    ids_TK, weights_TK = make_routing("balanced", 4, 2, 8, gen)
    args = (x_TH, w13_E2IH, w2_EHI, ids_TK, weights_TK)
    w13, w2 = quantize_fp8_block(w13_E2IH.float()), quantize_fp8_block(w2_EHI.float())
    fp8_args = (x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
    # no (token, k) pair at all: the residual comes back, not zeros
    res_TH = make_residual(4, 128, torch.bfloat16, gen)
    no_k = (ids_TK[:, :0], weights_TK[:, :0])
    assert torch.equal(fused_moe(*args[:3], *no_k, residual_TH=res_TH), res_TH)
    assert torch.equal(fused_moe_fp8(*fp8_args[:5], *no_k, residual_TH=res_TH), res_TH)
    assert fused_moe(x_TH[:0], w13_E2IH, w2_EHI, ids_TK[:0], weights_TK[:0], residual_TH=res_TH[:0]).shape == (0, 128)
    # a residual that is not the output's [T, H] in its dtype
    for bad in (res_TH[:3], res_TH[:, :64], res_TH.float()):
        for fn, fn_args in ((fused_moe, args), (fused_moe_ref, args), (fused_moe_fp8, fp8_args),
                            (fused_moe_fp8_ref, fp8_args)):
            with pytest.raises(ValueError, match="residual_TH"):
                fn(*fn_args, residual_TH=bad)
        with pytest.raises(ValueError, match="residual_TH"):
            moe_experts(*args, residual_TH=bad)
    with pytest.raises(ValueError, match=r"fused_moe: residual_TH must be \[T, H\] = \[4, 128\] torch.bfloat16"):
        fused_moe(*args, residual_TH=res_TH.float())


if __name__ == "__main__":  # the FP8 numbers the bounds above rest on, per test case: python tests/test_moe_kernels.py
    for kind in ROUTINGS:
        for dims in [(256, 128), (192, 160)]:
            gen = torch.Generator().manual_seed(seed(kind, dims))
            x_TH, w13, w2, ids_TK, weights_TK = make_fp8_case(kind, 32, *dims, 8, 4, gen)
            stages = check_fp8_stages(x_TH, w13, w2, ids_TK, weights_TK, 64)
            out_TH = fused_moe_fp8(x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK, block_m=64)
            layer = check_fp8_layer(out_TH, x_TH, w13, w2, ids_TK, weights_TK, stages["hk_PI"])
            print(
                f"{kind:8s} H, I = {dims}: max |h - h_exact| = {stages['acc_rel_max']:.3g} x sum|x||w| terms "
                f"(bound {FP8_ACC_REL:.3g}); h codes off the exact rounding {stages['flips']}/{stages['num_h']}; "
                f"layer vs simulation max-rel {layer:.3g}"
            )
