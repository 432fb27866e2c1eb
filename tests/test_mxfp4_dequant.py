"""The bulk MXFP4 dequantisation (mimo_fn.kernels.moe.mxfp4_dequant) against its reference, and
fused_moe_mxfp4's dequantised-copy path against its reference and the in-GEMM path."""

import pytest
import torch

from test_moe_kernels import (  # first: sets TRITON_INTERPRET
    DEV, ROUTINGS, make_routing, poisoned, rel_err, seed, set_options)
from test_moe_mxfp4 import DIMS, FAST, _fast, make_weights
from mimo_fn.kernels.moe import mxfp4 as moe_mxfp4
from mimo_fn.kernels.moe.dispatch import fused_moe_mxfp4
from mimo_fn.kernels.moe.mxfp4_dequant import dequant_mxfp4, dequant_mxfp4_ref
from mimo_fn.kernels.moe.ref import fused_moe_mxfp4_ref
from mimo_fn.quant import MXFP4, QTensor, quantize_fp8_block

# NaN / inf weights on purpose (E8M0 255; code 7 at exponent 254), as in test_moe_mxfp4
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),  # fp16: inf
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")]


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    set_options(monkeypatch, moe_autotune=False)


@pytest.mark.parametrize("dtype, fast", [(d, f) for d in (torch.float32, torch.bfloat16, torch.float16)
                                         for f in FAST if d == torch.bfloat16 or not f])  # PTX: bf16 only
@pytest.mark.parametrize("shape", [(3, 40, 96), (21, 1056)])  # a partial row block; a partial column block
def test_every_code_and_scale_equals_the_ref(shape, dtype, fast, monkeypatch):
    # Every byte value and every E8M0 exponent (255 NaN, 254 with code 7 inf): the copy equals
    # the reference bit for bit. Exponents 0 and 1 give subnormal weights, which the GPU and the
    # interpreter's bf16 casts may flush: in fp32 in the interpreter only, as in test_moe_mxfp4.
    _fast(monkeypatch, fast)
    *lead, k = shape
    gen = torch.Generator().manual_seed(seed("mxfp4 dequant", shape, str(dtype)))
    data = torch.randint(0, 256, (*lead, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    lowest = 0 if DEV == "cpu" and dtype == torch.float32 else 2
    scale = torch.randint(lowest, 256, (*lead, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale.view(-1)[: 256 - lowest] = torch.arange(lowest, 256, dtype=torch.uint8)[: scale.numel()]
    q = QTensor(data.to(DEV), scale.to(DEV), MXFP4)
    with poisoned():
        out = dequant_mxfp4(q, dtype)
    assert out.dtype == dtype and out.shape == (*lead, k)
    torch.testing.assert_close(out.cpu(), dequant_mxfp4_ref(q, dtype).cpu(), rtol=0, atol=0, equal_nan=True)


def test_bad_arguments():
    q = QTensor(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), MXFP4)
    for fn in (dequant_mxfp4, dequant_mxfp4_ref):
        with pytest.raises(ValueError, match="dtype torch.int32; expected bf16, fp16 or fp32"):
            fn(q, torch.int32)
    with pytest.raises(ValueError, match="format 'fp8_block'; expected 'mxfp4'"):
        dequant_mxfp4(quantize_fp8_block(torch.randn(4, 32)), torch.float32)
    with pytest.raises(ValueError, match="scales"):
        dequant_mxfp4(QTensor(q.data, torch.zeros(4, 2, dtype=torch.uint8), MXFP4))


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_path_matches_ref_and_the_in_gemm_path(kind, dtype):
    t, h, i, e, k = DIMS
    gen = torch.Generator().manual_seed(seed("mxfp4 dequantized path", kind, str(dtype)))
    w13, w2 = make_weights(e, h, i, gen)
    x_TH = torch.randn(t, h, generator=gen).to(DEV, dtype)
    ids_TK, weights_TK = make_routing(kind, t, k, e, gen)
    with poisoned():
        out_TH = fused_moe_mxfp4(x_TH, w13, w2, ids_TK, weights_TK, dequantize=True)
        in_gemm_TH = fused_moe_mxfp4(x_TH, w13, w2, ids_TK, weights_TK, dequantize=False)
    assert out_TH.dtype == dtype and out_TH.shape == (t, h)
    ref_TH = fused_moe_mxfp4_ref(x_TH.float(), w13, w2, ids_TK, weights_TK)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out_TH, ref_TH) <= tol and rel_err(out_TH, in_gemm_TH) <= tol
    if kind == "sparse":
        assert bool((out_TH[t // 2] == 0).all())  # the token routed nowhere


def test_the_path_is_chosen_by_pairs_per_expert(monkeypatch):
    m = moe_mxfp4.DEQUANT_MIN_PAIRS
    set_options(monkeypatch, mxfp4_dequant=None)
    assert moe_mxfp4.dequantize_first(m, on_cuda=True) and not moe_mxfp4.dequantize_first(m - 1, on_cuda=True)
    assert not moe_mxfp4.dequantize_first(10 * m, on_cuda=False)  # the interpreter: the in-GEMM path
    set_options(monkeypatch, mxfp4_dequant=True)
    assert moe_mxfp4.dequantize_first(1, on_cuda=False)
    set_options(monkeypatch, mxfp4_dequant=False)
    assert not moe_mxfp4.dequantize_first(10 * m, on_cuda=True)

