"""Grouped expert GEMMs for the MoE layer.

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token.

Expert weights are stacked: w13_E2IH holds each expert's gate rows [0:I] then up rows
[I:2I] (transformers' fused `gate_up_proj`); w2_EHI is the down projection. An expert id
of -1 in topk_ids_TK is padding: it contributes nothing.
"""

import torch
import torch.nn.functional as F

from mimo_fn._types import Float, Int, Tensor, typed


@typed
def fused_moe_ref(
    x_TH: Float[Tensor, "T H"],
    w13_E2IH: Float[Tensor, "E I2 H"],
    w2_EHI: Float[Tensor, "E H I"],
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
) -> Float[Tensor, "T H"]:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) for e = topk_ids[t, k], as transformers computes it."""
    out_TH = torch.zeros_like(x_TH)
    inter = w2_EHI.shape[-1]
    for e in torch.unique(topk_ids_TK).tolist():  # host sync: reference path only
        if e < 0:
            continue
        tok_R, k_R = torch.where(topk_ids_TK == e)
        gate_RI, up_RI = F.linear(x_TH[tok_R], w13_E2IH[e]).split(inter, dim=-1)
        y_RH = F.linear(F.silu(gate_RI) * up_RI, w2_EHI[e])
        y_RH = y_RH * topk_weights_TK[tok_R, k_R, None]
        out_TH.index_add_(0, tok_R, y_RH.to(out_TH.dtype))
    return out_TH
