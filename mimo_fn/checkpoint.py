"""safetensors checkpoints in the hub layout that transformers' save_pretrained writes.

Per layer: `self_attn.{q,k,v,o}_proj.weight`, `self_attn.attention_sink_bias` (SWA layers),
`mlp.{gate,up,down}_proj.weight` (dense) or `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.{gate,up,down}_proj.weight` (MoE).
One file, or several with `model.safetensors.index.json`. Multi-token-prediction tensors
(`model.mtp.*`) are skipped and reported (mimo_fn.speculative.mtp_checkpoint reads them); any
other unknown tensor is an error. A layer may
instead store its attention input projections fused, `self_attn.qkv_proj.weight`, in the
releases' interleaved order or plain [Q; K; V], as config.json says (checkpoint_qkv.py has the
rules; `save_checkpoint(fused_qkv="interleaved" / "plain")` writes either).

FP8 checkpoints (the released layout): a GEMM weight `X.weight` stored as float8_e4m3fn
comes with `X.weight_scale_inv`, fp32 [ceil(N/128), ceil(K/128)], the multiplier of each
128x128 block, and config.json carries `quantization_config.weight_block_size: [128, 128]`.
Such weights load as QTensors and stay FP8. A rank whose shard cuts through 128-row
blocks (one 192-row KV head of a k_proj, say) gets that shard dequantised instead. In a fused
qkv_proj the blocks restart at each checkpoint shard (plain: one shard, the whole matrix), and
q, k and v are row ranges of those shards, read like such slices.

MXFP4 experts (the RL release, MiMo-V2.6-Flash-RL): an expert projection `X.weight` stored as
packed E2M1 bytes, [N, K/2] (uint8; int8 and float4_e2m1fn_x2 are read as the same bytes),
comes with `X.weight_scale`, [N, K/32] E8M0 exponents (uint8 or float8_e8m0fnu). The tensors
say so, not config.json (whose quantization_config may name fp8 or mxfp4): a `weight_scale`
sibling makes a weight MXFP4, and its dtype and shape are then checked. Such weights load as
MXFP4 QTensors and stay MXFP4 (also under quant="fp8"); the expert stack concatenates gate and
up rows freely, since the scales are per row. Any other GEMM weight stored this way loads too
(`linear` dequantises it); a shard that cuts through 32-column groups is dequantised, as FP8's.
safetensors stores float4_e2m1fn_x2 as "F4" with the element count [N, K] as its shape and
cannot slice it (0.8): such a tensor is read whole and sliced here.
"""

import json
import logging
import os
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from mimo_fn._types import typed
from mimo_fn.checkpoint_qkv import (
    LAYOUT_FIELD, ORDER_FIELD, ORDERS, PROJECTIONS, SCALE_SUFFIXES, FusedQKV, fuse, fused_layers, layer_fused_qkv,
    qkv_layout, read_projection,
)
from mimo_fn.config import ModelConfig
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import Params, WeightInfo, describe, from_flat, to_flat, weight_dtype
from mimo_fn.quant import (
    BLOCK, FP8_BLOCK, MX_GROUP, MXFP4, QTensor, check_mxfp4, dequantize, quantize_fp8_block,
)

QUANT_MODES = ("auto", "fp8", "dequantize")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

log = logging.getLogger("mimo_fn")

SKIPPED_PREFIXES = ("model.mtp.",)  # MTP draft layers: not part of the main model
_SCALE_SUFFIX = {FP8_BLOCK: "_scale_inv", MXFP4: "_scale"}  # "X.weight" + suffix: the scale's key


def list_files(path: str) -> list[str]:
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


