"""RMSNorm in one pass: read x once, write y once; and the residual add fused in front of it.

Legend: T tokens, H hidden.

`mimo_fn.layers.norm.rms_norm_ref` is the reference (and the CPU path): transformers' order of
operations, y = w * dtype(x32 * rsqrt(mean(x32^2) + eps)) with x32 = float(x). That takes six
elementwise passes over [T, H] in fp32 (the cast, the square, the mean, the scaling, the cast
back, the weight); this kernel does the same arithmetic per row in registers. Only the order
of the fp32 sum of squares differs (a tree here, torch's own there), so the scale may differ
in its last bit. In bf16 that can flip the rounding of x * scale, and the weight's product
rounds once more: an output then differs by up to 2^-6 of itself (2e-6 of the outputs at
65536 x 4096 on an H200, the largest 1.4e-2: python -m mimo_fn.bench norm).

`add_rms_norm_fused` is a decoder layer's residual add and the norm after it in one pass:
s = x + r as torch adds them (fp32 sum, rounded once to x's dtype), written out, and the norm of
s with the very row code and launch of `rms_norm_fused`, so its output has the bits of
`rms_norm_fused(x + r)` (`layers.norm.add_rms_norm_ref` is its reference).

`rms_norm_quant_fused` is the norm in front of FP8 linears: the row code of `rms_norm_fused` (same
launch, same bits), then the 1x128 quantisation of `fp8_quant.quant_fp8_act` on the rounded row, written
straight into the FP8 GEMM's padded layout. The bf16 norm is never stored: one read of x, one write of
its FP8 codes, where the two kernels read x, write and read the norm, and write the codes.
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.kernels.fp8_quant import quant_groups
from mimo_fn.quant import BLOCK, FP8_DTYPE, FP8_MAX, SCALE_FLOOR


@triton.jit
def _rms_norm_row(x, w_ptr, offs, ok, H, eps, dt: tl.constexpr, INTERPRET: tl.constexpr):
    """One row x (fp32, zeros past H) normalised and scaled by w, in dt: both kernels' arithmetic."""
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    n = cast_rne(x * r, dt, INTERPRET).to(tl.float32)  # the reference casts back before the weight
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    return cast_rne(w * n, dt, INTERPRET)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_xt, stride_yt, eps,
                     BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (T,): one row."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + t * stride_xt + offs, mask=ok, other=0.0).to(tl.float32)
    y = _rms_norm_row(x, w_ptr, offs, ok, H, eps, y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + t * stride_yt + offs, y, mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, H, stride_xt, stride_rt, stride_st, stride_yt, eps,
                         BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (T,): one row; s = x + r, y = the norm of s as `_rms_norm_kernel` computes it."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + t * stride_xt + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + t * stride_rt + offs, mask=ok, other=0.0).to(tl.float32)
    dt: tl.constexpr = y_ptr.dtype.element_ty
    s = cast_rne(x + r, dt, INTERPRET)  # torch's x + r: the fp32 sum rounded once
    tl.store(s_ptr + t * stride_st + offs, s, mask=ok)
    y = _rms_norm_row(s.to(tl.float32), w_ptr, offs, ok, H, eps, dt, INTERPRET)
    tl.store(y_ptr + t * stride_yt + offs, y, mask=ok)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, T, H, stride_xt, stride_qt, stride_st, stride_sg, eps,
                           FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, BLOCK_H: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """Grid (T_out,): one row; rows t >= T are padding (x read as 0: codes 0, scale FLOOR / 448, as
    quant_fp8_act pads). The norm rounded to x's dtype as `_rms_norm_kernel` stores it, then quantised."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    valid = offs < tl.where(t < T, H, 0)  # none on a padding row
    x = tl.load(x_ptr + t * stride_xt + offs, mask=valid, other=0.0).to(tl.float32)
    y = _rms_norm_row(x, w_ptr, offs, ok, H, eps, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    y = tl.where(valid, y, 0.0)  # a padding row's norm is w * 0, -0.0 where w < 0: quant_fp8_act pads with +0
    G: tl.constexpr = BLOCK_H // 128
    q, scale = quant_groups(tl.reshape(y, [G, 128]), FP8_MAX_C, FLOOR_C, INTERPRET)  # [G, 128] codes, [G]
    g = tl.arange(0, G)
    g_ok = g * 128 < H
    tl.store(q_ptr + t * stride_qt + g[:, None] * 128 + tl.arange(0, 128)[None, :], q, mask=g_ok[:, None])
    tl.store(s_ptr + t * stride_st + g * stride_sg, scale, mask=g_ok)


def _row_launch(hidden: int, on_cuda: bool) -> dict:
    """Both kernels' launch settings: the same tile and warps give the same reduction tree."""
    block_h = triton.next_power_of_2(hidden)
    return {"BLOCK_H": block_h, "INTERPRET": not on_cuda, "num_warps": 8 if block_h >= 4096 else 4}


def unsupported_reason(x_TH: torch.Tensor, w_H: torch.Tensor, r_TH: torch.Tensor | None = None) -> str | None:
    """None when the kernel can run rms_norm(x_TH, w_H) (with r_TH: add_rms_norm(x_TH, r_TH, w_H)),
    else why not (the reference runs it)."""
    if x_TH.dim() != 2 or w_H.dim() != 1 or w_H.shape[0] != x_TH.shape[1]:
        return f"shapes {tuple(x_TH.shape)} and {tuple(w_H.shape)} (want [T, H] and [H])"
    if w_H.dtype != x_TH.dtype or x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtypes x {x_TH.dtype}, w {w_H.dtype} (one of bf16 / fp16 / fp32, the same for both)"
    if x_TH.stride(1) != 1 or w_H.stride(0) != 1:
        return "x's rows or w are not contiguous"
    if x_TH.shape[1] > 16384:
        return f"H={x_TH.shape[1]} (one row per program, in registers: H <= 16384)"
    if r_TH is None:
        return None
    if r_TH.shape != x_TH.shape or r_TH.dtype != x_TH.dtype:
        return f"r {r_TH.dtype} {tuple(r_TH.shape)} (want x's: {x_TH.dtype} {tuple(x_TH.shape)})"
    if r_TH.stride(1) != 1:
        return "r's rows are not contiguous"
    return None


def _check(fn: str, x_TH: torch.Tensor, w_H: torch.Tensor, r_TH: torch.Tensor | None = None) -> None:
    reason = unsupported_reason(x_TH, w_H, r_TH)
    if reason is not None:
        raise ValueError(f"{fn}: unsupported call: {reason}")


@typed
def rms_norm_fused(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
                   out_TH: Float[Tensor, "T H"] | None = None) -> Float[Tensor, "T H"]:
    """`rms_norm_ref` in one kernel, into out_TH if given (x's dtype and shape); ValueError where
    `unsupported_reason` says it cannot run."""
    _check("rms_norm_fused", x_TH, w_H)
    num_tokens, hidden = x_TH.shape
    if out_TH is None:
        out_TH = torch.empty_like(x_TH, memory_format=torch.contiguous_format)
    elif out_TH.shape != x_TH.shape or out_TH.dtype != x_TH.dtype or out_TH.stride(1) != 1:
        raise ValueError(f"rms_norm_fused: out_TH {tuple(out_TH.shape)} {out_TH.dtype} must match x "
                         f"{tuple(x_TH.shape)} {x_TH.dtype} with contiguous rows")
    if num_tokens == 0:
        return out_TH
    _rms_norm_kernel[(num_tokens,)](
        x_TH, w_H, out_TH, hidden, x_TH.stride(0), out_TH.stride(0), eps, **_row_launch(hidden, x_TH.is_cuda),
    )
    return out_TH


@typed
def add_rms_norm_fused(
    x_TH: Float[Tensor, "T H"], r_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
) -> tuple[Float[Tensor, "T H"], Float[Tensor, "T H"]]:
    """(s, rms_norm_fused(s)) for s = x + r, in one kernel: s has the bits of torch's x + r, the norm
    those of `rms_norm_fused(x + r)`. r: x's shape and dtype; ValueError where `unsupported_reason`
    says it cannot run."""
    _check("add_rms_norm_fused", x_TH, w_H, r_TH)
    num_tokens, hidden = x_TH.shape
    sum_TH = torch.empty_like(x_TH, memory_format=torch.contiguous_format)
    normed_TH = torch.empty_like(sum_TH)
    if num_tokens == 0:
        return sum_TH, normed_TH
    _add_rms_norm_kernel[(num_tokens,)](
        x_TH, r_TH, w_H, sum_TH, normed_TH, hidden, x_TH.stride(0), r_TH.stride(0), sum_TH.stride(0),
        normed_TH.stride(0), eps, **_row_launch(hidden, x_TH.is_cuda),
    )
    return sum_TH, normed_TH


@typed
def rms_norm_quant_fused(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
                         num_rows: int) -> tuple[Float[Tensor, "M H"], Float[Tensor, "M G"]]:
    """`quant_fp8_act(rms_norm_fused(x, w, eps), num_rows, H)` in one kernel, the same bits: (q [M, H]
    e4m3, scales [M, H / 128] M-major) for M = num_rows >= T, rows past T padding. H a multiple of 128;
    ValueError where `unsupported_reason` says the norm cannot run or the shapes do not fit."""
    _check("rms_norm_quant_fused", x_TH, w_H)
    num_tokens, hidden = x_TH.shape
    if hidden % BLOCK or num_rows < num_tokens:
        raise ValueError(f"rms_norm_quant_fused: H={hidden} must be a multiple of {BLOCK} and num_rows={num_rows} "
                         f"at least T={num_tokens}")
    q_MH = torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=x_TH.device)
    scale_MG = torch.empty(hidden // BLOCK, num_rows, dtype=torch.float32, device=x_TH.device).T  # M-major
    if num_rows == 0:
        return q_MH, scale_MG
    _rms_norm_quant_kernel[(num_rows,)](
        x_TH, w_H, q_MH.view(torch.uint8), scale_MG, num_tokens, hidden, x_TH.stride(0), q_MH.stride(0),
        scale_MG.stride(0), scale_MG.stride(1), eps, FP8_MAX_C=FP8_MAX, FLOOR_C=SCALE_FLOOR,
        **_row_launch(hidden, x_TH.is_cuda),
    )
    return q_MH, scale_MG
