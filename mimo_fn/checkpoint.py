"""safetensors checkpoints in the hub layout that transformers' save_pretrained writes.

Per layer: `self_attn.{q,k,v,o}_proj.weight`, `self_attn.attention_sink_bias` (SWA layers),
`mlp.{gate,up,down}_proj.weight` (dense) or `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (MoE).
One file, or several with `model.safetensors.index.json`. Multi-token-prediction tensors
(`model.mtp.*`) are skipped and reported; any other unknown tensor is an error.
"""

import json
import logging
import os
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mimo_fn.config import ModelConfig
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import Params, WeightInfo, describe, from_flat, to_flat

log = logging.getLogger("mimo_fn")

SKIPPED_PREFIXES = ("model.mtp.",)  # MTP draft layers: not part of the main model


def _list_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r}: expected a directory with config.json and *.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"checkpoint {path!r}: no *.safetensors files")
    missing = [n for n in names if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise ValueError(f"checkpoint {path!r}: files named in the index are missing: {missing}")
    return [os.path.join(path, n) for n in names]


class _Reader:
    """All tensors of a checkpoint by key, read lazily; remembers which keys were used."""

    def __init__(self, files: list[str], stack: ExitStack, progress: bool):
        self.handles: dict[str, Any] = {}
        for fn in tqdm(files, desc="indexing checkpoint", disable=not progress or len(files) < 2):
            h = stack.enter_context(safe_open(fn, framework="pt"))
            for k in h.keys():
                self.handles[k] = h
        self.used: set[str] = set()

    def get(self, key: str, shape: tuple[int, ...], sl: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor (or only its slice (dim, start, stop): a rank reads just its shard)."""
        if key not in self.handles:
            raise ValueError(f"checkpoint is missing tensor {key!r} (expected shape {list(shape)})")
        view = self.handles[key].get_slice(key)
        if tuple(view.get_shape()) != tuple(shape):
            raise ValueError(f"checkpoint tensor {key!r} has shape {list(view.get_shape())}, expected {list(shape)}")
        self.used.add(key)
        if sl is None:
            return view[:]
        dim, start, stop = sl
        return view[(slice(None),) * dim + (slice(start, stop),)]


def _read_weight(r: _Reader, info: WeightInfo, sl: tuple[int, int, int] | None) -> torch.Tensor:
    if len(info.shape) == 3:  # expert stack: per-expert tensors, gate and up concatenated
        num_experts, rows, cols = info.shape
        per_key = rows // len(info.hub)
        first, last = (sl[1], sl[2]) if sl is not None else (0, num_experts)
        assert sl is None or sl[0] == 0, "expert stacks split over experts only"
        r.used.update(k.format(e=e) for k in info.hub for e in range(num_experts))  # others' experts: not ours
        return torch.stack([
            torch.cat([r.get(k.format(e=e), (per_key, cols)) for k in info.hub]) for e in range(first, last)
        ])
    return r.get(info.hub[0], info.shape, sl)


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = True,
    mesh: Mesh | None = None,
) -> tuple[ModelConfig, Params]:
    """Read config.json and the safetensors weights of a hub-layout checkpoint directory.
    With a mesh, each rank reads only its own slices (parallel/sharding.py's rule table)."""
    path = os.fspath(path)
    cfg = ModelConfig.from_hf(path)
    mesh = mesh or Mesh.single()
    mesh.validate(cfg)
    files = _list_files(path)
    flat = {}
    with ExitStack() as stack:
        r = _Reader(files, stack, progress)
        infos = describe(cfg)
        for name, info in tqdm(infos.items(), desc="loading weights", disable=not progress or len(files) < 2):
            t = _read_weight(r, info, slice_of(name, info.shape, cfg, mesh))
            flat[name] = t.to(device=device, dtype=torch.float32 if info.fp32 else dtype)
        left = sorted(set(r.handles) - r.used)
    skipped = [k for k in left if k.startswith(SKIPPED_PREFIXES)]
    unknown = [k for k in left if not k.startswith(SKIPPED_PREFIXES)]
    if unknown:
        raise ValueError(f"checkpoint {path!r} holds {len(unknown)} tensors this config does not use, "
                         f"e.g. {unknown[:5]}: expected only the hub MiMo-V2-Flash layout")
    if skipped:
        log.warning("checkpoint %s: skipped %d multi-token-prediction tensors (%s...)", path, len(skipped), skipped[0])
    return cfg, from_flat(cfg, flat)


def save_checkpoint(
    params: Params, cfg: ModelConfig, path: str | os.PathLike, max_shard_bytes: int | None = None
) -> None:
    """Write config.json and safetensors in the hub layout (sharded with an index past max_shard_bytes)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    flat = to_flat(params)
    for name, info in describe(cfg).items():
        t = flat[name].detach().to("cpu")
        if t.dim() == 3:
            per_key = t.shape[1] // len(info.hub)
            for e in range(t.shape[0]):
                for j, k in enumerate(info.hub):
                    tensors[k.format(e=e)] = t[e, j * per_key:(j + 1) * per_key].contiguous()
        else:
            tensors[info.hub[0]] = t.contiguous()
    hf = cfg.to_hf()
    hf["dtype"] = str(params.embed.dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
