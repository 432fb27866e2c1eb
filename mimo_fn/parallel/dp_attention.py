"""DP attention: a DP group's tokens are split across its TP ranks between attention blocks.

Legend: T tokens of the DP group, t = ceil(T / tp) rows per TP rank, H hidden.

Rank r of the TP group holds rows [r*t, (r+1)*t) of the residual stream (zero-padded past
T). Before attention the normed rows are all-gathered (every rank sees all T tokens and
runs its own heads); after the row-parallel O projection the partial sums are
reduce-scattered back to the row split. On a 1-rank TP axis both are the identity.

The gather ships bf16 rows, or (mesh.attn_gather) FP8: "packed_fp8" quantises into one
packet of FP8 bytes + fp32 scales and gathers it in ONE collective, "fp8_two" gathers
bytes and scales separately. Either way the QKV GEMMs consume the gathered FP8 as it is.
"""

import math

import torch

from mimo_fn._types import Float, Shaped, Tensor, typed
from mimo_fn.parallel.collectives import all_gather, reduce_scatter
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.packed_fp8 import all_gather_fp8_two_collectives, all_gather_packed_fp8
from mimo_fn.quant import QActs


def rows_per_rank(num_tokens: int, mesh: Mesh) -> int:
    return math.ceil(num_tokens / mesh.tp)


@typed
def local_rows(x_TH: Shaped[Tensor, "T *rest"], mesh: Mesh) -> Shaped[Tensor, "t *rest"]:
    """This rank's rows of a DP group's [T, H] tensor, zero-padded to t rows."""
    if mesh.tp == 1:
        return x_TH
    t = rows_per_rank(x_TH.shape[0], mesh)
    part = x_TH[mesh.tp_rank * t:(mesh.tp_rank + 1) * t]
    return torch.cat([part, part.new_zeros(t - part.shape[0], *part.shape[1:])]) if part.shape[0] < t else part


def num_valid_rows(num_tokens: int, mesh: Mesh) -> int:
    """How many of this rank's t rows are real tokens (the rest are padding)."""
    t = rows_per_rank(num_tokens, mesh)
    return max(0, min(t, num_tokens - mesh.tp_rank * t))


@typed
def gather_tokens(
    h_tH: Shaped[Tensor, "t *rest"], mesh: Mesh, num_tokens: int, fp8: bool = False
) -> Shaped[Tensor, "T *rest"] | QActs:
    """[t, H] per rank -> the DP group's [T, H] on every TP rank; with fp8 (the attention
    input) in the mesh's attn_gather format."""
    if mesh.tp == 1:
        return h_tH
    if not fp8 or mesh.attn_gather == "bf16":
        return all_gather(h_tH, mesh.tp_group)[:num_tokens]
    gather = all_gather_packed_fp8 if mesh.attn_gather == "packed_fp8" else all_gather_fp8_two_collectives
    q_MH, scale_MG = gather(h_tH, mesh.tp_group)
    return QActs(q_MH[:num_tokens], scale_MG[:num_tokens], h_tH.dtype)


@typed
def scatter_tokens(y_TH: Float[Tensor, "T H"], mesh: Mesh) -> Float[Tensor, "t H"]:
    """Partial sums [T, H] on every TP rank -> this rank's summed rows [t, H]."""
    if mesh.tp == 1:
        return y_TH
    t = rows_per_rank(y_TH.shape[0], mesh)
    pad = t * mesh.tp - y_TH.shape[0]
    if pad:
        y_TH = torch.cat([y_TH, y_TH.new_zeros(pad, *y_TH.shape[1:])])
    return reduce_scatter(y_TH, mesh.tp_group, mesh.force_fallback)
