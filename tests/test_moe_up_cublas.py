"""The FP8 MoE up GEMM as per-expert cuBLASLt GEMMs (mimo_fn.kernels.moe.up_cublas) and its choice in gemm.py.

On a CPU the per-expert GEMM is `scaled_mm_into_ref` (dequantise and matmul in fp32; it checks the
scale strides cuBLASLt demands), the Triton gather / scale-layout / SiLU-quantise kernels run in
the interpreter. On a Hopper GPU the real scaled_mm runs, against the same reference.
"""

import pytest
import torch

from mimo_fn import options
from mimo_fn.kernels.moe import gemm as moe_gemm
from mimo_fn.kernels.moe import up_cublas as uc
from mimo_fn.kernels.moe.align import moe_align_ref
from mimo_fn.kernels.moe.ref import fused_moe_fp8_ref
from mimo_fn.quant import BLOCK, FP8_DTYPE, dequantize_fp8_act, quantize_fp8_act_ref, quantize_fp8_block

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _case(t: int, e: int, k: int, hid: int, inter: int, seed: int):
    """Skewed routing with ~5% dropped pairs, FP8 x (1x128 scales) and block-quantised w13, w2."""
    g = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, e + 1, dtype=torch.float32)
    ids_TK = torch.multinomial(popularity.expand(t, e).contiguous(), k, replacement=False, generator=g)
    ids_TK[torch.rand(t, k, generator=g) < 0.05] = -1
    x_TH = torch.randn(t, hid, generator=g) * (torch.rand(t, 1, generator=g) * 4 + 0.1)
    w13 = quantize_fp8_block(torch.randn(e, 2 * inter, hid, generator=g) / hid**0.5)
    w2 = quantize_fp8_block(torch.randn(e, hid, inter, generator=g) / inter**0.5)
    weights_TK = torch.rand(t, k, generator=g)
    return ids_TK.int().to(DEV), x_TH.to(DEV), w13, w2, weights_TK.to(DEV)


def _h_true(q_TH, s_TG, w13, al, top_k):
    """silu(gate) * up per used real slot in float64 from the dequantised operands: (rows, h_RI)."""
    x64 = dequantize_fp8_act(q_TH, s_TG, torch.float64)
    w64 = w13.data.double() * w13.scale.double().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
    used = int(al.num_tokens_post_pad_1)
    pair_M = al.sorted_ids_M[:used].long()
    eob = al.expert_of_block_NB.long()
    rows = torch.nonzero(pair_M < al.num_pairs).view(-1)
    tok, exp = pair_M[rows] // top_k, eob[rows // al.block_m]
    gu = torch.einsum("rh,rnh->rn", x64[tok], w64.to(x64.device)[exp])
    inter = gu.shape[1] // 2
    return rows, torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]


@pytest.mark.parametrize("seed", [0, 1])
def test_h_matches_float64(seed, monkeypatch):
    """Every used slot's h (dequantised) within FP8 rounding of the float64 product; padding slots
    zero; outputs poisoned first, so an unwritten used row shows."""
    e, k, hid, inter = 6, 2, 512, 256  # H / 128 a multiple of 4 (up_cublas.H_MULTIPLE)
    ids_TK, x_TH, w13, _, _ = _case(150, e, k, hid, inter, seed)
    q_TH, s_TG = quantize_fp8_act_ref(x_TH)
    s_TG = s_TG.t().contiguous().t()  # M-major, as quant_fp8_act makes them
    al = moe_align_ref(ids_TK, e, 128)
    real_empty = torch.empty

    def poisoned(*size, **kw):
        out = real_empty(*size, **kw)
        (out.view(torch.uint8).fill_(0x7F) if out.dtype == FP8_DTYPE else out.fill_(float("nan")))
        return out

    monkeypatch.setattr(torch, "empty", poisoned)
    h_MI, hs_MIb = uc.moe_up_fp8_cublas(q_TH, s_TG, w13.data.to(DEV), w13.scale.to(DEV), al, k,
                                        gemm=None if ON_HOPPER else uc.scaled_mm_into_ref)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert hs_MIb.stride(0) == 1  # [Ib, M] storage, the down GEMM's layout
    if ON_HOPPER:  # torch._scaled_mm.out took the block scales: no copy of each expert's output
        assert uc._OUT_VARIANT == [True]
    used = int(al.num_tokens_post_pad_1)
    h = dequantize_fp8_act(h_MI[:used], hs_MIb[:used], torch.float64)
    assert torch.isfinite(h).all()
    rows, want = _h_true(q_TH, s_TG, w13, al, k)
    got = h[rows]
    amax = want.abs().view(len(rows), -1, BLOCK).amax(-1).repeat_interleave(BLOCK, 1)
    # e4m3 rounds to 2^-4 of a value; bf16 gate / up (and the GEMM's fp32 sums) shift it a little more
    assert ((got - want).abs() <= want.abs() * 2**-3.5 + amax * 2**-9).all()
    pad = torch.ones(used, dtype=torch.bool, device=h.device)
    pad[rows] = False
    assert pad.any() and (h[pad] == 0).all()


