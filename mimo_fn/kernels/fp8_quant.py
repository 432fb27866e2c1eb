"""FP8 activation quantisation (per-token 1x128 groups), written straight into its consumer's buffer.

Legend: T tokens (rows), H hidden (= K, the GEMM's reduction dim), G = ceil(H / 128)
groups per row, R = packet bytes per row.

One kernel, `quant_fp8_act_into`, reads x [T, H] (bf16 / fp16 / fp32) and writes the
FP8 bytes and the fp32 group scales into two caller-given buffers of arbitrary row /
group strides. Two layouts use it:

* The all-gather packet (parallel/packed_fp8.py): ONE uint8 buffer [T, R] per rank,
  each token row laid out as

      byte 0 .. H-1          H float8_e4m3fn values (the token's q)
      byte H .. H+4G-1       G float32 scales, bit-viewed as 4 little-endian bytes each

  so R = H + 4 * G. H must be a multiple of 4, which keeps every fp32 scale 4-byte
  aligned (R is then a multiple of 4 too) and lets `unpack_packet` return views.
* The GEMM layout (`quant_fp8_act`): q [T', K'] contiguous and the scales M-major,
  i.e. a [G', T'] buffer viewed as [T', G'] with strides (1, T'), which is what
  torch's block-wise scaled_mm reads for 1x128 activation scales. T' >= T and K' >= H
  pad the output: padded rows / columns get q = 0 and scale 1e-10 / 448, exactly what
  quantising zero-padded x would give.

Numerics are `mimo_fn.quant.quantize_fp8_act_ref` bit for bit, on the GPU and in Triton's
CPU interpreter: the divisions use `tl.math.div_rn` (IEEE round-to-nearest; Triton's `/` on
fp32 is an approximate division on NVIDIA GPUs) and fp32 -> e4m3 rounds to nearest even
after the clamp (`mimo_fn.kernels.cast.cast_rne`, which also fixes the interpreter's cast).
"""

import functools

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Shaped, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.quant import BLOCK, FP8_DTYPE, FP8_MAX, SCALE_FLOOR, quantize_fp8_act_ref

