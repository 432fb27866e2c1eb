"""RMSNorm, computed as transformers does: normalise in fp32, cast back, then scale.

Legend: T tokens, H hidden.

On CUDA `rms_norm` runs the one-pass kernel `mimo_fn.kernels.rmsnorm.rms_norm_fused` where it
applies, except where autograd needs a backward (a trainer's forward), which the kernel has not;
`rms_norm_ref` (the CPU path) is its oracle.
"""

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels import rmsnorm


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
