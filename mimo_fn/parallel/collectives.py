"""Functional collectives over one mesh axis's process group: inputs are never modified.

Every op takes (tensor, group) and returns a new tensor. A group of None means a 1-rank
axis: the op is the identity.

`reduce_scatter` picks its path from what the group can do (`reduce_scatter_path`): one
reduce_scatter_tensor where it can, else an all-reduce and this rank's rows, the same sums
with the op every backend has. It takes the all-reduce when the group's backend has no
reduce_scatter_tensor (older gloo, MPI: the first call finds out, and every later call on
that backend goes straight to the all-reduce), when dim 0 does not divide by the group size,
under CUDA graph capture (the reference engine's rule for the attention-TP reduce-scatter), or
when forced (Mesh.force_fallback, for tests).
"""

from typing import Any

import torch
import torch.distributed as dist

from mimo_fn._types import Shaped, Tensor, typed


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor; 2.11 has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

RS_PATHS = ("reduce_scatter", "all_reduce")  # how reduce_scatter sums: one collective, or all-reduce + rows
_NO_REDUCE_SCATTER: set[tuple[str, str]] = set()  # (backend, device type) found to lack reduce_scatter_tensor


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@typed
def all_gather(x: Shaped[Tensor, "n *rest"], group: Any) -> Shaped[Tensor, "m *rest"]:
    """Concatenate every rank's x along dim 0 (same shape on every rank), in rank order."""
    n = _size(group)
    if n == 1:
        return x
    out = x.new_empty(n * x.shape[0], *x.shape[1:])
    _all_gather_single(out, x.contiguous(), group=group)
    return out


@typed
def all_reduce(x: Shaped[Tensor, "*shape"], group: Any) -> Shaped[Tensor, "*shape"]:
    if _size(group) == 1:
        return x
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _backend_key(x: torch.Tensor, group: Any) -> tuple[str, str]:
    return str(dist.get_backend(group)), x.device.type


def _unsupported(err: Exception) -> bool:
    """Whether a collective failed because the backend lacks the op: c10d raises that on every
    rank before any data moves, so all ranks can take the other path together."""
    return isinstance(err, NotImplementedError) or "does not support" in str(err)


def reduce_scatter_path(x: torch.Tensor, group: Any, force_fallback: bool = False) -> str:
    """The way `reduce_scatter` sums x over the group (one of RS_PATHS); see the module docstring.
    Every input of the choice is the same on every rank of the group."""
    n = _size(group)
    if (force_fallback or x.shape[0] % n or _capturing()
            or (n > 1 and _backend_key(x, group) in _NO_REDUCE_SCATTER)):
        return "all_reduce"
    return "reduce_scatter"


@typed
def reduce_scatter(x: Shaped[Tensor, "n *rest"], group: Any, force_fallback: bool = False) -> Shaped[Tensor, "m *rest"]:
    """Sum x over ranks and keep this rank's slice of dim 0: rows [r*m, (r+1)*m) with m = ceil(n /
    size), zero-padded past n (as if x were padded to a multiple of the group size first)."""
    size = _size(group)
    if size == 1:
        return x
    rows = -(-x.shape[0] // size)
    if reduce_scatter_path(x, group, force_fallback) == "reduce_scatter":
        out = x.new_empty(rows, *x.shape[1:])
        try:
            _reduce_scatter_single(out, x.contiguous(), group=group)
            return out
        except (RuntimeError, NotImplementedError) as err:
            if not _unsupported(err):
                raise
            _NO_REDUCE_SCATTER.add(_backend_key(x, group))
    r = dist.get_rank(group)
    mine = all_reduce(x, group)[r * rows:(r + 1) * rows]
    if mine.shape[0] < rows:
        return torch.cat([mine, mine.new_zeros(rows - mine.shape[0], *mine.shape[1:])])
    return mine.contiguous()


@typed
def all_to_all(
    x: Shaped[Tensor, "S *rest"], send_counts: list[int], recv_counts: list[int], group: Any
) -> Shaped[Tensor, "R *rest"]:
    """Send rows send_counts[r] to rank r (in order) and receive recv_counts[r] rows from it."""
    if _size(group) == 1:
        return x
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's list of ints (same length everywhere), in rank order. A host sync."""
    n = _size(group)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    if n == 1:
        return [values]
    return all_gather(t, group).view(n, -1).tolist()
