"""In-place weight sync for colocated RL: new trainer weights land in the engine's existing storage.

The trainer sends (hub name, full tensor) pairs, in the names `save_pretrained` writes
(`model.layers.3.mlp.experts.7.up_proj.weight`, ...). Each lands in the tensor that
already holds it, with `copy_`, so every data_ptr stays where it was (CUDA graphs and
anything else holding the buffers stay valid). Under a mesh a rank keeps only its slice.
Quantised weights are re-quantised in their own format (FP8 blocks, or MXFP4 for the RL
release's experts) into their existing data and scale buffers. One expert projection of an
FP8 stack covers whole 128-row blocks of scales; of an MXFP4 stack, its own rows (per-row scales).
"""

import re
from collections.abc import Iterable, Mapping

import torch

from mimo_fn._types import typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.weight_quant import quantize_into
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import Params, describe, to_flat
from mimo_fn.quant import BLOCK, FP8_BLOCK, MXFP4, QTensor

_QUANTIZERS = (FP8_BLOCK, MXFP4)  # the formats update_weights re-quantises into


_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # the expert number in a hub name


def _targets(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Hub name (an expert's with "{e}" for its number) -> (weight path, which part of a
    concatenation, parts). A dict: one lookup a name, where matching every name against every
    pattern took ~2 s for the 36,523 names of the released model."""
    return {key: (path, j, len(info.hub)) for path, info in describe(cfg).items() for j, key in enumerate(info.hub)}


def hub_names(cfg: ModelConfig, mesh: Mesh | None = None) -> set[str]:
    """Every hub name `update_weights` writes on this rank: all of them, except other EP ranks' experts."""
    mesh = mesh or Mesh.single()
    names = set()
    for path, info in describe(cfg).items():
        for key in info.hub:
            if "{e}" not in key:
                names.add(key)
                continue
            sl = slice_of(path, info.shape, cfg, mesh)
            experts = range(sl[1], sl[2]) if sl else range(info.shape[0])
            names.update(key.replace("{e}", str(e)) for e in experts)
    return names


def hub_tensors(params: Params, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(hub name, tensor) for every weight of dense (unquantised, unsharded) params, as
    save_checkpoint names them and update_weights takes them: what a trainer sends to sync an
    engine. Each tensor is a detached view of the params' storage (an expert's gate or up rows
    of w13, its w2), so nothing is copied here."""
    flat, out = to_flat(params), []
    for path, info in describe(cfg).items():
        w = flat[path]
        if isinstance(w, QTensor):
            raise ValueError(f"hub_tensors: {path!r} is a {w.fmt!r} QTensor; expected the dense weights of a trainer")
        w = w.detach()
        if w.dim() < 3:
            out.append((info.hub[0], w))
            continue
        rows = w.shape[1] // len(info.hub)  # w13: gate rows, then up rows
        out += [(key.replace("{e}", str(e)), w[e, j * rows:(j + 1) * rows])
                for e in range(w.shape[0]) for j, key in enumerate(info.hub)]
    return out


def _write(dst: torch.Tensor | QTensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"update_weights: {name!r} has shape {list(src.shape)}, this engine holds "
                         f"{list(dst.shape)} there")
    if isinstance(dst, QTensor):  # one kernel a matrix on CUDA (kernels.weight_quant), into dst's buffers
        src = src.to(device=dst.data.device)
        quantize_into(src if src.is_floating_point() else src.float(), dst)
    else:
        dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


def named_pairs(named) -> list[tuple[str, torch.Tensor]]:
    """(hub name, tensor) pairs from an iterable of pairs or a mapping (a state_dict); a ValueError
    names the first entry that is no such pair."""
    items = list(named.items() if isinstance(named, Mapping) else named)
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            what = (f"({type(item[0]).__name__}, {type(item[1]).__name__})"
                    if isinstance(item, (tuple, list)) and len(item) == 2 else type(item).__name__)
            raise ValueError(f"update_weights: entry {i} is a {what}; expected (hub name, tensor) pairs, or a "
                             "dict of them")
    return [tuple(item) for item in items]


def _castable(src: torch.Tensor, name: str) -> torch.Tensor:
    """src, if the engine's weights can take its values: a dense floating-point tensor with data
    (a ValueError naming it otherwise, before anything is written)."""
    if src.layout != torch.strided or src.is_meta:
        raise ValueError(f"update_weights: {name!r} is a {src.layout} tensor on {src.device}; expected a dense "
                         "tensor with data")
    if not src.is_floating_point():
        raise ValueError(f"update_weights: {name!r} has dtype {src.dtype}; expected a floating-point tensor "
                         "(the trainer's weights, e.g. bfloat16 or float32)")
    try:  # packed or scale-only dtypes (float4, e8m0) hold no values a copy could take
        src.reshape(-1)[:1].to(torch.float32)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"update_weights: {name!r} has dtype {src.dtype}, which cannot be cast to the "
                         f"weights' dtype ({e})") from None
    return src


def plan_params(params: Params, cfg: ModelConfig, new: Params) -> list:
    """What write_planned writes to turn `params` into `new` (the same model on the same mesh, e.g.
    load_checkpoint(..., mesh=mesh, quant="dequantize")), or a ValueError naming the first weight
    whose shape differs. Quantised weights of `params` are re-quantised from `new`'s values."""
    flat, src = to_flat(params), to_flat(new)
    plan = []
    for path, info in describe(cfg).items():
        dst, s = flat[path], src[path]
        name = info.hub[0].replace("{e}", "*")
        if isinstance(s, QTensor):
            raise ValueError(f"update_weights: the new {name!r} is a {s.fmt} QTensor; expected dense values")
        if tuple(s.shape) != tuple(dst.shape):
            raise ValueError(f"update_weights: the new {name!r} has shape {list(s.shape)} on this rank, this engine "
                             f"holds {list(dst.shape)}")
        _castable(s, name)
        if len(info.shape) == 3:  # a stack of experts: one matrix each (the quantisers take matrices)
            plan += [(None, 0, 0, QTensor(dst.data[e], dst.scale[e], dst.fmt) if isinstance(dst, QTensor) else dst[e],
                      s[e], name) for e in range(dst.shape[0])]
        else:
            plan.append((None, 0, 0, dst, s, name))
    return plan


@typed
def update_weights(
    params: Params, cfg: ModelConfig,
    named: Iterable,  # (hub name, tensor) pairs or a {name: tensor} mapping: named_pairs checks each entry
    mesh: Mesh | None = None,
) -> int:
    """Write full-size hub-named tensors into `params` in place; returns how many were written.
    An unknown name or a wrong shape raises ValueError before anything is written."""
    return write_planned(plan_update(params, cfg, named, mesh))


def plan_update(
    params: Params, cfg: ModelConfig, named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    mesh: Mesh | None = None,
) -> list:
    """update_weights' checks, nothing written: what write_planned writes (this rank's pairs), or a
    ValueError naming the first bad one."""
    mesh = mesh or Mesh.single()
    flat = to_flat(params)
    infos = describe(cfg)
    targets = _targets(cfg)
    plan = []
    for name, src in named_pairs(named):
        src = _castable(src.detach(), name)  # a trainer's parameter: no autograd history into the engine
        m = _EXPERT.search(name)
        hit = targets.get(name if m is None else _EXPERT.sub(".experts.{e}.", name, count=1))
        if hit is None:
            raise ValueError(f"update_weights: unknown weight {name!r}; expected hub names such as "
                             f"{infos['layers.0.attn.wq'].hub[0]!r}")
        path, j, parts = hit
        info, dst = infos[path], flat[path]
        if isinstance(dst, QTensor) and dst.fmt not in _QUANTIZERS:
            raise ValueError(f"update_weights: {name!r} is held as a {dst.fmt!r} QTensor; expected one of "
                             f"{list(_QUANTIZERS)}")
        full_shape = list(info.shape)
        if len(full_shape) == 3:  # one expert's gate/up/down slice of a stacked expert weight
            expert, rows = int(m.group(1)), full_shape[1] // parts
            if expert >= full_shape[0]:
                raise ValueError(f"update_weights: {name!r} names expert {expert}; the model has {full_shape[0]}")
            sl = slice_of(path, info.shape, cfg, mesh)
            first = sl[1] if sl else 0
            if list(src.shape) != [rows, full_shape[2]]:
                raise ValueError(f"update_weights: {name!r} has shape {list(src.shape)}, expected "
                                 f"{[rows, full_shape[2]]}")
            if sl and not sl[1] <= expert < sl[2]:
                continue  # another EP rank's expert
            if isinstance(dst, QTensor) and dst.fmt == FP8_BLOCK and rows % BLOCK:
                raise ValueError(f"update_weights: FP8 {name!r} has {rows} rows, not whole {BLOCK}-row blocks")
            plan.append((expert - first, j * rows, rows, dst, src, name))
            continue
        if list(src.shape) != full_shape:
            raise ValueError(f"update_weights: {name!r} has shape {list(src.shape)}, expected {full_shape}")
        sl = slice_of(path, info.shape, cfg, mesh)
        if sl is not None:
            src = src.narrow(sl[0], sl[1], sl[2] - sl[1])
        plan.append((None, 0, 0, dst, src, name))
    return plan


def write_planned(plan: list) -> int:
    """Write what plan_update checked; returns how many tensors."""
    for expert, row0, rows, dst, src, name in plan:
        if expert is None:
            _write(dst, src, name)
        elif isinstance(dst, QTensor):  # views into the stacked data and scales
            per = BLOCK if dst.fmt == FP8_BLOCK else 1  # rows per scale row: 128x128 blocks, or MXFP4's rows
            scale_rows = slice(row0 // per, (row0 + rows) // per)
            _write(QTensor(dst.data[expert, row0:row0 + rows], dst.scale[expert, scale_rows], dst.fmt), src, name)
        else:
            _write(dst[expert, row0:row0 + rows], src, name)
    return len(plan)