_BLOCK_T = 32  # rows per program: 32 x 128 bf16 = 8 KiB in flight per program


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def quant_groups(x, FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 rows x [R, 128], one 1x128 group each -> (e4m3 codes as uint8 [R, 128], scales [R]):
    quantize_fp8_act_ref's arithmetic (the module docstring). Also slots.py's quantiser."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR_C), FP8_MAX_C)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
    return cast_rne(y, tl.float8e4nv, INTERPRET).to(tl.uint8, bitcast=True), scale


def _quant_fp8_kernel(
    x_ptr, stride_xt,  # [T_in, K_in], unit stride along K
    q_ptr, stride_qt,  # uint8 bytes of the fp8 output, unit stride along K
    s_ptr, stride_st, stride_sg,  # fp32 scales, any strides
    T_in, K_in,  # valid input extent
    T_out, K_out,  # written extent (>= input: the rest is zero padding)
    FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = g * GROUP + tl.arange(0, GROUP)
    rows64 = rows.to(tl.int64)  # T * R exceeds 2**31 for long gathered prefill batches
    in_mask = (rows[:, None] < T_in) & (cols[None, :] < K_in)
    x = tl.load(x_ptr + rows64[:, None] * stride_xt + cols[None, :], mask=in_mask, other=0.0)
    q, scale = quant_groups(x.to(tl.float32), FP8_MAX_C, FLOOR_C, INTERPRET)
    out_mask = (rows[:, None] < T_out) & (cols[None, :] < K_out)
    tl.store(q_ptr + rows64[:, None] * stride_qt + cols[None, :], q, mask=out_mask)
    tl.store(s_ptr + rows64 * stride_st + g * stride_sg, scale, mask=rows < T_out)


@functools.cache
def _compiled_kernel():
    # triton.jit reads TRITON_INTERPRET when it decorates: doing it at the first launch,
    # not at import, lets a CPU test set the variable after mimo_fn was imported
    return triton.jit(_quant_fp8_kernel)


def _check_into(x_TK: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    t, k = x_TK.shape
    t_out, k_out = q_out.shape
    if q_out.dtype != FP8_DTYPE:
        raise ValueError(f"quant_fp8_act_into: q_out must be {FP8_DTYPE}, got {q_out.dtype}")
    if scale_out.dtype != torch.float32:
        raise ValueError(f"quant_fp8_act_into: scale_out must be float32, got {scale_out.dtype}")
    if t_out < t or k_out < k:
        raise ValueError(f"quant_fp8_act_into: q_out {tuple(q_out.shape)} is smaller than x {tuple(x_TK.shape)}")
    if tuple(scale_out.shape) != (t_out, _cdiv(k_out, BLOCK)):
        raise ValueError(
            f"quant_fp8_act_into: scale_out shape {tuple(scale_out.shape)}, expected {(t_out, _cdiv(k_out, BLOCK))}"
        )
    if x_TK.stride(-1) != 1 or q_out.stride(-1) != 1:
        raise ValueError(
            f"quant_fp8_act_into: x and q_out need unit stride along K, got {x_TK.stride()} and {q_out.stride()}"
        )


@typed
def quant_fp8_act_into(
    x_TK: Float[Tensor, "T K"], q_out: Float[Tensor, "Tp Kp"], scale_out: Float[Tensor, "Tp Gp"]
) -> tuple[Float[Tensor, "Tp Kp"], Float[Tensor, "Tp Gp"]]:
    """Triton: quantise x into q_out / scale_out (donated: written in place and returned)."""
    _check_into(x_TK, q_out, scale_out)
    t, k = x_TK.shape
    t_out, k_out = q_out.shape
    if t_out == 0 or k_out == 0:
        return q_out, scale_out
    grid = (_cdiv(t_out, _BLOCK_T), _cdiv(k_out, BLOCK))
    _compiled_kernel()[grid](
        x_TK, x_TK.stride(0),
        q_out.view(torch.uint8), q_out.stride(0),
        scale_out, scale_out.stride(0), scale_out.stride(1),
        t, k, t_out, k_out,
        FP8_MAX_C=FP8_MAX, FLOOR_C=SCALE_FLOOR, GROUP=BLOCK, BLOCK_T=_BLOCK_T, INTERPRET=not x_TK.is_cuda,
        num_warps=4,
    )
    return q_out, scale_out


@typed
def quant_fp8_act_into_ref(
    x_TK: Float[Tensor, "T K"], q_out: Float[Tensor, "Tp Kp"], scale_out: Float[Tensor, "Tp Gp"]
) -> tuple[Float[Tensor, "Tp Kp"], Float[Tensor, "Tp Gp"]]:
    """Plain torch twin of `quant_fp8_act_into`: quantise zero-padded x, copy into the buffers."""
    _check_into(x_TK, q_out, scale_out)
    t, k = x_TK.shape
    t_out, k_out = q_out.shape
    x_pad = torch.nn.functional.pad(x_TK, (0, k_out - k, 0, t_out - t))
    q, scale = quantize_fp8_act_ref(x_pad)
    q_out.copy_(q)
    scale_out.copy_(scale)
    return q_out, scale_out


@typed
def quant_fp8_act(
    x_TK: Float[Tensor, "T K"], num_rows: int | None = None, num_cols: int | None = None
) -> tuple[Float[Tensor, "Tp Kp"], Float[Tensor, "Tp Gp"]]:
    """Triton: x -> (q [Tp, Kp] fp8 contiguous, scale [Tp, Gp] fp32 M-major), the scaled_mm layout.

    num_rows / num_cols (default T / K) pad the result with zero rows / columns for GEMMs
    that need aligned extents; no extra pass over x is made for the padding.
    """
    t, k = x_TK.shape
    t_out = t if num_rows is None else num_rows
    k_out = k if num_cols is None else num_cols
    q_out = torch.empty(t_out, k_out, dtype=FP8_DTYPE, device=x_TK.device)
    scale_GT = torch.empty(_cdiv(k_out, BLOCK), t_out, dtype=torch.float32, device=x_TK.device)
    return quant_fp8_act_into(x_TK.contiguous(), q_out, scale_GT.t())


def packet_bytes_per_row(hidden: int) -> int:
    """R = H fp8 bytes + 4 bytes per 1x128 group scale (see the layout in the module docstring)."""
    if hidden <= 0 or hidden % 4 != 0:
        raise ValueError(f"packet_bytes_per_row: hidden must be a positive multiple of 4, got {hidden}")
    return hidden + 4 * _cdiv(hidden, BLOCK)


@typed
def unpack_packet(
    packet_TR: Shaped[Tensor, "T R"], hidden: int
) -> tuple[Float[Tensor, "T H"], Float[Tensor, "T G"]]:
    """Views (no copies) of a packet buffer: q [T, H] fp8 (row stride R) and scale [T, G] fp32."""
    if packet_TR.dtype != torch.uint8:
        raise ValueError(f"unpack_packet: packet must be uint8, got {packet_TR.dtype}")
    r = packet_bytes_per_row(hidden)
    if packet_TR.shape[1] != r:
        raise ValueError(f"unpack_packet: packet rows are {packet_TR.shape[1]} bytes, hidden={hidden} needs {r}")
    if packet_TR.stride(1) != 1 or packet_TR.shape[0] > 1 and packet_TR.stride(0) % 4 != 0:
        raise ValueError(f"unpack_packet: packet rows must be dense and 4-byte aligned, got strides {packet_TR.stride()}")
    q_TH = packet_TR[:, :hidden].view(FP8_DTYPE)
    scale_TG = packet_TR[:, hidden:].view(torch.float32)  # 4-byte aligned: hidden % 4 == 0
    return q_TH, scale_TG


def _check_packet(x_TH: torch.Tensor, packet_TR: torch.Tensor) -> None:
    t, h = x_TH.shape
    if packet_TR.shape[0] != t:
        raise ValueError(f"quant_fp8_into_packet: packet has {packet_TR.shape[0]} rows, x has {t} tokens")


@typed
def quant_fp8_into_packet(x_TH: Float[Tensor, "T H"], packet_TR: Shaped[Tensor, "T R"]) -> Shaped[Tensor, "T R"]:
    """Triton: quantise x per 1x128 group into the packet rows (donated, returned)."""
    _check_packet(x_TH, packet_TR)
    q_TH, scale_TG = unpack_packet(packet_TR, x_TH.shape[1])
    quant_fp8_act_into(x_TH.contiguous(), q_TH, scale_TG)
    return packet_TR


@typed
def quant_fp8_into_packet_ref(x_TH: Float[Tensor, "T H"], packet_TR: Shaped[Tensor, "T R"]) -> Shaped[Tensor, "T R"]:
    """Plain torch twin of `quant_fp8_into_packet`."""
    _check_packet(x_TH, packet_TR)
    q_TH, scale_TG = unpack_packet(packet_TR, x_TH.shape[1])
    quant_fp8_act_into_ref(x_TH, q_TH, scale_TG)
    return packet_TR
