"""safetensors checkpoints in the hub layout that transformers' save_pretrained writes.

Per layer: `self_attn.{q,k,v,o}_proj.weight`, `self_attn.attention_sink_bias` (SWA layers),
`mlp.{gate,up,down}_proj.weight` (dense) or `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (MoE).
One file, or several with `model.safetensors.index.json`. Multi-token-prediction tensors
(`model.mtp.*`) are skipped and reported; any other unknown tensor is an error. A layer may
instead store its attention input projections fused, `self_attn.qkv_proj.weight`: the q rows,
then the k rows, then the v rows (`save_checkpoint(fused_qkv=True)` writes that layout).

FP8 checkpoints (the released layout): a GEMM weight `X.weight` stored as float8_e4m3fn
comes with `X.weight_scale_inv`, fp32 [ceil(N/128), ceil(K/128)], the multiplier of each
128x128 block, and config.json carries `quantization_config.weight_block_size: [128, 128]`.
Such weights load as QTensors and stay FP8. A rank whose shard cuts through 128-row
blocks (one 192-row KV head of a k_proj, say) gets that shard dequantised instead. In a fused
qkv_proj the blocks are those of the whole matrix, so q, k and v are row ranges of it, read
like such shards (at the released dims every boundary falls on a block: they stay FP8).
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
from mimo_fn.params import Params, WeightInfo, describe, from_flat, to_flat, weight_dtype
from mimo_fn.quant import BLOCK, FP8_BLOCK, QTensor, dequantize, quantize_fp8_block

QUANT_MODES = ("auto", "fp8", "dequantize")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

log = logging.getLogger("mimo_fn")

SKIPPED_PREFIXES = ("model.mtp.",)  # MTP draft layers: not part of the main model
_QKV = ("q_proj", "k_proj", "v_proj")  # in their order inside a fused qkv_proj


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


def _read_matrix(r: _Reader, key: str, shape: tuple[int, int], sl) -> torch.Tensor | QTensor:
    """One [N, K] weight (or this rank's slice of it): a QTensor when stored as FP8 + scales."""
    scale_key = key + "_scale_inv"
    if scale_key not in r.handles:
        return r.get(key, shape, sl)
    grid = (_cdiv(shape[0], BLOCK), _cdiv(shape[1], BLOCK))
    data = r.get(key, shape, sl)
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {key!r} has a {scale_key!r} but dtype {data.dtype}, expected float8_e4m3fn")
    if sl is None:
        return QTensor(data, r.get(scale_key, grid), FP8_BLOCK)
    dim, start, stop = sl
    block_sl = (dim, start // BLOCK, _cdiv(stop, BLOCK))
    scale = r.get(scale_key, grid, block_sl)
    if start % BLOCK == 0 and (stop % BLOCK == 0 or stop == shape[dim]):
        return QTensor(data, scale, FP8_BLOCK)
    # the shard cuts through blocks: expand each row's (or column's) block scale and dequantise
    idx = torch.arange(start, stop) // BLOCK - start // BLOCK
    scale = scale.index_select(dim, idx).repeat_interleave(BLOCK, dim=1 - dim)
    scale = scale[:, :data.shape[1]] if dim == 0 else scale[:data.shape[0], :]
    return data.float() * scale


def _cat_rows(parts: list) -> torch.Tensor | QTensor:
    if not isinstance(parts[0], QTensor):
        return torch.cat(parts)
    if any(p.data.shape[0] % BLOCK for p in parts[:-1]):
        raise ValueError(f"FP8 expert weights with {parts[0].data.shape[0]} rows per projection: gate and up "
                         f"concatenate only in whole {BLOCK}-row blocks")
    return QTensor(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), FP8_BLOCK)


def _stack(parts: list) -> torch.Tensor | QTensor:
    if not isinstance(parts[0], QTensor):
        return torch.stack(parts)
    return QTensor(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), FP8_BLOCK)


def _fused_qkv_sources(r: _Reader, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int], int]]:
    """For each layer stored with a fused `self_attn.qkv_proj.weight`: its q/k/v hub keys ->
    (the fused key, the fused matrix's shape, the first row of that projection in it)."""
    H, N, D, Ev = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.v_head_dim
    out = {}
    for i in range(cfg.num_layers):
        h = f"model.layers.{i}.self_attn."
        fused = h + "qkv_proj.weight"
        if fused not in r.handles:
            continue
        split = [h + f"{k}.weight" for k in _QKV if h + f"{k}.weight" in r.handles]
        if split:
            raise ValueError(f"checkpoint holds both {fused!r} and {split[0]!r}: expected one layout per layer")
        G = cfg.kv_heads(i)
        rows = (N * D, G * D, G * Ev)
        for j, key in enumerate(_QKV):
            out[h + f"{key}.weight"] = (fused, (sum(rows), H), sum(rows[:j]))
    return out


