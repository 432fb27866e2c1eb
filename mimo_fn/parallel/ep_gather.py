"""Expert parallelism by all-gather: every EP rank sees the group's tokens, runs its own experts
on them, and a reduce-scatter sums the outputs back to their ranks.

Legend: t token rows on this rank, r = rows every EP rank contributes (>= t, zero-padded),
n = ep * r rows of the group, H hidden, K experts per token, X experts, Xl = X / ep.

The all-to-all dispatch (`ep.py`) sends each (token, k) copy to its expert's owner, and must
first tell every rank how many rows to expect: a host sync per MoE layer, and shapes that
change with the routing, so a step with it cannot be captured in a CUDA graph. Here every
collective has a size fixed by r alone: the rows (and their expert ids and router weights)
are all-gathered, each rank keeps the ids of its own experts (the others become -1, which
the expert GEMMs skip), and the [n, H] partial outputs are reduce-scattered. Per token, the
all-to-all sends its K copies less those of local experts, about K (ep - 1) / ep rows, and the
gather sends ep - 1 rows (the partial sums come back the same way): for MiMo's top-8, 7 rows
either way at EP8, and fewer here at EP2 / EP4 (1 and 3 against 4 and 6).

`Mesh.ep_capacity` bounds what one rank receives here too: the n = ep * r rows it gathers
(every rank of the group gathers the same n, so all of them raise the same EPCapacityError
before any collective, and the step can be retried; r is known on the host, so the check costs
no sync and holds under CUDA graph capture).

The rows of one EP group must have the same count r on every rank. Ranks of one DP group
split the same batch, so r = t wherever the EP group lies inside a DP group (tp % ep == 0);
otherwise `gather_rows` agrees on the largest t of all ranks (one small host sync per step).
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.parallel.collectives import all_gather, reduce_scatter
from mimo_fn.parallel.ep import EPCapacityError
from mimo_fn.parallel.mesh import Mesh


def rows_agree(mesh: Mesh) -> bool:
    """Whether every rank of an EP group holds the same number of rows without asking: the
    EP group lies inside one DP group, whose ranks split the same batch."""
    return mesh.ep == 1 or mesh.tp % mesh.ep == 0


def gather_rows(t: int, mesh: Mesh, device: torch.device) -> int:
    """Rows each EP rank contributes to the gather: t, or the largest t of all ranks (a host sync)."""
    if rows_agree(mesh):
        return t
    return max(row[0] for row in mesh.agree_ints([t], device))


@typed
def local_ids(ids_TK: Int[Tensor, "T K"], num_experts: int, mesh: Mesh) -> Int[Tensor, "T K"]:
    """Global expert ids -> this EP rank's local ids (0..Xl-1), -1 for experts it does not own."""
    per_rank = num_experts // mesh.ep
    local_TK = ids_TK - mesh.ep_rank * per_rank
    return torch.where((ids_TK >= 0) & (local_TK >= 0) & (local_TK < per_rank), local_TK, -1)


@typed
def gather_for_experts(
    x_tH: Float[Tensor, "t H"], ids_tK: Int[Tensor, "t K"], weights_tK: Float[Tensor, "t K"], rows: int,
    num_experts: int, mesh: Mesh,
) -> tuple[Float[Tensor, "n H"], Int[Tensor, "n K"], Float[Tensor, "n K"]]:
    """The EP group's rows, their local expert ids (-1: another rank's expert, or padding) and
    router weights; rank e's rows are [e*rows, e*rows + its t). Over mesh.ep_capacity rows
    (n = ep * rows) every rank of the group raises EPCapacityError before sending anything."""
    n = mesh.ep * rows
    if mesh.ep_capacity is not None and n > mesh.ep_capacity:
        raise EPCapacityError(f"EP dispatch (gather): every rank would receive {n} token rows ({mesh.ep} ranks x "
                              f"{rows}), over the capacity of {mesh.ep_capacity} (init_mesh(ep_capacity=...))")
    pad = rows - x_tH.shape[0]
    assert pad >= 0, f"gather_for_experts: {x_tH.shape[0]} rows, more than the agreed {rows}"
    if pad:
        x_tH = torch.cat([x_tH, x_tH.new_zeros(pad, x_tH.shape[1])])
        ids_tK = torch.cat([ids_tK, ids_tK.new_full((pad, ids_tK.shape[1]), -1)])
        weights_tK = torch.cat([weights_tK, weights_tK.new_zeros(pad, weights_tK.shape[1])])
    x_nH = all_gather(x_tH, mesh.ep_group)
    ids_nK = all_gather(ids_tK, mesh.ep_group)
    weights_nK = all_gather(weights_tK, mesh.ep_group)
    return x_nH, local_ids(ids_nK, num_experts, mesh), weights_nK


@typed
def scatter_from_experts(y_nH: Float[Tensor, "n H"], t: int, mesh: Mesh) -> Float[Tensor, "t H"]:
    """Partial outputs of this rank's experts for the group's rows -> this rank's t rows, summed
    over the EP ranks (each token's experts live on up to ep of them)."""
    return reduce_scatter(y_nH, mesh.ep_group, mesh.force_fallback)[:t]
