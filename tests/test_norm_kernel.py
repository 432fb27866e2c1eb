"""The one-pass RMSNorm kernel against `mimo_fn.layers.norm.rms_norm_ref`, and the residual add
fused in front of it (`add_rms_norm`) against `add_rms_norm_ref` and the two steps it replaces, and the
norm with the FP8 quantiser behind it (`rms_norm_quant_fused`) against those two kernels.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn.kernels.fp8_quant import quant_fp8_act  # noqa: E402
from mimo_fn.kernels.rmsnorm import (  # noqa: E402
    add_rms_norm_fused, rms_norm_fused, rms_norm_quant_fused, unsupported_reason)
from mimo_fn.layers.norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from mimo_fn.quant import dequantize_fp8_act  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_tokens,hidden", [(5, 64), (3, 100), (2, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_kernel_matches_reference(num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    # rows of very different scales: the norm must not care
    x = (torch.randn(num_tokens, hidden, generator=gen) * torch.logspace(-3, 3, num_tokens)[:, None]).to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    x, w = x.to(DEVICE), w.to(DEVICE)
    ref = rms_norm_ref(x, w, 1e-6).float()
    out = torch.full_like(x, float("nan"))  # every element must be written
    rms_norm_fused(x, w, 1e-6, out_TH=out)
    err = (out.float() - ref).abs()
    if dtype == torch.float32:
        assert err.max() <= 1e-5 * ref.abs().max(), err.max().item()
    else:
        # the fp32 scale may differ in its last bit; that can flip the rounding of x * scale to bf16
        # (one ulp, <= 2^-7 relative), and the weight's product rounds once more: <= 2^-6 relative
        assert (err <= 2.0**-6 * ref.abs() + 1e-30).all(), (err / ref.abs()).max().item()
        assert (err > 0).float().mean() < 0.02  # and it rarely happens


def test_rms_norm_dispatch_and_strided_rows():
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(4, 80, generator=gen).to(DEVICE)
    x = buf[:, :64]  # rows strided, as a view of a wider buffer
    w = torch.randn(64, generator=gen).to(DEVICE)
    ref = rms_norm_ref(x, w, 1e-5)
    torch.testing.assert_close(rms_norm_fused(x, w, 1e-5), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-6)
    assert rms_norm_fused(x[:0], w, 1e-5).shape == (0, 64)


def test_rms_norm_kernel_bad_inputs():
    x = torch.randn(3, 8, device=DEVICE)
    assert unsupported_reason(x, torch.randn(8, device=DEVICE)) is None
    assert "dtypes" in unsupported_reason(x, torch.randn(8, device=DEVICE).bfloat16())
    assert "contiguous" in unsupported_reason(x.t().contiguous().t(), torch.randn(8, device=DEVICE))
    assert "H=20000" in unsupported_reason(torch.empty(1, 20000), torch.empty(20000))
    with pytest.raises(ValueError, match="dtypes"):
        rms_norm_fused(x, torch.randn(8, device=DEVICE).double(), 1e-5)
    with pytest.raises(ValueError, match="out_TH"):
        rms_norm_fused(x, torch.randn(8, device=DEVICE), 1e-5, out_TH=torch.empty(3, 8, device=DEVICE).bfloat16())
    # mixed dtypes keep the reference's type promotion (here fp32 out): the dispatcher falls back
    assert rms_norm(x.bfloat16(), torch.randn(8, device=DEVICE), 1e-5).dtype == torch.float32


def residual_case(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int):
    """(x, r, w) on DEVICE: rows of very different scales, r of x's scale give or take 2^+-4 (the
    sum rounds, and sometimes cancels)."""
    gen = torch.Generator().manual_seed(seed)
    scale_T1 = torch.logspace(-3, 3, num_tokens)[:, None]
    x = torch.randn(num_tokens, hidden, generator=gen) * scale_T1
    r = torch.randn(num_tokens, hidden, generator=gen) * scale_T1 * 2.0 ** torch.randint(-4, 5, (num_tokens, 1),
                                                                                          generator=gen)
    w = 1 + 0.5 * torch.randn(hidden, generator=gen)
    return x.to(DEVICE, dtype), r.to(DEVICE, dtype), w.to(DEVICE, dtype)


def poison_empty_like(monkeypatch):
    """torch.empty_like returns NaN-filled buffers: an element the kernel does not write shows."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: real(*a, **k).fill_(float("nan")))


