"""RMSNorm in one pass: read x once, write y once.

Legend: T tokens, H hidden.

`mimo_fn.layers.norm.rms_norm_ref` is the reference (and the CPU path): transformers' order of
operations, y = w * dtype(x32 * rsqrt(mean(x32^2) + eps)) with x32 = float(x). That takes six
elementwise passes over [T, H] in fp32 (the cast, the square, the mean, the scaling, the cast
back, the weight); this kernel does the same arithmetic per row in registers. Only the order
of the fp32 sum of squares differs (a tree here, torch's own there), so the scale may differ
in its last bit. In bf16 that can flip the rounding of x * scale, and the weight's product
rounds once more: an output then differs by up to 2^-6 of itself (2e-6 of the outputs at
65536 x 4096 on an H200, the largest 1.4e-2: python -m mimo_fn.bench norm).
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_xt, stride_yt, eps,
                     BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (T,): one row."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    ok = offs < H
    x = tl.load(x_ptr + t * stride_xt + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    dt: tl.constexpr = y_ptr.dtype.element_ty
    n = cast_rne(x * r, dt, INTERPRET).to(tl.float32)  # the reference casts back before the weight
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + offs, cast_rne(w * n, dt, INTERPRET), mask=ok)


def unsupported_reason(x_TH: torch.Tensor, w_H: torch.Tensor) -> str | None:
    """None when the kernel can run rms_norm(x_TH, w_H), else why not (the reference runs it)."""
    if x_TH.dim() != 2 or w_H.dim() != 1 or w_H.shape[0] != x_TH.shape[1]:
        return f"shapes {tuple(x_TH.shape)} and {tuple(w_H.shape)} (want [T, H] and [H])"
    if w_H.dtype != x_TH.dtype or x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtypes x {x_TH.dtype}, w {w_H.dtype} (one of bf16 / fp16 / fp32, the same for both)"
    if x_TH.stride(1) != 1 or w_H.stride(0) != 1:
        return "x's rows or w are not contiguous"
    if x_TH.shape[1] > 16384:
        return f"H={x_TH.shape[1]} (one row per program, in registers: H <= 16384)"
    return None


@typed
def rms_norm_fused(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
                   out_TH: Float[Tensor, "T H"] | None = None) -> Float[Tensor, "T H"]:
    """`rms_norm_ref` in one kernel, into out_TH if given (x's dtype and shape); ValueError where
    `unsupported_reason` says it cannot run."""
    reason = unsupported_reason(x_TH, w_H)
    if reason is not None:
        raise ValueError(f"rms_norm_fused: unsupported call: {reason}")
    num_tokens, hidden = x_TH.shape
    if out_TH is None:
        out_TH = torch.empty_like(x_TH, memory_format=torch.contiguous_format)
    elif out_TH.shape != x_TH.shape or out_TH.dtype != x_TH.dtype or out_TH.stride(1) != 1:
        raise ValueError(f"rms_norm_fused: out_TH {tuple(out_TH.shape)} {out_TH.dtype} must match x "
                         f"{tuple(x_TH.shape)} {x_TH.dtype} with contiguous rows")
    if num_tokens == 0:
        return out_TH
    block_h = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x_TH, w_H, out_TH, hidden, x_TH.stride(0), out_TH.stride(0), eps,
        BLOCK_H=block_h, INTERPRET=not x_TH.is_cuda, num_warps=8 if block_h >= 4096 else 4,
    )
    return out_TH
