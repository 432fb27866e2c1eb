"""Sigmoid router with a correction bias and group-limited top-k (DeepSeek-V3 style, no aux loss).

Legend: T tokens, H hidden, X experts, K experts per token, C groups.
Logits in fp32; the correction bias shifts the choice only, the weights come from the
unbiased sigmoid scores, renormalised over the chosen K and multiplied by the scaling factor.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig


@typed
def route(
    x_TH: Float[Tensor, "T H"], router_XH: Float[Tensor, "X H"], bias_X: Float[Tensor, " X"], cfg: ModelConfig
) -> tuple[Float[Tensor, "T K"], Int[Tensor, "T K"]]:
    scores_TX = torch.sigmoid(x_TH.float() @ router_XH.float().T)
    choice_TX = scores_TX + bias_X.float()
    if cfg.n_group > 1:
        num_tokens = x_TH.shape[0]
        choice_TCx = choice_TX.view(num_tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_score_TC = choice_TCx.topk(2, dim=-1).values.sum(-1)  # a group is as good as its best two
        keep_idx = group_score_TC.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep_TC = torch.zeros_like(group_score_TC, dtype=torch.bool).scatter_(1, keep_idx, True)
        choice_TX = choice_TCx.masked_fill(~keep_TC[..., None], float("-inf")).view(num_tokens, cfg.num_experts)
    ids_TK = choice_TX.topk(cfg.top_k, dim=-1, sorted=False).indices
    weights_TK = scores_TX.gather(1, ids_TK)
    if cfg.norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    return weights_TK * cfg.routed_scaling_factor, ids_TK
