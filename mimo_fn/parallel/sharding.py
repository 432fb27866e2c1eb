"""Placements as data: one rule table says how every weight is laid over the mesh.

A weight is either replicated or split on one tensor dim over one mesh axis, in whole
units (a head's rows, or one expert). When an axis has more ranks than there are units
(tp 4 over 2 KV heads, say) each rank holds the one unit its heads need: the unit is
replicated, as KV heads are in SGLang / vLLM when tp exceeds them.

Layout (DP attention + EP):
| weight                        | placement                          |
|-------------------------------|------------------------------------|
| attn.wq, attn.wk              | split dim 0 over tp, unit head_dim |
| attn.wv                       | split dim 0 over tp, unit v_head_dim |
| attn.wo                       | split dim 1 over tp, unit v_head_dim |
| attn.sinks                    | split dim 0 over tp, unit 1        |
| mlp.w13, mlp.w2 (experts)     | split dim 0 over ep, unit 1 expert |
| everything else               | replicated                         |
"""

import re
from dataclasses import dataclass

import torch

from mimo_fn.config import ModelConfig
from mimo_fn.params import Params, from_flat, to_flat
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.quant import QTensor


@dataclass(frozen=True)
class Split:
    dim: int
    axis: str  # "tp" or "ep"
    unit: str  # "head_dim", "v_head_dim" or "one": rows per indivisible unit


RULES: tuple[tuple[str, Split], ...] = (
    (r"layers\.\d+\.attn\.w[qk]$", Split(0, "tp", "head_dim")),
    (r"layers\.\d+\.attn\.wv$", Split(0, "tp", "v_head_dim")),
    (r"layers\.\d+\.attn\.wo$", Split(1, "tp", "v_head_dim")),
    (r"layers\.\d+\.attn\.sinks$", Split(0, "tp", "one")),
    (r"layers\.\d+\.mlp\.w(13|2)$", Split(0, "ep", "one")),
)


def placement(path: str) -> Split | None:
    """The rule for a weight path; None means replicated."""
    for pattern, split in RULES:
        if re.search(pattern, path):
            return split
    return None


def local_range(size: int, unit: int, n: int, r: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim of `size` rows held by rank r of n, in whole units."""
    units = size // unit
    if units >= n:
        if units % n:
            raise ValueError(f"cannot split {units} units of {unit} rows over {n} ranks evenly")
        per = units // n
        return r * per * unit, (r + 1) * per * unit
    u = r * units // n  # more ranks than units: neighbouring ranks share (replicate) one unit
    return u * unit, (u + 1) * unit


def slice_of(path: str, shape: tuple[int, ...], cfg: ModelConfig, mesh: Mesh) -> tuple[int, int, int] | None:
    """(dim, start, stop) of this rank's slice of a weight, or None when it is replicated."""
    split = placement(path)
    if split is None:
        return None
    n, r = (mesh.tp, mesh.tp_rank) if split.axis == "tp" else (mesh.ep, mesh.ep_rank)
    if n == 1:
        return None
    unit = {"head_dim": cfg.head_dim, "v_head_dim": cfg.v_head_dim, "one": 1}[split.unit]
    return (split.dim, *local_range(shape[split.dim], unit, n, r))


def _take(t: torch.Tensor, sl: tuple[int, int, int]) -> torch.Tensor:
    dim, start, stop = sl
    return t.narrow(dim, start, stop - start).clone()  # a copy: the full tensor's memory can go


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """This rank's slices of full (replicated) params. Quantised expert stacks split over
    experts; any other quantised weight with a split is a ValueError (shard, then quantise)."""
    mesh.validate(cfg)
    flat = {}
    for path, w in to_flat(params).items():
        sl = slice_of(path, tuple(w.shape), cfg, mesh)
        if sl is None:
            flat[path] = w
        elif isinstance(w, QTensor) and sl[0] == 0 and w.data.dim() == 3:
            # an expert stack split over experts: data and scales (FP8 or MXFP4) lead with the experts
            flat[path] = QTensor(_take(w.data, sl), _take(w.scale, sl), w.fmt)
        elif isinstance(w, QTensor):
            raise ValueError(f"shard_params: weight {path!r} is quantised ({w.fmt}); shard it before "
                             "quantising, or quantise after sharding")
        else:
            flat[path] = _take(w, sl)
    return from_flat(cfg, flat)