class Reader:
    """All tensors of a checkpoint by key, read lazily; remembers which keys were used."""

    def __init__(self, files: list[str], stack: ExitStack, progress: bool):
        self.handles: dict[str, Any] = {}
        for fn in tqdm(files, desc="indexing checkpoint", disable=not progress or len(files) < 2):
            try:
                h = stack.enter_context(safe_open(fn, framework="pt"))
            except SafetensorError as e:  # its message names no file
                raise ValueError(f"checkpoint file {fn!r} is not a valid safetensors file (truncated or corrupt? "
                                 f"{os.path.getsize(fn)} bytes): {e}") from None
            for k in h.keys():
                self.handles[k] = h
        self.used: set[str] = set()

    def dtype(self, key: str) -> str | None:
        """The stored dtype's safetensors name ("BF16", "U8", "F4", ...), None for a missing key."""
        return self.handles[key].get_slice(key).get_dtype() if key in self.handles else None

    def get(self, key: str, shape: tuple[int, ...], sl: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor (or only its slice (dim, start, stop): a rank reads just its shard). An "F4"
        tensor is checked and returned as its bytes, [.., K/2] uint8 (see the module docstring)."""
        if key not in self.handles:
            raise ValueError(f"checkpoint is missing tensor {key!r} (expected shape {list(shape)})")
        view = self.handles[key].get_slice(key)
        stored = list(view.get_shape())
        packed_f4 = view.get_dtype() == "F4"
        if packed_f4 and stored[-1] % 2 == 0:  # safetensors counts the fp4 elements, two a byte
            stored[-1] //= 2
        if tuple(stored) != tuple(shape):
            raise ValueError(f"checkpoint tensor {key!r} has shape {stored}, expected {list(shape)}")
        self.used.add(key)
        if packed_f4:  # safetensors cannot slice F4: read it whole (a copy), then narrow
            t = self.handles[key].get_tensor(key).view(torch.uint8)
            return t if sl is None else t.narrow(sl[0], sl[1], sl[2] - sl[1]).contiguous()
        if sl is None:
            return view[:]
        dim, start, stop = sl
        return view[(slice(None),) * dim + (slice(start, stop),)]


def read_matrix(r: Reader, key: str, shape: tuple[int, int], sl,
                 shard_rows: int | None = None) -> torch.Tensor | QTensor:
    """One [N, K] weight (or this rank's slice of it): a QTensor when stored as FP8 + scales
    or MXFP4 + scales. shard_rows: the FP8 block grid restarts every shard_rows rows (the
    shards of an interleaved qkv_proj); a row slice then lies inside one shard."""
    scale_key = key + "_scale_inv"
    if key + "_scale" in r.handles:
        if scale_key in r.handles:
            raise ValueError(f"checkpoint tensor {key!r} has both {scale_key!r} (FP8) and {key + '_scale'!r} "
                             "(MXFP4): expected one")
        return _read_mxfp4(r, key, shape, sl)
    if scale_key not in r.handles:
        return r.get(key, shape, sl)
    shard_rows = shard_rows or shape[0]
    grid = (shape[0] // shard_rows * _cdiv(shard_rows, BLOCK), _cdiv(shape[1], BLOCK))
    data = r.get(key, shape, sl)
    if data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {key!r} has a {scale_key!r} but dtype {data.dtype}, expected float8_e4m3fn")
    if sl is None:
        assert shard_rows == shape[0], "a sharded grid is read in row slices"
        return QTensor(data, r.get(scale_key, grid), FP8_BLOCK)
    dim, start, stop = sl
    first, first_block, extent = 0, 0, shape[dim]  # the slice's shard: first row, first scale row, rows
    if dim == 0:
        s = start // shard_rows
        assert stop <= (s + 1) * shard_rows, "a row slice lies inside one shard"
        first, first_block, extent = s * shard_rows, s * _cdiv(shard_rows, BLOCK), shard_rows
    else:
        assert shard_rows == shape[0], "column slices of a sharded grid are not read"
    start, stop = start - first, stop - first
    scale = r.get(scale_key, grid, (dim, first_block + start // BLOCK, first_block + _cdiv(stop, BLOCK)))
    if start % BLOCK == 0 and (stop % BLOCK == 0 or stop == extent):
        return QTensor(data, scale, FP8_BLOCK)
    # the slice cuts through blocks: expand each row's (or column's) block scale and dequantise
    idx = torch.arange(start, stop) // BLOCK - start // BLOCK
    scale = scale.index_select(dim, idx).repeat_interleave(BLOCK, dim=1 - dim)
    scale = scale[:, :data.shape[1]] if dim == 0 else scale[:data.shape[0], :]
    return data.float() * scale


_MX_DATA_DTYPES = ("U8", "I8", "F4")  # safetensors names of the dtypes that hold packed E2M1 pairs
_MX_SCALE_DTYPES = ("U8", "F8_E8M0")


def _read_mxfp4(r: Reader, key: str, shape: tuple[int, int], sl) -> torch.Tensor | QTensor:
    """An MXFP4 [N, K] weight: bytes [N, K/2] and E8M0 scales [N, K/32], both read as uint8.
    Row slices and column slices on 32-column groups stay MXFP4; other column slices are
    dequantised (fp32)."""
    scale_key = key + "_scale"
    n, k = shape
    if k % MX_GROUP:
        raise ValueError(f"checkpoint tensor {key!r} has an MXFP4 scale {scale_key!r}, but its weight is "
                         f"{list(shape)}: MXFP4 needs K a multiple of {MX_GROUP}")
    for name, kinds in ((key, _MX_DATA_DTYPES), (scale_key, _MX_SCALE_DTYPES)):
        if r.dtype(name) not in (None, *kinds):  # None: missing, which r.get reports with the shape
            raise ValueError(f"checkpoint tensor {name!r} is part of an MXFP4 weight (it has a {scale_key!r}) "
                             f"but has dtype {r.dtype(name)}; expected one of {list(kinds)}")
    data_shape, scale_shape = (n, k // 2), (n, k // MX_GROUP)
    if sl is None or sl[0] == 0:  # whole, or rows: the scales are per row
        return QTensor(r.get(key, data_shape, sl).view(torch.uint8),
                       r.get(scale_key, scale_shape, sl).view(torch.uint8), MXFP4)
    _, start, stop = sl  # columns: read the 32-column groups they touch
    g0, g1 = start // MX_GROUP, _cdiv(stop, MX_GROUP)
    q = QTensor(r.get(key, data_shape, (1, g0 * MX_GROUP // 2, g1 * MX_GROUP // 2)).view(torch.uint8),
                r.get(scale_key, scale_shape, (1, g0, g1)).view(torch.uint8), MXFP4)
    if start % MX_GROUP == 0 and stop % MX_GROUP == 0:
        return q
    return dequantize(q, torch.float32)[:, start - g0 * MX_GROUP:stop - g0 * MX_GROUP].contiguous()


def _format_of(t: torch.Tensor | QTensor) -> str:
    return t.fmt if isinstance(t, QTensor) else "dense"


def _cat_rows(parts: list, keys: list[str]) -> torch.Tensor | QTensor:
    """One expert's projections (gate, up) as one matrix, rows in `keys` order."""
    formats = [_format_of(p) for p in parts]
    if len(set(formats)) > 1:
        raise ValueError(f"checkpoint tensors {keys} are stored as {formats}; expected one format per expert")
    if not isinstance(parts[0], QTensor):
        return torch.cat(parts)
    if parts[0].fmt == FP8_BLOCK and any(p.data.shape[0] % BLOCK for p in parts[:-1]):
        raise ValueError(f"FP8 expert weights with {parts[0].data.shape[0]} rows per projection: gate and up "
                         f"concatenate only in whole {BLOCK}-row blocks")
    # MXFP4 scales are per row: any rows concatenate
    return QTensor(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), parts[0].fmt)


def _stack(parts: list) -> torch.Tensor | QTensor:
    if not isinstance(parts[0], QTensor):
        return torch.stack(parts)
    return QTensor(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), parts[0].fmt)


