"""Weight quantisation in one pass, written into the engine's existing buffers: FP8 128x128
blocks and MXFP4 (E2M1 codes, an E8M0 scale per 32 along K). RL weight sync re-quantises every
trainer weight (mimo_fn.rl.weights); the plain-torch quantisers of mimo_fn.quant take ~10
launches and fp32 temporaries per matrix, 270-730 us per expert projection at the released dims
on an H200, where one kernel reads the matrix once.

Legend: N rows (output features), K columns (the GEMM's reduction dim), Nb / Kb = ceil(N / 128)
/ ceil(K / 128) FP8 blocks, G = K / 32 MXFP4 groups, C = K / 2 MXFP4 code bytes per row.

Numerics are mimo_fn.quant's bit for bit (`_ref` twins below), on the GPU and in Triton's CPU
interpreter:
* FP8: scale = max(amax, 1e-10) / 448 and q = w / scale as IEEE divisions (`tl.math.div_rn`),
  clamped to +-448, cast to e4m3 rounding to nearest even (`cast.cast_rne`).
* MXFP4: a group's exponent is ceil(log2(amax / 6)) from the bits of amax / 6, clamped to
  [-127, 127] (-127 for an all-zero group); v = w * 2^-exponent is exact; a code is the nearest
  E2M1 magnitude (ties to the even code) with the sign in bit 3, as `quant._round_e2m1`.
"""

import functools

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Shaped, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.quant import BLOCK, E8M0_BIAS, FP8_MAX, FP8_BLOCK, MX_GROUP, MXFP4, SCALE_FLOOR, QTensor, \
    quantize_fp8_block, quantize_mxfp4

_MX_ROWS = 32  # rows per MXFP4 program
_MX_GROUPS = 8  # groups of 32 per MXFP4 program: a 32 x 256 tile


def _fp8_block_kernel(
    w_ptr, stride_wn, stride_wk,  # [N, K] in
    q_ptr, stride_qn, stride_qk,  # [N, K] e4m3 bytes out
    s_ptr, stride_sn, stride_sk,  # [Nb, Kb] fp32 scales out
    N, K, FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,
):
    bn, bk = tl.program_id(0), tl.program_id(1)
    rows = (bn * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    cols = bk * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :] * stride_wk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR_C), FP8_MAX_C)
    y = tl.math.div_rn(w, tl.zeros_like(w) + scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
    q = cast_rne(y, tl.float8e4nv, INTERPRET).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :] * stride_qk, q, mask=mask)
    tl.store(s_ptr + bn * stride_sn + bk * stride_sk, scale)


