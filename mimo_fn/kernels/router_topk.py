"""The router's work after its GEMM in one kernel: sigmoid, correction bias, top-k, the weights.

Legend: T tokens, X experts, K experts per token.

`router_topk(logits_TX, bias_X, top_k, norm_topk_prob, scaling)` gives per token the K experts
of largest choice = sigmoid(logit) + bias and their weights: the unbiased sigmoid scores,
divided by their sum (+ 1e-20) when norm_topk_prob, times scaling (as
`mimo_fn.layers.router.gate_weights`). In torch that is seven launches over [T, X] or [T, K]
(sigmoid, add, topk, gather, sum, divide, scale); topk alone took 0.92 ms at 65536 tokens x 256
experts on an H100. Here one program reads a token's X logits once and picks the K by K arg-max
passes over registers.

Order (the tie rule): ids come in descending order of choice, equal choices lowest expert id
first; `router_topk_ref` (plain torch: a stable descending sort) has the same rule. The choices
must not be NaN: which experts either picks then is not specified.
Numerics: the kernel's sigmoid is Triton's, which may differ from torch's in the last bits (on
CUDA it takes the fast exp), and the sum over the K adds in another order: the weights agree to
~1e-6 relative, the ids exactly except between choices within a few ulps of each other.
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Int, Tensor, typed

MAX_EXPERTS = 1024  # one row in one program's registers (32 fp32 a thread at 4 warps)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, X, stride_lt, scaling,
                        K: tl.constexpr, NORM: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (T,): one token's row."""
    t = tl.program_id(0).to(tl.int64)
    offs_x = tl.arange(0, BLOCK_X)
    ok_x = offs_x < X
    logits = tl.load(logits_ptr + t * stride_lt + offs_x, mask=ok_x, other=0.0)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + offs_x, mask=ok_x, other=0.0)
    # padding is never chosen: -inf loses to every real choice, and ties go to the lower id
    choice = tl.where(ok_x, scores + bias, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    ids_k = tl.zeros([BLOCK_K], dtype=tl.int64)
    w_k = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(K):
        _, best = tl.max(choice, axis=0, return_indices=True, return_indices_tie_break_left=True)
        hit = offs_x == best
        ids_k = tl.where(offs_k == k, best.to(tl.int64), ids_k)
        w_k = tl.where(offs_k == k, tl.sum(tl.where(hit, scores, 0.0), axis=0), w_k)
        choice = tl.where(hit, float("-inf"), choice)  # the choices are finite: the taken lose from now on
    if NORM:
        w_k = w_k / (tl.sum(w_k, axis=0) + 1e-20)  # slots past K hold 0: they add nothing
    w_k = w_k * scaling
    ok_k = offs_k < K
    tl.store(w_ptr + t * K + offs_k, w_k, mask=ok_k)
    tl.store(ids_ptr + t * K + offs_k, ids_k, mask=ok_k)


def _check(fn: str, logits_TX: torch.Tensor, bias_X: torch.Tensor, top_k: int) -> None:
    if logits_TX.dim() != 2 or logits_TX.dtype != torch.float32:
        raise ValueError(f"{fn}: logits_TX is a {logits_TX.dtype} tensor of shape {tuple(logits_TX.shape)}; "
                         f"expected float32 [T, X]")
    num_experts = logits_TX.shape[1]
    if bias_X.shape != (num_experts,) or bias_X.dtype != torch.float32:
        raise ValueError(f"{fn}: bias_X is a {bias_X.dtype} tensor of shape {tuple(bias_X.shape)}; "
                         f"expected float32 [X={num_experts}]")
    if bias_X.device != logits_TX.device:
        raise ValueError(f"{fn}: bias_X is on {bias_X.device}, logits_TX on {logits_TX.device}; expected one device")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{fn}: top_k = {top_k!r}; expected an int in [1, X={num_experts}]")


@typed
def router_topk_ref(logits_TX: Float[Tensor, "T X"], bias_X: Float[Tensor, " X"], top_k: int,
                    norm_topk_prob: bool, scaling: float) -> tuple[Float[Tensor, "T K"], Int[Tensor, "T K"]]:
    """`router_topk` in plain torch: (weights fp32 [T, K], ids int64 [T, K]), ids by descending
    choice, ties lowest id first (the sort is stable)."""
    _check("router_topk_ref", logits_TX, bias_X, top_k)
    scores_TX = torch.sigmoid(logits_TX)
    choice_TX = scores_TX + bias_X
    ids_TK = choice_TX.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights_TK = scores_TX.gather(1, ids_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
    return weights_TK * scaling, ids_TK


@typed
def router_topk(logits_TX: Float[Tensor, "T X"], bias_X: Float[Tensor, " X"], top_k: int,
                norm_topk_prob: bool, scaling: float) -> tuple[Float[Tensor, "T K"], Int[Tensor, "T K"]]:
    """Per token the top_k experts of largest sigmoid(logit) + bias and their weights, in one
    kernel: (weights fp32 [T, K], ids int64 [T, K]), ids by descending choice, ties lowest id
    first. logits fp32 [T, X] with contiguous rows, bias fp32 [X], X <= MAX_EXPERTS."""
    _check("router_topk", logits_TX, bias_X, top_k)
    num_tokens, num_experts = logits_TX.shape
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"router_topk: X = {num_experts} experts; expected at most {MAX_EXPERTS} (one row a program)")
    if logits_TX.stride(1) != 1 and num_experts > 1:
        raise ValueError(f"router_topk: logits_TX has strides {logits_TX.stride()}; expected contiguous rows")
    bias_X = bias_X.contiguous()
    weights_TK = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits_TX.device)
    ids_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits_TX.device)
    if num_tokens == 0:
        return weights_TK, ids_TK
    block_x = triton.next_power_of_2(num_experts)
    # one row a program (65536 programs at 64K tokens); 256 experts: 8 a lane of one warp, whose
    # reductions stay in shuffles
    _router_topk_kernel[(num_tokens,)](
        logits_TX, bias_X, weights_TK, ids_TK, num_experts, logits_TX.stride(0), float(scaling),
        K=top_k, NORM=bool(norm_topk_prob), BLOCK_X=block_x, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=min(4, max(1, block_x // 256)),
    )
    return weights_TK, ids_TK
