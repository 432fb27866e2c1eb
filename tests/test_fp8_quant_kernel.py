"""The FP8 quant-into-packet kernel against its plain-torch twin, bit for bit.

Legend: T tokens, H hidden, G = ceil(H / 128) groups, R packet bytes per row.

Every q byte and scale must equal the reference, on GPU and on CPU (TRITON_INTERPRET=1,
where `mimo_fn.kernels.cast.cast_rne` makes the fp32 -> e4m3 cast round to nearest even).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first compiled

from mimo_fn.kernels.fp8_quant import (  # noqa: E402
    packet_bytes_per_row,
    quant_fp8_act,
    quant_fp8_act_into,
    quant_fp8_act_into_ref,
    quant_fp8_into_packet,
    quant_fp8_into_packet_ref,
    unpack_packet,
)
from mimo_fn.quant import FP8_DTYPE, quantize_fp8_act_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernel_runs():
    """On CPU the kernel needs the interpreter, which only works if it was on when triton loaded."""
    if DEVICE == "cuda":
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        pytest.fail(
            "triton.language was imported before TRITON_INTERPRET=1 was set (another test module "
            "imported mimo_fn first); set it in tests/conftest.py when CUDA is absent",
            pytrace=False,
        )


def _assert_matches_ref(q_ker, s_ker, q_ref, s_ref):
    """Scales and q bytes bitwise."""
    assert torch.equal(s_ker.view(torch.int32), s_ref.view(torch.int32)), "scales differ"
    diff = q_ref.view(torch.uint8) != q_ker.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} q bytes differ"


def _poisoned_packet(t: int, h: int) -> torch.Tensor:
    return torch.full((t, packet_bytes_per_row(h)), 0xFF, dtype=torch.uint8, device=DEVICE)  # 0xFF: fp8 NaN


def _random(t: int, h: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(t, h, generator=g) * 4).to(dtype).to(DEVICE)


@pytest.mark.parametrize(
    "t,h,dtype",
    [(1, 128, torch.bfloat16), (37, 4096, torch.bfloat16), (64, 1000, torch.float32), (19, 384, torch.float16)],
)
def test_packet_kernel_matches_ref(t, h, dtype, kernel_runs):
    x_TH = _random(t, h, dtype, seed=t * h)
    pk = quant_fp8_into_packet(x_TH, _poisoned_packet(t, h))
    pr = quant_fp8_into_packet_ref(x_TH, _poisoned_packet(t, h))
    q_ker, s_ker = unpack_packet(pk, h)
    q_ref, s_ref = unpack_packet(pr, h)
    _assert_matches_ref(q_ker, s_ker, q_ref, s_ref)
    # and the reference packet is the plain reference quantisation
    q0, s0 = quantize_fp8_act_ref(x_TH)
    assert torch.equal(q_ref.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(s_ref, s0)


def test_zero_groups_and_huge_values(kernel_runs):
    t, h = 24, 1024
    g = torch.Generator(device="cpu").manual_seed(7)
    sign = torch.randint(0, 2, (t, h), generator=g) * 2 - 1
    x = sign * 10 ** (torch.rand(t, h, generator=g, dtype=torch.float64) * 26 + 4)  # 1e4 .. 1e30
    small = torch.rand(t, h, generator=g) < 0.3
    x = torch.where(small, torch.randn(t, h, generator=g, dtype=torch.float64), x)  # subnormal q's
    x[:, 128:256] = 0.0  # an all-zero group in every row
    x[5] = 0.0  # an all-zero token
    x_TH = x.float().to(DEVICE)
    assert torch.isfinite(x_TH).all()
    pk = quant_fp8_into_packet(x_TH, _poisoned_packet(t, h))
    pr = quant_fp8_into_packet_ref(x_TH, _poisoned_packet(t, h))
    q_ker, s_ker = unpack_packet(pk, h)
    q_ref, s_ref = unpack_packet(pr, h)
    _assert_matches_ref(q_ker, s_ker, q_ref, s_ref)
    assert torch.all(s_ref[:, 1] == torch.tensor(1e-10, dtype=torch.float32) / 448)
    assert torch.all(q_ref[:, 128:256].view(torch.uint8) == 0)
    assert torch.isfinite(q_ker.float()).all() and torch.isfinite(s_ker).all()


def test_padded_m_major_output_matches_ref(kernel_runs):
    x_TK = _random(13, 200, torch.bfloat16, seed=3)
    q_ker, s_ker = quant_fp8_act(x_TK, num_rows=16, num_cols=256)
    assert q_ker.shape == (16, 256) and q_ker.is_contiguous()
    assert s_ker.shape == (16, 2) and s_ker.stride() == (1, 16)  # M-major, as scaled_mm reads it
    q_ref = torch.full((16, 256), float("nan"), device=DEVICE).to(FP8_DTYPE)
    s_ref = torch.full((16, 2), float("nan"), device=DEVICE)
    q_ref, s_ref = quant_fp8_act_into_ref(x_TK, q_ref, s_ref)
    _assert_matches_ref(q_ker[:13], s_ker[:13], q_ref[:13], s_ref[:13])
    assert torch.equal(q_ker[13:].view(torch.uint8), q_ref[13:].view(torch.uint8))  # padded rows: zeros
    assert torch.equal(q_ker[:, 200:].view(torch.uint8), torch.zeros_like(q_ker[:, 200:].view(torch.uint8)))
    assert torch.equal(s_ker[13:], s_ref[13:])


def test_into_strided_buffers(kernel_runs):
    x_TK = _random(9, 256, torch.bfloat16, seed=11)
    q_buf = torch.zeros(9, 300, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)[:, :256]  # row stride 300
    s_buf = torch.zeros(9, 5, device=DEVICE)[:, 1:3]
    q_ker, s_ker = quant_fp8_act_into(x_TK, q_buf, s_buf)
    q_ref, s_ref = quantize_fp8_act_ref(x_TK)
    _assert_matches_ref(q_ker, s_ker, q_ref, s_ref)


def test_packet_layout():
    h = 256
    x_TH = _random(3, h, torch.bfloat16, seed=5)
    packet = quant_fp8_into_packet_ref(x_TH, _poisoned_packet(3, h))
    q_TH, s_TG = unpack_packet(packet, h)
    assert packet_bytes_per_row(h) == h + 4 * 2
    assert q_TH.data_ptr() == packet.data_ptr() and s_TG.data_ptr() == packet.data_ptr() + h  # views, no copies
    q_ref, s_ref = quantize_fp8_act_ref(x_TH)
    assert torch.equal(packet[:, :h], q_ref.view(torch.uint8))
    # scale g of row t sits at bytes h + 4g .. h + 4g + 3, little-endian fp32
    raw = packet[1, h + 4 : h + 8].cpu().numpy().tobytes()
    assert int.from_bytes(raw, "little") == s_ref[1, 1].view(torch.int32).item() & 0xFFFFFFFF


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 4"):
        packet_bytes_per_row(130)
    x_TH = _random(4, 256, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="uint8"):
        quant_fp8_into_packet_ref(x_TH, _poisoned_packet(4, 256).float())
    with pytest.raises(ValueError, match="bytes"):
        unpack_packet(_poisoned_packet(4, 512), 256)