def _mxfp4_kernel(
    w_ptr, stride_wn, stride_wk,  # [N, K] in
    d_ptr, stride_dn, stride_dc,  # [N, C] code bytes out: column 2c in the low nibble, 2c + 1 in the high
    s_ptr, stride_sn, stride_sg,  # [N, G] E8M0 bytes out
    N, G, BIAS: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
):
    pn, pg = tl.program_id(0), tl.program_id(1)
    r = (pn * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None, None]  # [ROWS, 1, 1]
    g = (pg * GROUPS + tl.arange(0, GROUPS))[None, :, None]  # [1, GROUPS, 1]
    i = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]: the byte within a group
    mask = (r < N) & (g < G) & (i < 16)
    even = w_ptr + r * stride_wn + (g * 32 + 2 * i) * stride_wk
    w_lo = tl.load(even, mask=mask, other=0.0).to(tl.float32)
    w_hi = tl.load(even + stride_wk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(w_lo), axis=2), tl.max(tl.abs(w_hi), axis=2))  # [ROWS, GROUPS]
    y = tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0)
    bits = y.to(tl.int32, bitcast=True)
    field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    exp = tl.where(field > 0, field - BIAS + (mant != 0).to(tl.int32),  # ceil(log2 y) of a normal y
                   tl.where(mant > (1 << 22), -BIAS + 1, -BIAS))  # subnormal: above 2^-127 or not
    exp = tl.minimum(tl.maximum(exp, -BIAS), BIAS)
    exp = tl.where(amax > 0, exp, -BIAS)
    inv = ((BIAS - exp) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^-exp: a normal fp32 for every exp
    code_lo = _e2m1(w_lo * inv)
    code_hi = _e2m1(w_hi * inv)
    tl.store(d_ptr + r * stride_dn + (g * 16 + i) * stride_dc, (code_lo | (code_hi << 4)).to(tl.uint8), mask=mask)
    r2, g2 = tl.max(r, axis=2), tl.max(g, axis=2)  # [ROWS, 1], [1, GROUPS]
    tl.store(s_ptr + r2 * stride_sn + g2 * stride_sg, (exp + BIAS).to(tl.uint8), mask=(r2 < N) & (g2 < G))


@triton.jit
def _e2m1(v):
    """fp32 values in [-6, 6] -> E2M1 codes (int32): the nearest magnitude, ties to the even code."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    # a on the midpoint just above code (odd codes' upper midpoints: 0.75, 1.75, 3.5) rounds up to the even code
    tie = ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(tl.int32)
    return (code + tie) | ((v < 0).to(tl.int32) << 3)


@functools.cache
def _kernels():
    # triton.jit reads TRITON_INTERPRET when it decorates: at first use, not at import (fp8_quant.py)
    return triton.jit(_fp8_block_kernel), triton.jit(_mxfp4_kernel)


@typed
def quant_fp8_block_into(w_NK: Float[Tensor, "N K"], q_NK: Shaped[Tensor, "N K"],
                         scale_NbKb: Float[Tensor, "Nb Kb"]) -> None:
    """Quantise w into 128x128-block FP8: codes into q (float8_e4m3fn), fp32 scales into scale,
    both caller-given views of any strides (e.g. one expert's rows of a stacked weight)."""
    n, k = w_NK.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    if tuple(scale_NbKb.shape) != (nb, kb) or q_NK.dtype != torch.float8_e4m3fn or scale_NbKb.dtype != torch.float32:
        raise ValueError(f"quant_fp8_block_into: w {list(w_NK.shape)} needs q float8_e4m3fn {[n, k]} and scales "
                         f"float32 {[nb, kb]}; got {q_NK.dtype} {list(q_NK.shape)}, {scale_NbKb.dtype} "
                         f"{list(scale_NbKb.shape)}")
    q_u8 = q_NK.view(torch.uint8)
    _kernels()[0][(nb, kb)](
        w_NK, *w_NK.stride(), q_u8, *q_u8.stride(), scale_NbKb, *scale_NbKb.stride(), n, k,
        FP8_MAX_C=FP8_MAX, FLOOR_C=SCALE_FLOOR, BLOCK_C=BLOCK, INTERPRET=not w_NK.is_cuda, num_warps=8)


def quant_fp8_block_into_ref(w_NK: torch.Tensor, q_NK: torch.Tensor, scale_NbKb: torch.Tensor) -> None:
    q = quantize_fp8_block(w_NK.float())
    q_NK.copy_(q.data)
    scale_NbKb.copy_(q.scale)


@typed
def quant_mxfp4_into(w_NK: Float[Tensor, "N K"], data_NC: Shaped[Tensor, "N C"],
                     scale_NG: Shaped[Tensor, "N G"]) -> None:
    """Quantise w into MXFP4: code bytes into data (uint8 [N, K / 2]) and E8M0 scales into scale
    (uint8 [N, K / 32]), caller-given views of any strides."""
    n, k = w_NK.shape
    if k % MX_GROUP or tuple(data_NC.shape) != (n, k // 2) or tuple(scale_NG.shape) != (n, k // MX_GROUP) \
            or data_NC.dtype != torch.uint8 or scale_NG.dtype != torch.uint8:
        raise ValueError(f"quant_mxfp4_into: w {list(w_NK.shape)} needs K a multiple of {MX_GROUP}, codes uint8 "
                         f"{[n, k // 2]} and scales uint8 {[n, k // MX_GROUP]}; got {data_NC.dtype} "
                         f"{list(data_NC.shape)}, {scale_NG.dtype} {list(scale_NG.shape)}")
    groups = k // MX_GROUP
    _kernels()[1][(-(-n // _MX_ROWS), -(-groups // _MX_GROUPS))](
        w_NK, *w_NK.stride(), data_NC, *data_NC.stride(), scale_NG, *scale_NG.stride(), n, groups,
        BIAS=E8M0_BIAS, ROWS=_MX_ROWS, GROUPS=_MX_GROUPS, num_warps=4)


def quant_mxfp4_into_ref(w_NK: torch.Tensor, data_NC: torch.Tensor, scale_NG: torch.Tensor) -> None:
    q = quantize_mxfp4(w_NK.float())
    data_NC.copy_(q.data)
    scale_NG.copy_(q.scale)


def quantize_into(w_NK: torch.Tensor, dst: QTensor) -> None:
    """w re-quantised into dst's own data and scale buffers, in dst's format (FP8_BLOCK or MXFP4):
    the kernels on CUDA, the references elsewhere."""
    into = {FP8_BLOCK: (quant_fp8_block_into, quant_fp8_block_into_ref),
            MXFP4: (quant_mxfp4_into, quant_mxfp4_into_ref)}[dst.fmt][0 if w_NK.is_cuda else 1]
    into(w_NK, dst.data, dst.scale)
