"""The one-pass RMSNorm kernel against `mimo_fn.layers.norm.rms_norm_ref`.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn.kernels.rmsnorm import rms_norm_fused, unsupported_reason  # noqa: E402
from mimo_fn.layers.norm import rms_norm, rms_norm_ref  # noqa: E402

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
