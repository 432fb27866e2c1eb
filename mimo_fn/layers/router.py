"""Sigmoid router with a correction bias and group-limited top-k (DeepSeek-V3 style, no aux loss).

Legend: T tokens, H hidden, X experts, K experts per token, C groups.
Logits in fp32; the correction bias shifts the choice only, the weights come from the
unbiased sigmoid scores, renormalised over the chosen K and multiplied by the scaling factor.
On CUDA, for an ungrouped router (n_group 1) outside deterministic mode and where no gradient is
wanted, the work after the GEMM is one kernel (mimo_fn.kernels.router_topk): its ids come in
descending order of choice, ties lowest id first; elsewhere topk(sorted=False) gives them in its
algorithm's order. The MoE adds a token's K rows in the order given, so only fp32 rounding follows it.
Deterministic mode (the `deterministic` argument; mimo_fn.kernels.fixed_gemm says why): the
logits come from the fixed-tiling GEMM on CUDA, the chosen ids are sorted (topk's order, which
the MoE's sum over experts follows, is its algorithm's, and that follows the token count) and
the renormalising sum adds the K weights left to right.
`replay_weights` gives those weights for a choice made elsewhere (routing replay in RL: the
trainer routes each token to the experts the rollout engine chose).
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.router_topk import MAX_EXPERTS, router_topk


@typed
def router_logits(x_TH: Float[Tensor, "T H"], router_XH: Float[Tensor, "X H"],
                  deterministic: bool = False) -> Float[Tensor, "T X"]:
    """fp32 logits x @ router^T, as transformers computes them (both operands cast to fp32).

    On CUDA with 16-bit x and router weights, one tensor-core GEMM with fp32 output instead:
    the products of 16-bit values are exact in fp32 either way, so only the order of the fp32
    sum differs (as it does between any two GEMM kernels): on an H200 its largest error was
    7.8e-7 of sum |x| |w| against the fp32 GEMM's 2.5e-7, and it took 0.22 ms instead of 3.5 ms at
    65536 tokens x 4096 x 256 experts (python -m mimo_fn.bench router, docs/benchmarks.md).
    """
    if deterministic and x_TH.is_cuda:
        from mimo_fn.kernels.fixed_gemm import fixed_gemm  # Triton: imported only where it runs

        if x_TH.dtype != router_XH.dtype:  # as transformers: both in fp32
            return fixed_gemm(x_TH.float(), router_XH.float())
        return fixed_gemm(x_TH, router_XH, torch.float32)
    wants_grad = torch.is_grad_enabled() and (x_TH.requires_grad or router_XH.requires_grad)  # mm's out_dtype: none
    if x_TH.is_cuda and x_TH.dtype in (torch.bfloat16, torch.float16) and router_XH.dtype == x_TH.dtype and \
            not wants_grad:
        return torch.mm(x_TH, router_XH.t(), out_dtype=torch.float32)
    return x_TH.float() @ router_XH.float().T


@typed
def route(
    x_TH: Float[Tensor, "T H"], router_XH: Float[Tensor, "X H"], bias_X: Float[Tensor, " X"], cfg: ModelConfig,
    deterministic: bool = False,
) -> tuple[Float[Tensor, "T K"], Int[Tensor, "T K"]]:
    """Per token the cfg.top_k experts and their weights (fp32 [T, K], int64 [T, K]). On CUDA
    the work after the GEMM is one kernel (kernels.router_topk) where it applies: ungrouped
    (n_group 1), not deterministic, no gradient wanted; its ids come by descending choice."""
    logits_TX = router_logits(x_TH, router_XH, deterministic)
    # requires_grad: a gradient is wanted for x or the router (the kernel has no backward); the
    # bias gets none on either path, it only shifts the choice
    fused = (logits_TX.is_cuda and cfg.n_group == 1 and cfg.num_experts <= MAX_EXPERTS
             and not deterministic and not logits_TX.requires_grad)
    return _route_logits(logits_TX, bias_X, cfg, deterministic, fused)


def _route_logits(logits_TX: torch.Tensor, bias_X: torch.Tensor, cfg: ModelConfig, deterministic: bool,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route from the logits on; fused: the kernel (tests run it on the CPU, in the interpreter)."""
    if fused:
        return router_topk(logits_TX, bias_X.float(), cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    scores_TX = torch.sigmoid(logits_TX)
    choice_TX = scores_TX + bias_X.float()
    if cfg.n_group > 1:
        num_tokens = logits_TX.shape[0]
        choice_TCx = choice_TX.view(num_tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_score_TC = choice_TCx.topk(2, dim=-1).values.sum(-1)  # a group is as good as its best two
        keep_idx = group_score_TC.topk(cfg.topk_group, dim=-1, sorted=False).indices
        keep_TC = torch.zeros_like(group_score_TC, dtype=torch.bool).scatter_(1, keep_idx, True)
        choice_TX = choice_TCx.masked_fill(~keep_TC[..., None], float("-inf")).view(num_tokens, cfg.num_experts)
    ids_TK = choice_TX.topk(cfg.top_k, dim=-1, sorted=False).indices
    if deterministic:
        ids_TK = ids_TK.sort(dim=-1).values
    return gate_weights(scores_TX, ids_TK, cfg, deterministic), ids_TK


@typed
def gate_weights(scores_TX: Float[Tensor, "T X"], ids_TK: Int[Tensor, "T K"], cfg: ModelConfig,
                 deterministic: bool = False) -> Float[Tensor, "T K"]:
    """The chosen experts' unbiased scores, renormalised over the K and scaled. deterministic:
    the K weights summed left to right (a reduction kernel's order may follow the token count)."""
    weights_TK = scores_TX.gather(1, ids_TK)
    if cfg.norm_topk_prob:
        if deterministic:
            total_T1 = weights_TK[:, :1].clone()
            for k in range(1, weights_TK.shape[1]):
                total_T1 += weights_TK[:, k:k + 1]
        else:
            total_T1 = weights_TK.sum(-1, keepdim=True)
        weights_TK = weights_TK / (total_T1 + 1e-20)
    return weights_TK * cfg.routed_scaling_factor


@typed
def replay_weights(
    x_TH: Float[Tensor, "T H"], router_XH: Float[Tensor, "X H"], ids_TK: Int[Tensor, "T K"], cfg: ModelConfig,
    deterministic: bool = False,
) -> Float[Tensor, "T K"]:
    """Routing replay: the weights `route` would give experts ids_TK (chosen elsewhere, e.g. by the
    rollout engine), from this router's own scores, so a gradient reaches the router. The
    correction bias takes no part: it only shifts the choice, which is given."""
    scores_TX = torch.sigmoid(router_logits(x_TH, router_XH, deterministic))
    return gate_weights(scores_TX, ids_TK.long(), cfg, deterministic)
