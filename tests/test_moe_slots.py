"""The MoE input quantised into slot order (mimo_fn.kernels.moe.slots.quant_fp8_slots), against the plain-torch
quantiser and gather (quantize_fp8_act_ref, then slots.gather_slots_ref), bit for bit: in the
interpreter on a CPU machine, compiled on a GPU one. Outputs poisoned first (unwritten rows show)."""

import pytest
import torch
from test_moe_up_ws import DEV, _poisoned, _routing

from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe.align import moe_align, moe_align_ref
from mimo_fn.kernels.moe.slots import gather_slots, quant_fp8_slots, quant_fp8_slots_ref


def _x(t: int, hid: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Rows of very different magnitudes, so each has scales of its own."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, hid, generator=g) * (torch.rand(t, 1, generator=g) * 4 + 0.1)).to(dtype)


@pytest.mark.parametrize("kind,t,e,k,block_m,dtype", [
    ("balanced", 37, 8, 2, 16, torch.bfloat16),
    ("skewed", 29, 6, 4, 128, torch.bfloat16),
    ("skewed", 11, 5, 2, 16, torch.float32),
])
def test_matches_quantise_then_gather(kind, t, e, k, block_m, dtype, monkeypatch):
    """Every used slot holds its token's codes and scales as quantising token-major and gathering would
    give, padding slots zero codes and scale 0 (written, not left poisoned); dropped pairs (-1 ids) get
    no slot; the scales are M-major."""
    g = torch.Generator().manual_seed(7)
    ids_TK = _routing(kind, t, e, k, g)
    ids_TK[0, -1] = -1  # at least one dropped pair
    ids_TK = ids_TK.to(DEV)
    x_TH = _x(t, 256, seed=t, dtype=dtype).to(DEV)
    al = moe_align(ids_TK, e, block_m) if DEV == "cuda" else moe_align_ref(ids_TK, e, block_m)
    with _poisoned(monkeypatch):
        x_MH, xs_MHb = quant_fp8_slots(x_TH, al, k)
    ref_x, ref_s = quant_fp8_slots_ref(x_TH.cpu(), moe_align_ref(ids_TK.cpu(), e, block_m), k)
    used = int(al.num_tokens_post_pad_1)
    assert xs_MHb.stride(0) == 1  # [Hb, M] storage: the GEMM loads consecutive slots' scales
    assert torch.equal(x_MH[:used].view(torch.uint8).cpu(), ref_x[:used].view(torch.uint8))
    assert torch.equal(xs_MHb[:used].cpu(), ref_s[:used])
    pad = al.sorted_ids_M[:used] >= al.num_pairs
    assert pad.any() and (ids_TK < 0).any()
    assert (xs_MHb[:used][pad] == 0).all() and (x_MH[:used][pad].view(torch.uint8) == 0).all()


def test_same_bits_as_the_triton_quantiser_and_gather(monkeypatch):
    """The kernels against the path they replace (fp8_quant.quant_fp8_act, then gather_slots)."""
    g = torch.Generator().manual_seed(3)
    ids_TK = _routing("skewed", 23, 6, 2, g).to(DEV)
    x_TH = _x(23, 384, seed=5).to(DEV)
    al = moe_align(ids_TK, 6, 16) if DEV == "cuda" else moe_align_ref(ids_TK, 6, 16)
    x_MH, xs_MHb = quant_fp8_slots(x_TH, al, 2)
    gx_MH, gxs_MHb = gather_slots(*quant_fp8_act(x_TH), al, 2)
    used = int(al.num_tokens_post_pad_1)
    assert torch.equal(x_MH[:used].view(torch.uint8), gx_MH[:used].view(torch.uint8))
    assert torch.equal(xs_MHb[:used], gxs_MHb[:used])


def test_bad_inputs_raise():
    ids_TK = torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    al = moe_align_ref(ids_TK, 3, 16)
    x_TH = torch.randn(3, 256).bfloat16()
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        quant_fp8_slots(x_TH.to(torch.float64), al, 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        quant_fp8_slots(x_TH[:, :200], al, 2)
    with pytest.raises(ValueError, match="the alignment has 6"):
        quant_fp8_slots(x_TH[:2], al, 2)
