"""The delayer's one collective: gather every DP rank's record, in rank order.

Legend: N = DP ranks, F = record fields.

A GatherFn maps this rank's record_F to records_NF (row i = rank i). The scheduler
calls it exactly once per pass on every rank, prefilling or not, so the collective
always matches up. Two implementations:
  local_gather       one rank: the identity (plus the leading axis)
  dist_gather(group) torch.distributed.all_gather of a small int64 tensor over `group`,
                     whose ranks are the DP ranks in order (one member per DP rank:
                     pass the group of attention-TP rank 0s, or gather over the full
                     group and take one row per DP rank yourself)
Use a CPU (gloo) group where there is one: the record is a few integers and the
decision is read on the host anyway, so a device collective would only add a sync.
"""

from typing import Callable

import torch
import torch.distributed as dist

from mimo_fn._types import Int, Tensor, typed

GatherFn = Callable[[Tensor], Tensor]


@typed
def local_gather(record_F: Int[Tensor, " F"]) -> Int[Tensor, "1 F"]:
    return record_F[None]


def dist_gather(group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu") -> GatherFn:
    """A GatherFn over `group` (None = the default group). `device` is where the
    collective runs: "cpu" for gloo, the local CUDA device for an NCCL group."""

    @typed
    def gather(record_F: Int[Tensor, " F"]) -> Int[Tensor, "N F"]:
        record_F = record_F.to(device)
        out = [torch.empty_like(record_F) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, record_F, group=group)
        return torch.stack(out).cpu()

    return gather