def _read_weight(r: Reader, info: WeightInfo, sl: tuple[int, int, int] | None,
                 fused: dict[str, tuple[FusedQKV, int]]) -> torch.Tensor | QTensor:
    if len(info.shape) == 3:  # expert stack: per-expert tensors, gate and up concatenated
        num_experts, rows, cols = info.shape
        per_key = rows // len(info.hub)
        first, last = (sl[1], sl[2]) if sl is not None else (0, num_experts)
        assert sl is None or sl[0] == 0, "expert stacks split over experts only"
        r.used.update(k.format(e=e) + sfx for k in info.hub for e in range(num_experts)  # others' experts
                      for sfx in ("", "_scale_inv", "_scale") if k.format(e=e) + sfx in r.handles)
        stack = []
        for e in range(first, last):
            keys = [k.format(e=e) for k in info.hub]
            stack.append(_cat_rows([read_matrix(r, k, (per_key, cols), None) for k in keys], keys))
            if _format_of(stack[-1]) != _format_of(stack[0]):
                raise ValueError(f"checkpoint expert {keys[0]!r} is stored as {_format_of(stack[-1])}, expert "
                                 f"{first}'s as {_format_of(stack[0])}; expected one format per layer")
        return _stack(stack)
    if len(info.shape) == 2 and info.hub[0] in fused:  # row ranges of a fused qkv_proj
        f, proj = fused[info.hub[0]]
        start, stop = (sl[1], sl[2]) if sl is not None else (0, info.shape[0])
        assert sl is None or sl[0] == 0, "q/k/v split over heads (rows) only"
        return read_projection(f, proj, start, stop,
                               lambda a, b: read_matrix(r, f.key, f.shape, (0, a, b), f.shard_rows))
    if len(info.shape) == 2:
        return read_matrix(r, info.hub[0], info.shape, sl)
    return r.get(info.hub[0], info.shape, sl)


