"""Router logits: the CUDA path (one 16-bit GEMM with fp32 output) against transformers' fp32 one."""

import pytest
import torch

from mimo_fn.layers.router import router_logits


def test_router_logits_cpu_is_the_fp32_product():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(16, 64, generator=gen).bfloat16()
    assert torch.equal(router_logits(x, w), x.float() @ w.float().T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 16-bit GEMM path is CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_cuda_matches_fp32(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 4096, generator=gen).to(dtype).cuda()
    w = (torch.randn(256, 4096, generator=gen) / 64).to(dtype).cuda()
    out = router_logits(x, w)
    ref = (x.double() @ w.double().T)  # exact products, summed in float64
    assert out.dtype == torch.float32
    err = (out.double() - ref).abs()
    # fp32 sums of 4096 exact products, accumulated in tiles: errors of order 2^-22 of the sum
    # of magnitudes; 2^-18 leaves room and still fails a bf16-rounded result (~2^-15 of it)
    bound = 2.0**-18 * (x.double().abs() @ w.double().abs().T)
    assert (err <= bound).all(), (err / bound).max().item()
    fp32 = x.float() @ w.float().T
    assert ((fp32.double() - ref).abs() <= bound).all()  # the same bound holds for transformers' path
