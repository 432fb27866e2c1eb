"""Functional collectives over one mesh axis's process group: inputs are never modified.

Every op takes (tensor, group) and returns a new tensor. A group of None means a 1-rank
axis: the op is the identity. Where a backend lacks an op, a fallback does the same
thing with the ops it has; `force_fallback` makes tests exercise it.
"""

from typing import Any

import torch
import torch.distributed as dist

from mimo_fn._types import Shaped, Tensor, typed


# torch 2.13 renamed all_gather_into_tensor; 2.11 has only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


@typed
def reduce_scatter(x: Shaped[Tensor, "n *rest"], group: Any, force_fallback: bool = False) -> Shaped[Tensor, "m *rest"]:
    """Sum x over ranks and keep this rank's 1/n slice of dim 0 (dim 0 must divide by n)."""
    n = _size(group)
    if n == 1:
        return x
    assert x.shape[0] % n == 0, f"reduce_scatter: dim 0 ({x.shape[0]}) must divide by the group size {n}"
    rows = x.shape[0] // n
    if force_fallback:  # all_reduce + slice: for backends without reduce_scatter
        r = dist.get_rank(group)
        return all_reduce(x, group)[r * rows:(r + 1) * rows].contiguous()
    out = x.new_empty(rows, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


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
