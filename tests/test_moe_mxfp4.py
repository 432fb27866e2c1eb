"""MXFP4-weight MoE kernels (mimo_fn.kernels.moe.mxfp4) against `fused_moe_mxfp4_ref`.

Legend: T tokens, H hidden, I expert intermediate, E experts, K experts per token, P = T*K pairs,
M aligned slots.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (small shapes, the portable
dequantisation); on CUDA natively at moderate shapes, with both dequantisations (the PTX one
is CUDA-only). Buffers the kernels allocate are NaN / garbage while they run (`poisoned`), so a
slot they forget to write shows up. Routings as in test_moe_kernels: balanced, skewed (~90% of
pairs on one expert), sparse (empty experts, -1 padding, a token routed nowhere).
"""

import pytest
import torch

from test_moe_kernels import (  # first: sets TRITON_INTERPRET
    DEV, ROUTINGS, make_routing, poisoned, rel_err, seed, set_options)
from mimo_fn.kernels.moe import gemm as moe_gemm
from mimo_fn.kernels.moe import mxfp4 as mx
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.dispatch import fused_moe_mxfp4, moe_experts
from mimo_fn.kernels.moe.gemm import _moe_sum_topk
from mimo_fn.kernels.moe.mxfp4 import _moe_down_mxfp4, _moe_up_mxfp4
from mimo_fn.kernels.moe.ref import fused_moe_mxfp4_ref
from mimo_fn.quant import MXFP4, QTensor, dequantize, quantize_fp8_block, quantize_mxfp4

CUDA = torch.cuda.is_available()
# Under the interpreter numpy warns where the inputs make it on purpose: SiLU of gate values
# below ~-88 (the groups scaled by 2^8) overflows exp to inf and the sigmoid to 0, its right
# limit; the exactness test multiplies NaN / inf weights (E8M0 255, code 7 at exponent 254).
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")]
# (T, H, I, E, K): H and I are multiples of 32 (the format) but not of the tiles (64 wide in the
# interpreter, 64 / 128 on CUDA): K tails in both GEMMs and partial N tiles
DIMS = (512, 544, 288, 16, 4) if CUDA else (40, 160, 96, 8, 4)
FAST = [True, False] if CUDA else [False]  # the PTX dequantisation exists on CUDA only


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    # numerics, not speed: one config per kernel keeps CUDA compile time down (the bench tunes)
    set_options(monkeypatch, moe_autotune=False)


def _fast(monkeypatch, fast: bool) -> None:
    set_options(monkeypatch, mxfp4_fast_cvt=fast)


