"""Expert parallelism: send token copies to the ranks that own their experts, and back.

Legend: T local tokens, K experts per token, H hidden, S token copies this rank sends,
R token copies it receives, X experts, Xl = X / ep experts per rank.

EP rank e owns experts [e*Xl, (e+1)*Xl). `dispatch` drops padded ids (-1), orders the
(token, k) copies by expert (hence by owner), exchanges the per-rank counts in one
all-gather (so every rank can check every rank's capacity and fail together rather than
hang), then sends the rows in one all_to_all. `combine` sends the expert outputs back in
the same order and sums them into their tokens with the router weights.
"""

from dataclasses import dataclass

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.parallel.collectives import all_gather_ints, all_to_all
from mimo_fn.parallel.mesh import Mesh


class EPCapacityError(ValueError):
    """A rank would receive more token copies than its expert buffers allow."""


@dataclass(frozen=True)
class DispatchMeta:
    order_S: torch.Tensor  # int64 [S] flat (token * K + k) index of each sent copy, in send order
    send_counts: list[int]  # copies sent to each EP rank
    recv_counts: list[int]  # copies received from each EP rank


@typed
def dispatch(
    x_TH: Float[Tensor, "T H"], ids_TK: Int[Tensor, "T K"], num_experts: int, mesh: Mesh, capacity: int | None = None
) -> tuple[Float[Tensor, "R H"], Int[Tensor, " R"], Int[Tensor, " Xl"], DispatchMeta]:
    """Returns (routed rows x_RH, their local expert ids ids_R, tokens per local expert [Xl], meta)."""
    per_rank = num_experts // mesh.ep
    ids_P = ids_TK.reshape(-1)
    valid_S = torch.nonzero(ids_P >= 0).squeeze(-1)
    order_S = valid_S[torch.argsort(ids_P[valid_S], stable=True)]  # by expert, so by owner rank
    expert_S = ids_P[order_S]
    send_counts = torch.bincount(expert_S // per_rank, minlength=mesh.ep).tolist()  # host sync
    matrix = all_gather_ints(send_counts, mesh.ep_group, x_TH.device)  # matrix[src][dst]
    recv_counts = [row[mesh.ep_rank] for row in matrix]
    if capacity is not None:
        totals = [sum(row[d] for row in matrix) for d in range(mesh.ep)]
        worst = max(range(mesh.ep), key=lambda d: totals[d])
        if totals[worst] > capacity:
            raise EPCapacityError(f"EP dispatch: rank {worst} would receive {totals[worst]} token copies, "
                                  f"over the capacity of {capacity} (init_mesh(ep_capacity=...))")
    k = ids_TK.shape[1]
    x_RH = all_to_all(x_TH[order_S // k], send_counts, recv_counts, mesh.ep_group)
    ids_R = all_to_all(expert_S % per_rank, send_counts, recv_counts, mesh.ep_group)
    counts_Xl = torch.bincount(ids_R, minlength=per_rank)
    return x_RH, ids_R, counts_Xl, DispatchMeta(order_S, send_counts, recv_counts)


@typed
def combine(y_RH: Float[Tensor, "R H"], weights_TK: Float[Tensor, "T K"], meta: DispatchMeta, mesh: Mesh
            ) -> Float[Tensor, "T H"]:
    """Expert outputs back to their tokens: out[t] = sum_k w[t, k] * y(t, k)."""
    y_SH = all_to_all(y_RH, meta.recv_counts, meta.send_counts, mesh.ep_group)
    k = weights_TK.shape[1]
    w_S = weights_TK.reshape(-1)[meta.order_S]
    out_TH = torch.zeros(weights_TK.shape[0], y_RH.shape[1], dtype=y_RH.dtype, device=y_RH.device)
    out_TH.index_add_(0, meta.order_S // k, (y_SH * w_S[:, None]).to(y_RH.dtype))
    return out_TH
