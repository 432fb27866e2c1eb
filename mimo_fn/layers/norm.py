"""RMSNorm, computed as transformers does: normalise in fp32, cast back, then scale; and the
decoder layer's residual add fused in front of it.

Legend: T tokens, H hidden.

On CUDA `rms_norm` runs the one-pass kernel `mimo_fn.kernels.rmsnorm.rms_norm_fused` where it
applies, except where autograd needs a backward (a trainer's forward), which the kernel has not;
`rms_norm_ref` (the CPU path) is its oracle. `add_rms_norm` (x + r, then its norm) follows the same
rules with `rmsnorm.add_rms_norm_fused`, whose oracle is `add_rms_norm_ref`. `rms_norm_quantized` is
the norm in front of FP8 linears: `quantize_once(rms_norm(x), weights)` with the same bits, in one
kernel (`rmsnorm.rms_norm_quant_fused`) on CUDA where both would run their kernels.
"""

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels import rmsnorm
from mimo_fn.layers.linear import Weight, quant_rows, quantize_once
from mimo_fn.quant import BLOCK, QActs


@typed
def rms_norm_ref(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float) -> Float[Tensor, "T H"]:
    x32_TH = x_TH.float()
    x32_TH = x32_TH * torch.rsqrt(x32_TH.pow(2).mean(-1, keepdim=True) + eps)
    return w_H * x32_TH.to(x_TH.dtype)


@typed
def rms_norm(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float) -> Float[Tensor, "T H"]:
    wants_grad = torch.is_grad_enabled() and (x_TH.requires_grad or w_H.requires_grad)
    if x_TH.is_cuda and not wants_grad and rmsnorm.unsupported_reason(x_TH, w_H) is None:
        return rmsnorm.rms_norm_fused(x_TH, w_H, eps)
    return rms_norm_ref(x_TH, w_H, eps)


@typed
def rms_norm_quantized(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float, weights: tuple[Weight, ...],
                       deterministic: bool = False) -> Float[Tensor, "T H"] | QActs:
    """`quantize_once(rms_norm(x, w, eps), weights, deterministic)`: the norm as the linears of `weights`
    take it (QActs where they run an FP8 GEMM on it, else the norm itself). On CUDA, where the norm's
    kernel runs and the quantiser would (H a multiple of 128), both in one kernel with the same bits."""
    wants_grad = torch.is_grad_enabled() and (x_TH.requires_grad or w_H.requires_grad)
    rows = quant_rows(x_TH, weights, deterministic)
    if (rows is None or not x_TH.is_cuda or wants_grad or x_TH.shape[1] % BLOCK
            or rmsnorm.unsupported_reason(x_TH, w_H) is not None):
        return quantize_once(rms_norm(x_TH, w_H, eps), weights, deterministic)
    q_MH, scale_MG = rmsnorm.rms_norm_quant_fused(x_TH, w_H, eps, rows)
    return QActs(q_MH[:x_TH.shape[0]], scale_MG[:x_TH.shape[0]], x_TH.dtype)


@typed
def add_rms_norm_ref(
    x_TH: Float[Tensor, "T H"], r_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
) -> tuple[Float[Tensor, "T H"], Float[Tensor, "T H"]]:
    s_TH = x_TH + r_TH
    return s_TH, rms_norm_ref(s_TH, w_H, eps)


@typed
def add_rms_norm(
    x_TH: Float[Tensor, "T H"], r_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float,
) -> tuple[Float[Tensor, "T H"], Float[Tensor, "T H"]]:
    """(s, rms_norm(s)) for s = x + r: the residual stream after a sublayer's output r, and the
    next sublayer's input. One kernel on CUDA where it applies (r of x's dtype and shape, as
    `rms_norm`'s rules), with the bits of the two steps; elsewhere the two steps themselves, each
    as `rms_norm` picks (on CPU: `add_rms_norm_ref`)."""
    wants_grad = torch.is_grad_enabled() and (x_TH.requires_grad or r_TH.requires_grad or w_H.requires_grad)
    if x_TH.is_cuda and not wants_grad and rmsnorm.unsupported_reason(x_TH, w_H, r_TH) is None:
        return rmsnorm.add_rms_norm_fused(x_TH, r_TH, w_H, eps)
    s_TH = x_TH + r_TH
    return s_TH, rms_norm(s_TH, w_H, eps)
