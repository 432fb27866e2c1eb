"""RMSNorm, computed as transformers does: normalise in fp32, cast back, then scale.

Legend: T tokens, H hidden.
"""

import torch

from mimo_fn._types import Float, Tensor, typed


@typed
def rms_norm(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"], eps: float) -> Float[Tensor, "T H"]:
    x32_TH = x_TH.float()
    x32_TH = x32_TH * torch.rsqrt(x32_TH.pow(2).mean(-1, keepdim=True) + eps)
    return w_H * x32_TH.to(x_TH.dtype)