def place(t: torch.Tensor | QTensor, info: WeightInfo, dtype: torch.dtype, device, quant: str):
    """Move to the device and settle the weight's format: keep FP8 / MXFP4, quantise, or dequantise."""
    if isinstance(t, QTensor):
        scale_dtype = torch.float32 if t.fmt == FP8_BLOCK else torch.uint8  # MXFP4: E8M0 exponents
        t = QTensor(t.data.to(device), t.scale.to(device=device, dtype=scale_dtype), t.fmt)
        return dequantize(t, dtype) if quant == "dequantize" else t
    t = t.to(device=device, dtype=torch.float32 if info.fp32 else dtype)
    return quantize_fp8_block(t) if quant == "fp8" and info.quantizable else t


def _check_quantization_config(path: str, hf: dict[str, Any]) -> None:
    qc = hf.get("quantization_config")
    if qc is None:
        return
    if qc.get("quant_method") == "mxfp4":  # gpt-oss style; the tensors say which weights are MXFP4
        return
    if qc.get("quant_method") != "fp8" or list(qc.get("weight_block_size", [])) != [BLOCK, BLOCK]:
        raise ValueError(f"checkpoint {path!r}: quantization_config {qc} is not supported; expected "
                         f"quant_method 'fp8' with weight_block_size [{BLOCK}, {BLOCK}], or quant_method 'mxfp4'")