def make_weights(e: int, h: int, i: int, gen: torch.Generator) -> tuple[QTensor, QTensor]:
    """MXFP4 w13 [E, 2I, H] and w2 [E, H, I] on DEV from 0.1 * randn, a few 32-groups scaled by
    2^8 or 2^-8 (E8M0 exponents far from the rest)."""
    ws = []
    for n, k in ((2 * i, h), (h, i)):
        w = torch.randn(e, n, k, generator=gen) * 0.1
        groups = w.view(e, n, k // 32, 32)
        pick = torch.rand(e, n, k // 32, generator=gen)
        groups[pick < 0.02] *= 2.0**8
        groups[pick > 0.98] *= 2.0**-8
        ws.append(quantize_mxfp4(w.to(DEV)))
    return ws[0], ws[1]


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", FAST)
def test_matches_ref(kind, dtype, fast, monkeypatch):
    _fast(monkeypatch, fast)
    t, h, i, e, k = DIMS
    gen = torch.Generator().manual_seed(seed("mxfp4", kind, str(dtype)))
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV, dtype)
    ids_TK, weights_TK = make_routing(kind, t, k, e, gen)
    with poisoned():
        out_TH = fused_moe_mxfp4(x_TH, w13, w2, ids_TK, weights_TK)
    assert out_TH.dtype == dtype and out_TH.shape == (t, h)
    # fp32 reference on the same operands: the kernel rounds h, the per-pair rows and out to
    # x's dtype, the bf16 reference every intermediate (so it is itself ~0.5% off)
    ref_TH = fused_moe_mxfp4_ref(x_TH.float(), w13, w2, ids_TK, weights_TK)
    assert rel_err(out_TH, ref_TH) <= (1e-5 if dtype == torch.float32 else 1e-2)
    if dtype == torch.bfloat16:
        assert rel_err(out_TH, fused_moe_mxfp4_ref(x_TH, w13, w2, ids_TK, weights_TK)) <= 2e-2
    if kind == "sparse":
        assert bool((out_TH[t // 2] == 0).all())  # the token routed nowhere


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_block_m_and_even_dims(block_m):
    # T not a multiple of block_m, several blocks for the hot expert; H, I multiples of every
    # tile (the unmasked K loop)
    t, e, k = 37, 8, 4
    h, i = (512, 256) if CUDA else (128, 64)
    gen = torch.Generator().manual_seed(seed("mxfp4 block_m", block_m))
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV)
    ids_TK, weights_TK = make_routing("skewed", t, k, e, gen)
    with poisoned():
        out_TH = fused_moe_mxfp4(x_TH, w13, w2, ids_TK.to(torch.int32), weights_TK, block_m=block_m)
    assert rel_err(out_TH, fused_moe_mxfp4_ref(x_TH, w13, w2, ids_TK, weights_TK)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", FAST)
def test_dequantisation_is_exact_for_every_code_and_scale(dtype, fast, monkeypatch):
    # The down GEMM on one-hot rows of h returns columns of its dequantised weights exactly
    # (one nonzero product per sum). Every byte value and every E8M0 exponent appears; 255 is
    # NaN and 254 with code 7 overflows to inf, and those rows come out NaN in both (0 * NaN).
    # Exponents 0 and 1 give subnormal weights, which the GPU's multipliers and the interpreter's
    # bf16 casts may flush: checked in fp32 in the interpreter only.
    _fast(monkeypatch, fast)
    e, hid, inter = 2, 64, 64
    gen = torch.Generator().manual_seed(seed("mxfp4 exact", str(dtype)))
    data = torch.randint(0, 256, (e, hid, inter // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    lowest = 0 if DEV == "cpu" and dtype == torch.float32 else 2
    scale = (torch.randperm(256, generator=gen) % (256 - lowest) + lowest).to(torch.uint8).view(e, hid, inter // 32)
    w2 = QTensor(data.to(DEV), scale.to(DEV), MXFP4)
    # expert j % 2 for token j: its rank among the expert's tokens is j // 2, one column each
    ids_TK = (torch.arange(2 * inter) % 2).view(-1, 1).to(DEV)
    al = moe_align(ids_TK, e, 16)
    used = int(al.num_tokens_post_pad_1)
    pair_S = al.sorted_ids_M[:used].long()
    slot_S = torch.nonzero(pair_S < al.num_pairs).view(-1)
    h_MI = torch.zeros(al.sorted_ids_M.numel(), inter, dtype=dtype, device=DEV)
    h_MI[slot_S, pair_S[slot_S] // 2] = 1.0
    with poisoned():
        y_PH = _moe_down_mxfp4(h_MI, w2, al, torch.ones(2 * inter, 1, device=DEV))
    # the same sums, elementwise in float64, so NaN / inf weights propagate as in the dot
    want_EHI = dequantize(w2, torch.float32).cpu().double()
    onehot_PI = torch.eye(inter, dtype=torch.float64)[torch.arange(2 * inter) // 2]
    want_PH = (onehot_PI[:, None, :] * want_EHI[torch.arange(2 * inter) % 2]).sum(-1)
    torch.testing.assert_close(y_PH.cpu().double(), want_PH, rtol=0, atol=0, equal_nan=True)


def test_moe_experts_decides_on_the_pairs_an_expert_really_gets(monkeypatch):
    # Rows gathered from EP ranks carry -1 for other ranks' experts, so T * K / E overcounts;
    # the layer passes pairs_per_expert, and that, not T * K / E, makes the kernels' size
    # choices: rows per aligned block, half tails, the MXFP4 path. Recorded at the decisions.
    seen = []
    real_block_m, real_half_tails = moe_gemm.default_block_m, moe_gemm._half_tails
    monkeypatch.setattr(moe_gemm, "default_block_m",
                        lambda pairs, e, fp8=False: seen.append(("block_m", pairs, e, fp8)) or real_block_m(pairs, e, fp8))
    monkeypatch.setattr(moe_gemm, "_half_tails",
                        lambda bm, cuda, per, fp8: seen.append(("half", per)) or real_half_tails(bm, cuda, per, fp8))
    monkeypatch.setattr(mx, "dequantize_first", lambda per, on_cuda: seen.append(("dequantize", per)) or per >= 8)
    t, h, i, e, k = 24, 64, 64, 4, 2
    gen = torch.Generator().manual_seed(seed("mxfp4 pairs per expert"))
    w13, w2 = make_weights(e, h, i, gen)
    dense13, dense2 = dequantize(w13, torch.float32), dequantize(w2, torch.float32)
    x_TH = torch.randn(t, h, generator=gen).to(DEV)
    ids_TK, weights_TK = make_routing("sparse", t, k, e, gen)
    for w in ((dense13, dense2), (quantize_fp8_block(dense13), quantize_fp8_block(dense2)), (w13, w2)):
        for hint in (None, 2.5, 9.0):
            seen.clear()
            with poisoned():
                out_TH = moe_experts(x_TH, *w, ids_TK, weights_TK, use_triton=True, pairs_per_expert=hint)
            ref_TH = moe_experts(x_TH, *w, ids_TK, weights_TK, use_triton=False)
            assert rel_err(out_TH, ref_TH) <= (3e-2 if w[0] is not dense13 else 1e-5)  # FP8: activations too
            per = t * k / e if hint is None else hint
            fmt = "mxfp4" if w[0] is w13 else "fp8" if isinstance(w[0], QTensor) else "dense"
            copy = fmt == "mxfp4" and per >= 8
            assert seen[0] == (("dequantize", per) if fmt == "mxfp4" else ("block_m", round(per * e), e, fmt == "fp8"))
            if fmt == "mxfp4":
                assert seen[1] == ("block_m", round(per * e), e, not copy)
            halves = [s for s in seen if s[0] == "half"]
            assert halves == ([("half", per)] * 2 if fmt != "mxfp4" or copy else []), (fmt, hint, seen)


def _config_cases():
    """(block_m, up config, down config): on CUDA every pair of the tuning lists at the block_m
    they serve; in the interpreter its tiles with SWAP_AB, SPLIT_DOT or neither."""
    if not CUDA:
        return [pytest.param(bm, mx._cfg(64, 64, 4, 1, **kw), mx._cfg(64, 64, 4, 1, **kw), id=f"bm{bm}-{name}")
                for bm, name, kw in ((16, "plain", {}), (16, "swap", {"swap": True}), (16, "split", {"split": True}),
                                     (64, "split", {"split": True}))]
    return [pytest.param(bm, ups[j % len(ups)], downs[j % len(downs)], id=f"bm{bm}-{j}")
            for bm, (ups, downs) in ((128, mx._CONFIGS["bf16"]), (16, mx._SMALL_M_CONFIGS["bf16"]))
            for j in range(max(len(ups), len(downs)))]


@pytest.mark.parametrize("block_m, up_cfg, down_cfg", _config_cases())
def test_every_tuning_config(block_m, up_cfg, down_cfg):
    # bf16 at the model's top-8; on CUDA H, I, K and the strides divide as at the model's dims, so
    # these compiles are the ones the autotuner reuses there
    t, h, i, e, k = (256, 512, 512, 16, 8) if CUDA else (24, 128, 128, 8, 4)
    gen = torch.Generator().manual_seed(seed("mxfp4 configs", block_m, str(up_cfg), str(down_cfg)))
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)
    ids_TK, weights_TK = make_routing("balanced", t, k, e, gen)
    with poisoned():
        al = moe_align(ids_TK, e, block_m)
        h_MI = _moe_up_mxfp4(x_TH, w13, al, k, cfg=up_cfg)
        y_PH = _moe_down_mxfp4(h_MI, w2, al, weights_TK, cfg=down_cfg)
        out_TH = _moe_sum_topk(y_PH, ids_TK, e, x_TH.dtype)
    assert rel_err(out_TH, fused_moe_mxfp4_ref(x_TH.float(), w13, w2, ids_TK, weights_TK)) <= 1e-2


def test_moe_experts_dispatches_mxfp4():
    t, h, i, e, k = 16, 64, 64, 4, 2
    gen = torch.Generator().manual_seed(5)
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV)
    ids_TK, weights_TK = make_routing("balanced", t, k, e, gen)
    out_TH = moe_experts(x_TH, w13, w2, ids_TK, weights_TK, use_triton=True)
    assert torch.equal(out_TH, fused_moe_mxfp4(x_TH, w13, w2, ids_TK, weights_TK))
    ref_TH = moe_experts(x_TH, w13, w2, ids_TK, weights_TK, use_triton=False)
    assert rel_err(out_TH, ref_TH) <= 1e-5


def test_no_tokens():
    gen = torch.Generator().manual_seed(6)
    w13, w2 = make_weights(4, 64, 32, gen)
    out_TH = fused_moe_mxfp4(torch.randn(0, 64, device=DEV), w13, w2, torch.zeros(0, 2, dtype=torch.int64, device=DEV),
                             torch.zeros(0, 2, device=DEV))
    assert out_TH.shape == (0, 64)


def test_rejects_bad_input():
    gen = torch.Generator().manual_seed(7)
    e, h, i = 4, 64, 32
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(3, h, device=DEV)
    ids_TK, weights_TK = make_routing("balanced", 3, 2, e, gen)
    args = (ids_TK, weights_TK)
    with pytest.raises(ValueError, match="w13 must be an 'mxfp4' QTensor"):
        fused_moe_mxfp4(x_TH, quantize_fp8_block(torch.randn(e, 2 * i, h, device=DEV)), w2, *args)
    with pytest.raises(ValueError, match="w2 must be an 'mxfp4' QTensor"):
        fused_moe_mxfp4(x_TH, w13, QTensor(w2.data, w2.scale, "nvfp4"), *args)
    with pytest.raises(ValueError, match=r"\(w2\).*scales"):  # one scale group short
        fused_moe_mxfp4(x_TH, w13, QTensor(w2.data, w2.scale[..., :-1], MXFP4), *args)
    with pytest.raises(ValueError, match="multiple of 32"):  # K = 48
        fused_moe_mxfp4(x_TH, QTensor(w13.data[..., :24], w13.scale[..., :1], MXFP4), w2, *args)
    with pytest.raises(ValueError, match="must be uint8"):
        fused_moe_mxfp4(x_TH, QTensor(w13.data.to(torch.int16), w13.scale, MXFP4), w2, *args)
    with pytest.raises(ValueError, match="w13 must be"):  # H mismatch
        fused_moe_mxfp4(torch.randn(3, 2 * h, device=DEV), w13, w2, *args)
    with pytest.raises(ValueError, match="w2 must be"):  # I = 64 against w13's 32
        fused_moe_mxfp4(x_TH, w13, quantize_mxfp4(torch.randn(e, h, 2 * i, device=DEV)), *args)
    with pytest.raises(ValueError, match="x must be"):
        fused_moe_mxfp4(x_TH.to(torch.float64), w13, w2, *args)


@pytest.mark.parametrize("dequantize", [False, True])
def test_residual_bits(dequantize):
    # residual_TH (the decoder layer's residual add, in the sum over k): torch's residual + out, to the bit
    t, h, i, e, k = 16, 64, 64, 4, 2
    gen = torch.Generator().manual_seed(seed("mxfp4 residual", dequantize))
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV, torch.bfloat16)
    res_TH = (4 * torch.randn(t, h, generator=gen)).to(DEV, torch.bfloat16)
    ids_TK, weights_TK = make_routing("sparse", t, k, e, gen)
    args = (x_TH, w13, w2, ids_TK, weights_TK)
    with poisoned():
        out_TH = fused_moe_mxfp4(*args, dequantize=dequantize, residual_TH=res_TH)
    assert torch.equal(out_TH, res_TH + fused_moe_mxfp4(*args, dequantize=dequantize))
    ref_TH = fused_moe_mxfp4_ref(*args, residual_TH=res_TH)
    assert torch.equal(ref_TH, res_TH + fused_moe_mxfp4_ref(*args))
    assert torch.equal(moe_experts(*args, use_triton=False, residual_TH=res_TH), ref_TH)
    assert torch.equal(fused_moe_mxfp4(*args[:3], ids_TK[:, :0], weights_TK[:, :0], residual_TH=res_TH), res_TH)
    with pytest.raises(ValueError, match="residual_TH"):
        fused_moe_mxfp4(*args, residual_TH=res_TH.float())
