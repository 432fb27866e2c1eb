"""FP8 block formats: round-trip error bounds, layouts, edge values, pytree behaviour.

Legend: E experts, N / K weight dims, T tokens, G = ceil(K / 128).
"""

import pytest
import torch
from torch.utils import _pytree as pytree

from mimo_fn.quant import (
    FP8_BLOCK,
    FP8_DTYPE,
    QTensor,
    dequantize,
    dequantize_fp8_act,
    quantize_fp8_act_ref,
    quantize_fp8_block,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2**-4 relative of any value
# that quantises to a normal number; values below the block's amax * 2**-6 / 448 land
# in the subnormal range, where the error is absolute: at most half of 2**-9 * scale.
REL = 2.0**-4


def _bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    return REL * x.abs() + 2.0**-10 * scale_full


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 64, 300)])
def test_block_round_trip(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 10
    q = quantize_fp8_block(w)
    *lead, n, k = shape
    assert q.fmt == FP8_BLOCK and q.data.dtype == FP8_DTYPE and q.scale.dtype == torch.float32
    assert q.data.shape == w.shape and q.scale.shape == (*lead, -(-n // 128), -(-k // 128))
    # scale is the block amax / 448, computed on the block (partial blocks only see real entries)
    blk = w[..., :128, :128].abs().amax(dim=(-2, -1))
    assert torch.equal(q.scale[..., 0, 0], blk / 448)
    w2 = dequantize(q, torch.float32)
    scale_full = q.scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    assert torch.all((w2 - w).abs() <= _bound(w, scale_full))
    # each block uses the full e4m3 range: its amax element lands on +-448
    assert q.data[..., :128, :128].float().abs().amax(dim=(-2, -1)).eq(448).all()


def test_block_expert_stack_equals_per_matrix():
    w_ENK = torch.randn(4, 130, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = quantize_fp8_block(w_ENK)
    for e in range(4):
        qe = quantize_fp8_block(w_ENK[e])
        assert torch.equal(q.data[e].view(torch.uint8), qe.data.view(torch.uint8))
        assert torch.equal(q.scale[e], qe.scale)
    assert dequantize(q).dtype == torch.bfloat16


def test_zero_and_huge_blocks():
    w = torch.zeros(256, 256)
    w[128:, 128:] = 1e30
    w[130, 140] = -3e29
    q = quantize_fp8_block(w)
    assert torch.all(q.scale[0, 0] == torch.tensor(1e-10) / 448)  # all-zero block: finite scale, q = 0
    assert torch.all(q.data[:128, :128].view(torch.uint8) == 0)
    w2 = dequantize(q, torch.float32)
    assert torch.isfinite(w2).all()
    assert torch.allclose(w2, w, rtol=REL, atol=0)


def test_act_round_trip_and_layout():
    g = torch.Generator().manual_seed(2)
    x_TK = (torch.randn(33, 300, generator=g) * 5).to(torch.bfloat16)
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    assert q_TK.shape == (33, 300) and s_TG.shape == (33, 3)
    assert torch.equal(s_TG[:, 2], x_TK[:, 256:].float().abs().amax(-1) / 448)  # partial last group
    x2 = dequantize_fp8_act(q_TK, s_TG, torch.float32)
    s_full = s_TG.repeat_interleave(128, -1)[:, :300]
    assert torch.all((x2 - x_TK.float()).abs() <= _bound(x_TK.float(), s_full))
    # M-major scales (the layout the gather returns) dequantise identically
    s_mmajor = s_TG.t().contiguous().t()
    assert torch.equal(dequantize_fp8_act(q_TK, s_mmajor, torch.float32), x2)
    # the weight format with a single token row is the activation format with 128-row blocks
    assert torch.equal(quantize_fp8_block(x_TK[:1]).scale, s_TG[:1])


def test_act_zero_token_and_tiny_values():
    x_TK = torch.zeros(2, 128)
    x_TK[1, 0] = 1e-12  # below the 1e-10 floor: scale is the floor, q = 1e-12 / (1e-10 / 448)
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    assert torch.all(q_TK[0].view(torch.uint8) == 0)
    floor = torch.tensor(1e-10) / 448
    assert torch.equal(s_TG[:, 0], torch.stack([floor, floor]))
    assert q_TK[1, 0].float().item() == pytest.approx(4.5, abs=0.25)


def test_qtensor_tree_map():
    q = quantize_fp8_block(torch.randn(256, 128))
    q2 = pytree.tree_map(lambda t: t.view(torch.uint8) if t.dtype == FP8_DTYPE else t * 2, q)
    assert isinstance(q2, QTensor) and q2.fmt == FP8_BLOCK
    assert q2.data.dtype == torch.uint8 and torch.equal(q2.scale, q.scale * 2)
    leaves, spec = pytree.tree_flatten({"w": q, "b": torch.ones(3)})
    assert len(leaves) == 3
    back = pytree.tree_unflatten(leaves, spec)
    assert back["w"].data is q.data and back["w"].fmt == FP8_BLOCK


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_block(torch.randn(128, 128), block=64)
    q = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(QTensor(q.data, q.scale[:1], FP8_BLOCK))
    with pytest.raises(ValueError, match="format"):
        dequantize(QTensor(q.data, q.scale, "mxfp4"))
    with pytest.raises(ValueError, match="group"):
        quantize_fp8_act_ref(torch.randn(4, 256), group=32)