@typed
def load_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: bool = True,
    mesh: Mesh | None = None,
    quant: str = "auto",
) -> tuple[ModelConfig, Params]:
    """Read config.json and the safetensors weights of a hub-layout checkpoint directory.

    quant: "auto" keeps each weight as stored (FP8 stays FP8, MXFP4 stays MXFP4), "fp8" also
    quantises the bf16 GEMM weights into 128x128 FP8 blocks (MXFP4 experts stay MXFP4: they are
    smaller already, and re-quantising them would only add error), "dequantize" turns FP8 and
    MXFP4 weights into `dtype`.
    With a mesh, each rank reads only its own slices (parallel/sharding.py's rule table).
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"load_checkpoint: quant={quant!r}, expected one of {QUANT_MODES}")
    dtype = weight_dtype(dtype, "load_checkpoint")
    path = os.fspath(path)
    config_json = os.path.join(path, "config.json")
    if not os.path.isfile(config_json):
        raise ValueError(f"checkpoint path {path!r}: expected a directory with config.json and *.safetensors")
    with open(config_json) as f:
        hf = json.load(f)
    _check_quantization_config(path, hf)
    cfg = ModelConfig.from_hf(hf)
    layout = qkv_layout(hf)
    mesh = mesh or Mesh.single()
    mesh.validate(cfg)
    files = list_files(path)
    flat = {}
    with ExitStack() as stack:
        r = Reader(files, stack, progress)
        infos = describe(cfg)
        fused = fused_layers(set(r.handles), cfg, layout)
        for name, info in tqdm(infos.items(), desc="loading weights", disable=not progress or len(files) < 2):
            t = _read_weight(r, info, slice_of(name, info.shape, cfg, mesh), fused)
            flat[name] = place(t, info, dtype, device, quant)
        left = sorted(set(r.handles) - r.used)
    skipped = [k for k in left if k.startswith(SKIPPED_PREFIXES)]
    unknown = [k for k in left if not k.startswith(SKIPPED_PREFIXES)]
    if unknown:
        raise ValueError(f"checkpoint {path!r} holds {len(unknown)} tensors this config does not use, "
                         f"e.g. {unknown[:5]}: expected only the hub MiMo-V2-Flash layout")
    if skipped:
        log.warning("checkpoint %s: skipped %d multi-token-prediction tensors (%s...; "
                    "mimo_fn.speculative.mtp_checkpoint.load_mtp reads them)", path, len(skipped), skipped[0])
    return cfg, from_flat(cfg, flat)


@typed
def save_checkpoint(
    params: Params, cfg: ModelConfig, path: str | os.PathLike, max_shard_bytes: int | None = None,
    fused_qkv: bool | str = False,
) -> None:
    """Write config.json and safetensors in the hub layout (sharded with an index past
    max_shard_bytes). fused_qkv writes each layer's q/k/v projections as one qkv_proj:
    "interleaved" as the releases store it (num_key_value_heads shards, each [q_s; k_s; v_s]),
    "plain" (or True) as [Q; K; V]; config.json then names the layout and order. FP8 q/k/v fuse
    only where each projection's rows per shard are whole 128-row blocks (a ValueError otherwise).
    FP8 weights are written as float8_e4m3fn + `weight_scale_inv`, MXFP4 ones as uint8 bytes
    [N, K/2] + uint8 `weight_scale` [N, K/32]; config.json gets the FP8 quantization_config
    when any weight is FP8, else {"quant_method": "mxfp4"} when any is MXFP4."""
    if fused_qkv not in (False, True, *ORDERS):
        raise ValueError(f"save_checkpoint: fused_qkv={fused_qkv!r}, expected False, True (= 'plain') or one of "
                         f"{ORDERS}")
    order = "plain" if fused_qkv is True else fused_qkv or None
    path = os.fspath(path)
    tensors: dict[str, torch.Tensor] = {}
    flat = to_flat(params)
    formats = set()
    for name, info in describe(cfg).items():
        w = flat[name]
        q = isinstance(w, QTensor)
        if q:
            if w.fmt not in _SCALE_SUFFIX:
                raise ValueError(f"save_checkpoint: {name!r} has QTensor format {w.fmt!r}; expected one of "
                                 f"{list(_SCALE_SUFFIX)}")
            if w.fmt == MXFP4:
                check_mxfp4(f"save_checkpoint ({name!r})", w)
            formats.add(w.fmt)
        data, scale = (w.data.cpu(), w.scale.cpu()) if q else (w.detach().cpu(), None)
        if data.dim() == 3:
            per_key = data.shape[1] // len(info.hub)  # rows: dim -2 of the data in every format
            if q and w.fmt == FP8_BLOCK and per_key % BLOCK:
                raise ValueError(f"save_checkpoint: FP8 {name!r} has {per_key} rows per projection; "
                                 f"the hub layout splits gate/up only at {BLOCK}-row blocks")
            rows_per_scale = BLOCK if q and w.fmt == FP8_BLOCK else 1  # MXFP4: a scale row per row
            for e in range(data.shape[0]):
                for j, k in enumerate(info.hub):
                    tensors[k.format(e=e)] = data[e, j * per_key:(j + 1) * per_key].contiguous()
                    if q:
                        rows = slice(j * per_key // rows_per_scale, (j + 1) * per_key // rows_per_scale)
                        tensors[k.format(e=e) + _SCALE_SUFFIX[w.fmt]] = scale[e, rows].contiguous()
        else:
            tensors[info.hub[0]] = data.contiguous()
            if q:
                tensors[info.hub[0] + _SCALE_SUFFIX[w.fmt]] = scale.contiguous()
    if order is not None:
        for i in range(cfg.num_layers):
            h = f"model.layers.{i}.self_attn."
            keys = [h + f"{p}.weight{sfx}" for p in PROJECTIONS for sfx in ("", *SCALE_SUFFIXES)]
            parts = {k: tensors.pop(k) for k in keys if k in tensors}
            tensors.update(fuse(parts, h, layer_fused_qkv(cfg, i, order).shards, i))
    hf = cfg.to_hf()
    hf["dtype"] = str(params.embed.dtype).removeprefix("torch.")
    if order is not None:
        hf[LAYOUT_FIELD], hf[ORDER_FIELD] = "fused_qkv", order
    if FP8_BLOCK in formats:  # the released layout's config; MXFP4 weights are told apart by their tensors
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    elif MXFP4 in formats:
        hf["quantization_config"] = {"quant_method": "mxfp4"}
    os.makedirs(path, exist_ok=True)
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
