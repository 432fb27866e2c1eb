"""All-gather of FP8-quantised activations: one packed collective instead of two.

Legend: W ranks in the group, T tokens per rank, H hidden, G = ceil(H / 128) groups
per token, R = packet bytes per row, M = W * T gathered tokens.

Packet row layout (one uint8 row per token; kernels/fp8_quant.py writes it):

    byte 0 .. H-1        H float8_e4m3fn values of the token (1x128 group quantisation)
    byte H .. H+4G-1     G float32 group scales, bit-viewed as 4 little-endian bytes each

R = H + 4G (4224 for H = 4096: 3% over the FP8 payload, half of bf16's 8192). H must
be a multiple of 4 so the scales stay 4-byte aligned and unpack to views.

Why pack: DP attention all-gathers each layer's normed activations inside the TP group
right before the QKV GEMM. FP8 halves the bytes on the wire, but quantising separately
would take two collectives (q and scales), and the small scale gather pays a full
collective latency. The quant kernel writes q and scales straight into one buffer, one
all_gather moves it, and afterwards the scales are transposed once into the M-major
layout block-scaled scaled_mm reads (`mimo_fn.layers.linear.linear_fp8`).

Every rank must pass the same T (the DP-attention token split pads to equal T). All
three variants return the same gathered tokens; the two FP8 ones agree bit for bit.
"""

import torch
import torch.distributed as dist

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.fp8_quant import (  # no Triton work at import time: kernels launch only on CUDA
    packet_bytes_per_row,
    quant_fp8_act_into,
    quant_fp8_act_into_ref,
    quant_fp8_into_packet,
    quant_fp8_into_packet_ref,
    unpack_packet,
)
from mimo_fn.quant import BLOCK, FP8_DTYPE

ProcessGroup = dist.ProcessGroup


def _gather_rows(buf_TX: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[T, X] per rank -> [W*T, X], rank-major, in ONE collective."""
    world = dist.get_world_size(group)
    out_MX = torch.empty((world * buf_TX.shape[0], *buf_TX.shape[1:]), dtype=buf_TX.dtype, device=buf_TX.device)
    if dist.get_backend(group) == "gloo":
        # gloo may lack all_gather_into_tensor; gathering into row-block views of the
        # output needs no concatenation afterwards
        dist.all_gather(list(out_MX.chunk(world)), buf_TX, group=group)
    else:
        dist.all_gather_into_tensor(out_MX, buf_TX, group=group)
    return out_MX


def _m_major(scale_MG: torch.Tensor) -> torch.Tensor:
    """[M, G] -> same values with strides (1, M): the activation-scale layout of block-scaled scaled_mm."""
    return scale_MG.t().contiguous().t()


def _use_kernel(x_TH: torch.Tensor, use_kernel: bool | None) -> bool:
    return x_TH.is_cuda if use_kernel is None else use_kernel


@typed
def all_gather_packed_fp8(
    x_TH: Float[Tensor, "T H"], group: ProcessGroup | None = None, use_kernel: bool | None = None
) -> tuple[Float[Tensor, "M H"], Float[Tensor, "M G"]]:
    """Quantise into one packet, ONE all_gather, unpack.

    Returns q [W*T, H] fp8 (a view with row stride R into the gathered packets) and the
    scales [W*T, G] fp32 in M-major layout (strides (1, W*T)). `use_kernel`: Triton
    quantiser (default on CUDA) or the plain-torch reference (default elsewhere).
    """
    t, h = x_TH.shape
    packet_TR = torch.empty(t, packet_bytes_per_row(h), dtype=torch.uint8, device=x_TH.device)
    quant = quant_fp8_into_packet if _use_kernel(x_TH, use_kernel) else quant_fp8_into_packet_ref
    packet_TR = quant(x_TH, packet_TR)
    packets_MR = _gather_rows(packet_TR, group)
    q_MH, scale_MG = unpack_packet(packets_MR, h)
    return q_MH, _m_major(scale_MG)


@typed
def all_gather_fp8_two_collectives(
    x_TH: Float[Tensor, "T H"], group: ProcessGroup | None = None, use_kernel: bool | None = None
) -> tuple[Float[Tensor, "M H"], Float[Tensor, "M G"]]:
    """Baseline: quantise into separate q / scale buffers, gather each. Same outputs as packed."""
    t, h = x_TH.shape
    q_TH = torch.empty(t, h, dtype=FP8_DTYPE, device=x_TH.device)
    scale_TG = torch.empty(t, -(-h // BLOCK), dtype=torch.float32, device=x_TH.device)
    quant = quant_fp8_act_into if _use_kernel(x_TH, use_kernel) else quant_fp8_act_into_ref
    q_TH, scale_TG = quant(x_TH.contiguous(), q_TH, scale_TG)
    # fp8 travels as bytes: not every backend / version reduces or even accepts fp8 dtypes
    q_MH = _gather_rows(q_TH.view(torch.uint8), group).view(FP8_DTYPE)
    scale_MG = _gather_rows(scale_TG, group)
    return q_MH, _m_major(scale_MG)


@typed
def all_gather_bf16(x_TH: Float[Tensor, "T H"], group: ProcessGroup | None = None) -> Float[Tensor, "M H"]:
    """Baseline without quantisation: gather the activations as they are (bf16: 2 bytes / value)."""
    return _gather_rows(x_TH.contiguous(), group)
