"""FP8 block and MXFP4 formats: round-trip error bounds, layouts, edge values, pytree behaviour.

Legend: E experts, N / K weight dims, T tokens, G = ceil(K / 128), Gm = K / 32 MXFP4 groups.
"""

import pytest
import torch
from torch.utils import _pytree as pytree

import mimo_fn as mf

from mimo_fn.quant import (
    E2M1_VALUES,
    FP8_BLOCK,
    FP8_DTYPE,
    MXFP4,
    QTensor,
    dequantize,
    dequantize_fp8_act,
    quantize_fp8_act_ref,
    quantize_fp8_block,
    quantize_mxfp4,
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
        dequantize(QTensor(q.data, q.scale, "int4"))
    with pytest.raises(ValueError, match="group"):
        quantize_fp8_act_ref(torch.randn(4, 256), group=32)


def _mx_values(e2m1_codes: list[int], exp: int) -> list[float]:
    return [(-1.0 if c & 8 else 1.0) * E2M1_VALUES[c & 7] * 2.0**exp for c in e2m1_codes]


def test_mxfp4_layout_and_known_codes():
    # every code but 8 (-0, which quantises as +0) in a 32-value group, scale 2^-3: bytes hold
    # elements (2j, 2j+1) in their (low, high) nibbles
    codes = [c for c in range(16) if c != 8] * 2 + [6, 7]
    w = torch.tensor([_mx_values(codes, -3)])
    q = quantize_mxfp4(w)
    assert q.fmt == MXFP4 and q.data.dtype == torch.uint8 and q.shape == (1, 32)
    assert q.scale.tolist() == [[127 - 3]]
    assert q.data[0].tolist() == [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    assert torch.equal(dequantize(q, torch.float32), w)


def _nearest_e2m1(r: float) -> float:
    """Independent rounding: the nearest E2M1 magnitude, ties to the even code."""
    mags = sorted(set(E2M1_VALUES))
    best = min(range(8), key=lambda c: (abs(abs(r) - mags[c]), c % 2))
    return (-1.0 if r < 0 else 1.0) * mags[best]


@pytest.mark.parametrize("shape", [(8, 64), (2, 5, 96)])
def test_mxfp4_round_trip_matches_nearest_rounding(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.exp2(torch.randint(-6, 6, shape).float())
    q = quantize_mxfp4(w)
    *lead, n, k = shape
    assert tuple(q.data.shape) == (*lead, n, k // 2) and tuple(q.scale.shape) == (*lead, n, k // 32)
    scale = torch.exp2(q.scale.float() - 127).repeat_interleave(32, dim=-1)
    amax = w.abs().reshape(*lead, n, k // 32, 32).amax(-1).repeat_interleave(32, dim=-1)
    assert ((amax / scale <= 6) & (amax / scale > 3)).all()  # the smallest power of two that fits
    want = torch.tensor([_nearest_e2m1(r) for r in (w / scale).flatten().tolist()]).view(shape) * scale
    assert torch.equal(dequantize(q, torch.float32), want)
    d = dequantize(q, torch.float32)
    assert torch.equal(dequantize(quantize_mxfp4(d), torch.float32), d)  # representable values stay
    assert torch.equal(dequantize(q, torch.bfloat16).float(), d)  # exact in bf16


def test_mxfp4_ties_zero_groups_and_nan_scale():
    # ties between neighbours go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 2.5 -> 2, 5 -> 4
    w = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24, [0.0] * 32])
    d = dequantize(quantize_mxfp4(w), torch.float32)
    assert d[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert d[1].abs().max() == 0 and quantize_mxfp4(w).scale[1, 0] == 0
    q = quantize_mxfp4(w)
    assert dequantize(QTensor(q.data, torch.full_like(q.scale, 255), MXFP4), torch.float32).isnan().all()


def test_mxfp4_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple"):
        quantize_mxfp4(torch.randn(4, 48))
    q = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scales"):
        dequantize(QTensor(q.data, q.scale[:, :1], MXFP4))
    with pytest.raises(ValueError, match="uint8"):
        dequantize(QTensor(q.data.to(torch.int16), q.scale, MXFP4))


@pytest.mark.parametrize("experts", ["fp8", "mxfp4"])
def test_init_params_quantised_as_drawn_equals_quantize_params(experts):
    """init_params(quantize=...) (a dummy server's weights, quantised one tensor at a time) holds
    the same bytes as quantize_params of the full-precision draw."""
    from mimo_fn.params import quantize_params, to_flat

    cfg = mf.ModelConfig.tiny()
    drawn = to_flat(mf.init_params(cfg, seed=3, dtype=torch.bfloat16, quantize=experts))
    want = to_flat(quantize_params(cfg, mf.init_params(cfg, seed=3, dtype=torch.bfloat16), experts=experts))
    assert drawn.keys() == want.keys()
    assert any(isinstance(v, QTensor) for v in drawn.values())
    for k, v in drawn.items():
        w = want[k]
        assert type(v) is type(w), k
        if isinstance(v, QTensor):
            assert v.fmt == w.fmt and torch.equal(v.data.view(torch.uint8), w.data.view(torch.uint8)), k
            assert torch.equal(v.scale.view(torch.uint8), w.scale.view(torch.uint8)), k
        else:
            assert torch.equal(v, w), k
    with pytest.raises(ValueError, match="quantize = 'int4'"):
        mf.init_params(cfg, quantize="int4")
