"""The device mesh: DP attention groups x attention-TP ranks, and expert parallelism across them.

World ranks are laid out dp-major: rank = dp_rank * tp + tp_rank. A TP group is one DP
group's ranks (they split its tokens and its attention heads); the EP axis spans `ep`
consecutive ranks (all of them in the production layout DP2 / TP4 / EP8), and experts are
replicated world/ep times when ep < world.

`Mesh.single()` is the default 1-rank mesh: every collective on it is the identity and no
process group exists, so it costs nothing.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mimo_fn._types import typed
from mimo_fn.config import ModelConfig
from mimo_fn.parallel.collectives import all_gather_ints


GATHER_MODES = ("bf16", "packed_fp8", "fp8_two")
EP_DISPATCH_MODES = ("all_to_all", "gather")


@dataclass(frozen=True)
class Mesh:
    dp: int
    tp: int
    ep: int
    rank: int  # world rank
    tp_group: Any = None  # ProcessGroup of this rank's DP group (None when tp == 1)
    ep_group: Any = None  # ProcessGroup of this rank's EP group (None when ep == 1)
    dp_group: Any = None  # ranks with the same tp_rank, one per DP group (None when dp == 1)
    force_fallback: bool = False  # all_reduce + rows wherever reduce_scatter could run (tests)
    fake_balanced_routing: bool = False  # benchmark only: uniform expert choice
    # most token rows one rank may receive per MoE layer: (token, expert) copies for its experts under
    # "all_to_all", the ep x rows it gathers under "gather"; over it, EPCapacityError on every EP rank
    ep_capacity: int | None = None
    attn_gather: str = "bf16"  # TP gather of the attention input: "bf16", "packed_fp8" or "fp8_two"
    # how MoE rows reach their experts' ranks: "gather" all-gathers the EP group's rows and
    # reduce-scatters the outputs (parallel/ep_gather.py: fixed sizes, no host sync, so decode
    # steps on a mesh replay CUDA graphs); "all_to_all" sends each (token, k) copy to its
    # expert's owner (parallel/ep.py: a host sync per layer). On
    # 2 H200s (EP2, docs/benchmarks.md) "gather" prefilled 16K tokens per DP group 1.4-1.5x
    # faster; with top-8 routing on EP8 both send about 7 rows per token to other ranks
    ep_dispatch: str = "gather"
    # a gloo group over every rank (None on one rank), for agreements of a few host ints that
    # must not wait behind the GPU stream (graph shapes, row counts, the engine's pass plans)
    host_group: Any = None

    @classmethod
    def single(cls) -> "Mesh":
        return cls(1, 1, 1, 0)

    def agree_ints(self, values: list[int], device) -> list[list[int]]:
        """Every rank's list of ints (same length everywhere), in world-rank order: over the
        host group where there is one (no wait for the GPU), else over the world on `device`."""
        if self.host_group is not None:
            return all_gather_ints(values, self.host_group, torch.device("cpu"))
        return all_gather_ints(values, dist.group.WORLD, device)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def validate(self, cfg: ModelConfig) -> None:
        """Check that heads and experts divide over this mesh."""
        if cfg.num_heads % self.tp:
            raise ValueError(f"mesh tp={self.tp}: num_heads={cfg.num_heads} must divide by tp")
        for name in ("num_kv_heads", "num_swa_kv_heads"):
            g = getattr(cfg, name)
            if g % self.tp and self.tp % g:
                raise ValueError(f"mesh tp={self.tp}: {name}={g} must divide by tp or divide tp "
                                 "(KV heads are split, or replicated when tp exceeds them)")
        if cfg.num_experts % self.ep:
            raise ValueError(f"mesh ep={self.ep}: num_experts={cfg.num_experts} must divide by ep")


@typed
def init_mesh(dp: int = 1, tp: int = 1, ep: int = 1, *, force_fallback: bool = False,
              fake_balanced_routing: bool = False, ep_capacity: int | None = None,
              attn_gather: str = "bf16", ep_dispatch: str = "gather") -> Mesh:
    """Build the mesh over an initialised torch.distributed world (torchrun), or the 1-rank mesh."""
    if attn_gather not in GATHER_MODES:
        raise ValueError(f"init_mesh: attn_gather={attn_gather!r}, expected one of {GATHER_MODES}")
    if ep_dispatch not in EP_DISPATCH_MODES:
        raise ValueError(f"init_mesh: ep_dispatch={ep_dispatch!r}, expected one of {EP_DISPATCH_MODES}")
    if ep_capacity is not None and (not isinstance(ep_capacity, int) or ep_capacity <= 0):
        raise ValueError(f"init_mesh: ep_capacity={ep_capacity!r}, expected a positive int or None")
    for name, v in (("dp", dp), ("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"init_mesh: {name}={v!r}, expected a positive int")
    if dp * tp == 1 and ep == 1:
        return Mesh(1, 1, 1, 0, force_fallback=force_fallback, fake_balanced_routing=fake_balanced_routing,
                    ep_capacity=ep_capacity, attn_gather=attn_gather, ep_dispatch=ep_dispatch)
    if not dist.is_initialized():
        raise ValueError(f"init_mesh(dp={dp}, tp={tp}, ep={ep}) needs an initialised torch.distributed "
                         "world (run under torchrun, or call init_process_group first)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp * tp != world:
        raise ValueError(f"init_mesh: dp*tp = {dp}*{tp} = {dp * tp}, expected the world size {world}")
    if world % ep:
        raise ValueError(f"init_mesh: ep={ep} must divide the world size {world}")
    # Every rank must create every group, in the same order.
    tp_group = ep_group = dp_group = None
    for d in range(dp):
        g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
        if rank // tp == d:
            tp_group = g
    for e in range(world // ep):
        g = dist.new_group(list(range(e * ep, (e + 1) * ep)))
        if rank // ep == e:
            ep_group = g
    for t in range(tp):
        g = dist.new_group(list(range(t, world, tp)))
        if rank % tp == t:
            dp_group = g
    host_group = dist.new_group(list(range(world)), backend="gloo")
    return Mesh(dp, tp, ep, rank, tp_group if tp > 1 else None, ep_group if ep > 1 else None,
                dp_group if dp > 1 else None, force_fallback, fake_balanced_routing, ep_capacity, attn_gather,
                ep_dispatch, host_group)