def _read_weight(r: _Reader, info: WeightInfo, sl: tuple[int, int, int] | None,
                 fused: dict[str, tuple[str, tuple[int, int], int]]) -> torch.Tensor | QTensor:
    if len(info.shape) == 3:  # expert stack: per-expert tensors, gate and up concatenated
        num_experts, rows, cols = info.shape
        per_key = rows // len(info.hub)
        first, last = (sl[1], sl[2]) if sl is not None else (0, num_experts)
        assert sl is None or sl[0] == 0, "expert stacks split over experts only"
        r.used.update(k.format(e=e) + sfx for k in info.hub for e in range(num_experts)  # others' experts
                      for sfx in ("", "_scale_inv") if k.format(e=e) + sfx in r.handles)
        return _stack([
            _cat_rows([_read_matrix(r, k.format(e=e), (per_key, cols), None) for k in info.hub])
            for e in range(first, last)
        ])
    if len(info.shape) == 2 and info.hub[0] in fused:  # rows [first, first + n) of a fused qkv_proj
        key, shape, first = fused[info.hub[0]]
        start, stop = (sl[1], sl[2]) if sl is not None else (0, info.shape[0])
        assert sl is None or sl[0] == 0, "q/k/v split over heads (rows) only"
        return _read_matrix(r, key, shape, (0, first + start, first + stop))
    if len(info.shape) == 2:
        return _read_matrix(r, info.hub[0], info.shape, sl)
    return r.get(info.hub[0], info.shape, sl)


def _place(t: torch.Tensor | QTensor, info: WeightInfo, dtype: torch.dtype, device, quant: str):
    """Move to the device and settle the weight's format: keep FP8, quantise, or dequantise."""
    if isinstance(t, QTensor):
        t = QTensor(t.data.to(device), t.scale.to(device=device, dtype=torch.float32), t.fmt)
        return dequantize(t, dtype) if quant == "dequantize" else t
    t = t.to(device=device, dtype=torch.float32 if info.fp32 else dtype)
    return quantize_fp8_block(t) if quant == "fp8" and info.quantizable else t


def _check_quantization_config(path: str) -> None:
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    if qc is None:
        return
    if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size", [])) != [BLOCK, BLOCK]:
        raise ValueError(f"checkpoint {path!r}: quantization_config {qc} is not supported; expected "
                         f"quant_method 'fp8' with weight_block_size [{BLOCK}, {BLOCK}]")


def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = True,
    mesh: Mesh | None = None,
    quant: str = "auto",
) -> tuple[ModelConfig, Params]:
    """Read config.json and the safetensors weights of a hub-layout checkpoint directory.

    quant: "auto" keeps each weight as stored (FP8 stays FP8), "fp8" also quantises the
    bf16 GEMM weights into 128x128 FP8 blocks, "dequantize" turns FP8 weights into `dtype`.
    With a mesh, each rank reads only its own slices (parallel/sharding.py's rule table).
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"load_checkpoint: quant={quant!r}, expected one of {QUANT_MODES}")
    dtype = weight_dtype(dtype, "load_checkpoint")
    path = os.fspath(path)
    _check_quantization_config(path)
    cfg = ModelConfig.from_hf(path)
    mesh = mesh or Mesh.single()
    mesh.validate(cfg)
    files = _list_files(path)
    flat = {}
    with ExitStack() as stack:
        r = _Reader(files, stack, progress)
        infos = describe(cfg)
        fused = _fused_qkv_sources(r, cfg)
        for name, info in tqdm(infos.items(), desc="loading weights", disable=not progress or len(files) < 2):
            t = _read_weight(r, info, slice_of(name, info.shape, cfg, mesh), fused)
            flat[name] = _place(t, info, dtype, device, quant)
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
    params: Params, cfg: ModelConfig, path: str | os.PathLike, max_shard_bytes: int | None = None,
    fused_qkv: bool = False,
) -> None:
    """Write config.json and safetensors in the hub layout (sharded with an index past
    max_shard_bytes); fused_qkv writes each layer's q/k/v projections as one qkv_proj."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    flat = to_flat(params)
    quantized = False
    for name, info in describe(cfg).items():
        w = flat[name]
        q = isinstance(w, QTensor)
        quantized |= q
        data, scale = (w.data.cpu(), w.scale.cpu()) if q else (w.detach().cpu(), None)
        if data.dim() == 3:
            per_key = data.shape[1] // len(info.hub)
            if q and per_key % BLOCK:
                raise ValueError(f"save_checkpoint: FP8 {name!r} has {per_key} rows per projection; "
                                 f"the hub layout splits gate/up only at {BLOCK}-row blocks")
            for e in range(data.shape[0]):
                for j, k in enumerate(info.hub):
                    tensors[k.format(e=e)] = data[e, j * per_key:(j + 1) * per_key].contiguous()
                    if q:
                        rows = slice(j * per_key // BLOCK, (j + 1) * per_key // BLOCK)
                        tensors[k.format(e=e) + "_scale_inv"] = scale[e, rows].contiguous()
        else:
            tensors[info.hub[0]] = data.contiguous()
            if q:
                tensors[info.hub[0] + "_scale_inv"] = scale.contiguous()
    if fused_qkv:
        for i in range(cfg.num_layers):
            h = f"model.layers.{i}.self_attn."
            parts = [tensors.pop(h + f"{k}.weight") for k in _QKV]
            tensors[h + "qkv_proj.weight"] = torch.cat(parts)
            if h + "q_proj.weight_scale_inv" in tensors:  # FP8: the fused matrix's blocks are q's, k's and v's
                if any(p.shape[0] % BLOCK for p in parts[:2]):
                    raise ValueError(f"save_checkpoint: FP8 q/k projections of layer {i} have "
                                     f"{[p.shape[0] for p in parts[:2]]} rows; a fused qkv_proj keeps their "
                                     f"scales only at {BLOCK}-row blocks")
                tensors[h + "qkv_proj.weight_scale_inv"] = torch.cat(
                    [tensors.pop(h + f"{k}.weight_scale_inv") for k in _QKV])
    hf = cfg.to_hf()
    hf["dtype"] = str(params.embed.dtype).removeprefix("torch.")
    if quantized:
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
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