@pytest.mark.parametrize("num_tokens,hidden", [(5, 64), (3, 100), (7, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_add_rms_norm_kernel_bits(num_tokens, hidden, dtype, monkeypatch):
    x, r, w = residual_case(num_tokens, hidden, dtype, seed=hidden + num_tokens)
    with monkeypatch.context() as m:
        poison_empty_like(m)
        sum_TH, normed_TH = add_rms_norm_fused(x, r, w, 1e-6)
    ref_sum_TH, ref_normed_TH = add_rms_norm_ref(x, r, w, 1e-6)
    # the sum is torch's x + r to the bit; the norm is rms_norm_fused's of that sum to the bit
    assert torch.equal(sum_TH, ref_sum_TH)
    assert torch.equal(normed_TH, rms_norm_fused(x + r, w, 1e-6))
    # and as close to the reference's norm as rms_norm_fused is (test_rms_norm_kernel_matches_reference)
    err = (normed_TH.float() - ref_normed_TH.float()).abs()
    assert (err <= 2.0**-6 * ref_normed_TH.float().abs() + 1e-30).all(), (err / ref_normed_TH.abs()).max().item()


def test_add_rms_norm_dispatch_and_strided_rows():
    x_wide, r_wide, w = residual_case(6, 80, torch.bfloat16, seed=1)
    x, r, w = x_wide[:, :64], r_wide[:, 8:72], w[:64]  # rows strided, as views of wider buffers
    ref_sum_TH, ref_normed_TH = add_rms_norm_ref(x, r, w, 1e-5)
    sum_TH, normed_TH = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(sum_TH, ref_sum_TH)
    if DEVICE == "cpu":  # the CPU path is the reference itself
        assert torch.equal(normed_TH, ref_normed_TH)
    fused_sum_TH, fused_normed_TH = add_rms_norm_fused(x, r, w, 1e-5)
    assert torch.equal(fused_sum_TH, ref_sum_TH) and torch.equal(fused_normed_TH, rms_norm_fused(x + r, w, 1e-5))
    assert [t.shape for t in add_rms_norm_fused(x[:0], r[:0], w, 1e-5)] == [(0, 64), (0, 64)]
    # where the kernel cannot take r, the two steps run (here torch's type promotion: fp32 out)
    s32_TH, n32_TH = add_rms_norm(x, r.float(), w.float(), 1e-5)
    assert s32_TH.dtype == n32_TH.dtype == torch.float32 and torch.equal(s32_TH, x + r.float())


def test_add_rms_norm_kernel_bad_inputs():
    x, r, w = residual_case(3, 8, torch.float32, seed=2)
    assert unsupported_reason(x, w, r) is None
    assert "r torch.bfloat16" in unsupported_reason(x, w, r.bfloat16())
    assert "(want x's" in unsupported_reason(x, w, r[:2])
    assert "r's rows" in unsupported_reason(x, w, r.t().contiguous().t())
    with pytest.raises(ValueError, match="add_rms_norm_fused: unsupported call: r torch.bfloat16"):
        add_rms_norm_fused(x, r.bfloat16(), w, 1e-5)


@pytest.mark.parametrize("num_tokens,hidden,num_rows", [(5, 256, 5), (3, 384, 8), (6, 4096, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_quant_kernel_bits(num_tokens, hidden, num_rows, dtype, monkeypatch):
    # the norm rounded as rms_norm_fused stores it, then quant_fp8_act's codes and scales, padding rows
    # included (codes 0, the floor scale); H=384 leaves a masked tail in the 512-wide row tile. Rows
    # strided, of very different scales, one all zero; outputs poisoned first
    x_wide, _, w = residual_case(num_tokens, hidden + 16, dtype, seed=hidden)
    x, w = x_wide[:, 8:hidden + 8], w[:hidden]
    x[1] = 0
    real = torch.empty
    outputs = {(num_rows, hidden), (hidden // 128, num_rows)}  # the codes' and the scales' buffers

    def poisoned(*shape, **kw):  # only those two: Triton's interpreter allocates with torch.empty too
        out = real(*shape, **kw)
        return out.fill_(float("nan")) if tuple(shape) in outputs else out

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned)
        q_MH, scale_MG = rms_norm_quant_fused(x, w, 1e-6, num_rows)
    want_q, want_scale = quant_fp8_act(rms_norm_fused(x, w, 1e-6), num_rows, hidden)
    assert q_MH.shape == want_q.shape and scale_MG.stride() == want_scale.stride() == (1, num_rows)
    assert torch.equal(q_MH.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale_MG, want_scale)
    # and against plain torch: the decoded codes are rms_norm_ref's values to e4m3's rounding (2^-4 of a value,
    # or half its spacing 2^-9 x scale below the normals) plus the norm's last-bit difference (2^-6)
    ref = rms_norm_ref(x, w, 1e-6).float()
    got = dequantize_fp8_act(q_MH[:num_tokens], scale_MG[:num_tokens], torch.float32)
    step = scale_MG[:num_tokens].repeat_interleave(128, dim=1) * 2.0**-9
    assert ((got - ref).abs() <= (2.0**-4 + 2.0**-6) * ref.abs() + step).all()


def test_rms_norm_quant_kernel_bad_inputs():
    x, _, w = residual_case(3, 256, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="H=200 must be a multiple of 128"):
        rms_norm_quant_fused(x[:, :200], w[:200], 1e-5, 3)
    with pytest.raises(ValueError, match="num_rows=2 at least T=3"):
        rms_norm_quant_fused(x, w, 1e-5, 2)
    with pytest.raises(ValueError, match="rms_norm_quant_fused: unsupported call: dtypes"):
        rms_norm_quant_fused(x, w.float(), 1e-5, 3)
    q_MH, scale_MG = rms_norm_quant_fused(x[:0], w, 1e-5, 0)
    assert q_MH.shape == (0, 256) and scale_MG.shape == (0, 2)
