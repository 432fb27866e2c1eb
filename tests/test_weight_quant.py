"""Weight quantisation kernels (mimo_fn.kernels.weight_quant) against their plain-torch twins, bit
for bit: FP8 128x128 blocks and MXFP4, written into strided views of poisoned buffers."""

import pytest
import torch

from mimo_fn.kernels.weight_quant import (quant_fp8_block_into, quant_fp8_block_into_ref, quant_mxfp4_into,
                                          quant_mxfp4_into_ref, quantize_into)
from mimo_fn.quant import FP8_BLOCK, MXFP4, QTensor, dequantize, quantize_fp8_block, quantize_mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU: the Triton interpreter


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _weights(n, k, group_rows, group_cols, dtype, seed):
    """Random weights whose magnitude changes by 2^-40..2^40 from one (group_rows x group_cols)
    tile to the next, with one all-zero tile and a negative zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    tiles = torch.randint(-40, 41, (-(-n // group_rows), -(-k // group_cols)), generator=g).float()
    w = w * torch.exp2(tiles).repeat_interleave(group_rows, 0)[:n].repeat_interleave(group_cols, 1)[:, :k]
    w[:group_rows, group_cols:2 * group_cols] = 0.0
    w[0, 0] = -0.0
    return w.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(256, 384), (200, 300), (128, 128)])
def test_fp8_blocks_match_the_reference_in_a_strided_view(n, k, dtype):
    w = _weights(n, k, 128, 128, dtype, seed=n + k)
    nb, kb = -(-n // 128), -(-k // 128)
    out = []
    for into in (quant_fp8_block_into, quant_fp8_block_into_ref):
        stack = torch.full((3, n + 5, k), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)  # NaN
        scales = torch.full((3, nb + 1, kb), float("nan"), device=DEVICE)
        into(w, stack[1, 5:], scales[1, 1:])
        out.append((stack.view(torch.uint8).clone(), scales.clone()))
    (q, s), (q_ref, s_ref) = out
    assert torch.equal(q, q_ref) and torch.equal(s.nan_to_num(-1), s_ref.nan_to_num(-1))
    assert (q[1, 5:] != 0x7F).any() and (q[0] == 0x7F).all() and (q[1, :5] == 0x7F).all()  # only the view
    assert not s[1, 1:].isnan().any() and s[0].isnan().all()
    want = quantize_fp8_block(w.float())
    assert torch.equal(q[1, 5:].view(torch.float8_e4m3fn).float(), want.data.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(64, 512), (40, 96), (1, 32)])
def test_mxfp4_matches_the_reference_in_a_strided_view(n, k, dtype):
    w = _weights(n, k, 1, 32, dtype, seed=n * k)
    # exact ties between E2M1 magnitudes and groups whose amax / 6 is a power of two
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -3.5, 0.5, 3.0] * 3)[:32]
    w[0, :32] = (ties * 2.0 ** -3).to(dtype)
    if n > 1:
        w[1, :32] = (ties * 2.0 ** 7).to(dtype)
    out = []
    for into in (quant_mxfp4_into, quant_mxfp4_into_ref):
        codes = torch.full((2, n + 3, k // 2 + 4), 0xAB, dtype=torch.uint8, device=DEVICE)
        scales = torch.full((2, n + 3, k // 32 + 1), 0xCD, dtype=torch.uint8, device=DEVICE)
        into(w, codes[1, 3:, 4:], scales[1, 3:, 1:])
        out.append((codes.clone(), scales.clone()))
    (c, s), (c_ref, s_ref) = out
    assert torch.equal(c, c_ref) and torch.equal(s, s_ref)
    assert (c[0] == 0xAB).all() and (c[1, :3] == 0xAB).all() and (c[1, :, :4] == 0xAB).all()
    assert (s[0] == 0xCD).all() and (s[1, :, :1] == 0xCD).all()
    want = quantize_mxfp4(w.float())
    assert torch.equal(c[1, 3:, 4:], want.data) and torch.equal(s[1, 3:, 1:], want.scale)


def test_quantize_into_writes_a_qtensors_buffers():
    w = _weights(256, 256, 128, 128, torch.bfloat16, seed=5)
    for fmt, quantize in ((FP8_BLOCK, quantize_fp8_block), (MXFP4, quantize_mxfp4)):
        want = quantize(w.float())
        dst = QTensor(torch.empty_like(want.data), torch.empty_like(want.scale), fmt)
        ptrs = (dst.data.data_ptr(), dst.scale.data_ptr())
        quantize_into(w, dst)
        assert (dst.data.data_ptr(), dst.scale.data_ptr()) == ptrs
        assert torch.equal(dequantize(dst, torch.float32), dequantize(want, torch.float32))


def test_bad_buffers_are_refused():
    w = torch.randn(128, 256, device=DEVICE)
    q = torch.empty(128, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match=r"scales float32 \[1, 2\]"):
        quant_fp8_block_into(w, q, torch.empty(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"codes uint8 \[128, 128\] and scales uint8 \[128, 8\]"):
        quant_mxfp4_into(w, torch.empty(128, 128, dtype=torch.uint8, device=DEVICE),
                         torch.empty(128, 4, dtype=torch.uint8, device=DEVICE))