def test_fused_moe_fp8_through_cublas_matches_ref(monkeypatch):
    """The whole FP8 MoE with the up GEMM forced onto this path (the GEMM emulated off Hopper)."""
    e, k, hid, inter = 5, 2, 512, 128
    ids_TK, x_TH, w13, w2, weights_TK = _case(140, e, k, hid, inter, seed=4)
    x_TH = x_TH.bfloat16()
    taken = []
    if not ON_HOPPER:
        monkeypatch.setattr(uc, "serves", lambda x, w, bm: bm == 128)
        monkeypatch.setattr(uc, "scaled_mm_into", uc.scaled_mm_into_ref)
    real = uc.moe_up_fp8_cublas
    monkeypatch.setattr(uc, "moe_up_fp8_cublas", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    ws = [t.to(DEV) for t in (w13.data, w13.scale, w2.data, w2.scale)]
    with options.override(moe_up_cublas=True):
        out = moe_gemm.fused_moe_fp8(x_TH, *ws, ids_TK, weights_TK, block_m=128, down_ws=False)
    assert taken == [1]
    ref = fused_moe_fp8_ref(x_TH, *ws, ids_TK, weights_TK).float()
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, err


def test_takes_only_where_asked_and_it_serves(monkeypatch):
    monkeypatch.setattr(uc, "serves", lambda x, w, bm: bm == 128)
    x, w = torch.zeros(1, 128), torch.zeros(1, 256, 128)
    assert not uc.takes(x, w, 128)  # opt-in
    with options.override(moe_up_cublas=True):
        assert uc.takes(x, w, 128) and not uc.takes(x, w, 64)


def test_moe_up_never_in_deterministic_mode_or_with_a_forced_config(monkeypatch):
    monkeypatch.setattr(uc, "takes", lambda *a: True)
    monkeypatch.setattr(uc, "moe_up_fp8_cublas", lambda *a: "cublas")
    monkeypatch.setattr(moe_gemm, "_kernel", lambda *a: (_ for _ in ()).throw(RuntimeError("triton")))
    al = moe_align_ref(torch.zeros(2, 1, dtype=torch.int32), 1, 128)
    args = (torch.zeros(2, 128).to(FP8_DTYPE), torch.ones(2, 1), torch.zeros(1, 256, 128).to(FP8_DTYPE),
            torch.ones(1, 2, 1), al, 1, FP8_DTYPE)
    assert moe_gemm._moe_up(*args) == "cublas"
    for kw in (dict(deterministic=True), dict(cfg=object())):
        with pytest.raises(RuntimeError, match="triton"):
            moe_gemm._moe_up(*args, **kw)
    with pytest.raises(RuntimeError, match="triton"):  # the float32 h probe
        moe_gemm._moe_up(*args[:6], torch.float32)


def test_bad_inputs_raise():
    ids_TK, x_TH, w13, _, _ = _case(20, 4, 2, 512, 128, seed=2)
    q_TH, s_TG = quantize_fp8_act_ref(x_TH)
    with pytest.raises(ValueError, match="block_m is 64, expected 128"):
        uc.moe_up_fp8_cublas(q_TH, s_TG, w13.data, w13.scale, moe_align_ref(ids_TK, 4, 64), 2)
    with pytest.raises(ValueError, match="and I a multiple of 128"):
        uc.moe_up_fp8_cublas(q_TH, s_TG, w13.data[:, :192], w13.scale[:, :2], moe_align_ref(ids_TK, 4, 128), 2)
    with pytest.raises(ValueError, match="H, a multiple of 512"):  # cuBLASLt's wrong results at H / 128 = 2
        uc.moe_up_fp8_cublas(q_TH[:, :256], s_TG[:, :2], w13.data[..., :256], w13.scale[..., :2],
                             moe_align_ref(ids_TK, 4, 128), 2)
    a = torch.zeros(128, 256).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="strides"):  # a slice of a shared M-major scale buffer
        uc.scaled_mm_into_ref(torch.empty(128, 256), a, torch.ones(2, 256).t()[:128], a, torch.ones(2, 2))
    assert not uc.serves(q_TH.cpu(), w13.data, 128)  # CPU tensors: the Triton path
