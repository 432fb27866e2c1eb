"""Fused `qkv_proj` layouts: which rows of one layer's fused matrix hold q, k and v.

Legend: N query heads, G KV heads (per layer), D q/k head dim, Dv v head dim, H hidden,
T checkpoint shards (the TP ranks of the engine that wrote the checkpoint), S rows per shard.

A config.json with `attention_projection_layout: "fused_qkv"` stores each layer's q, k and v
projections as one `self_attn.qkv_proj.weight`, in one of two row orders:
* "interleaved" (the releases): written by a TP engine with T = `num_key_value_heads` ranks for
  every layer, full and sliding-window alike (SGLang's mimo_v2 loader takes the same T). The
  rows are T shards in rank order, each [q_s; k_s; v_s]: the shard's N/T query heads, then its
  G/T KV heads' k rows, then their v rows. FP8 scales are computed per shard, so a shard of S
  rows has ceil(S / 128) scale rows: at the released dims a full layer's shard has 3,392 rows
  and 27 scale rows, and its 4 shards carry 108 (not ceil(13568 / 128) = 106).
* "plain": [Q; K; V] over all heads, the scales those of the whole matrix: one shard.
The order is `fused_qkv_weight_order` when config.json has it ("plain" or "interleaved"; any
other value is a ValueError); without it, "plain" when `quantization_config.quant_method` is
"modelopt" (community re-exports through transformers + ModelOpt) and "interleaved" otherwise.
A config.json with no layout field whose layers still hold a qkv_proj (what mimo_fn wrote
before it wrote the fields) is read as "plain". `attention_projection_layout: "split"` means
q_proj / k_proj / v_proj only.

Plain is the one-shard case of the interleaved layout, so one plan reads both: the rows a
rank needs of one projection are a list of row ranges, one per checkpoint shard they touch.
FP8 ranges whose rows start on a block of their shard (and end on one, or at the shard's end)
keep their codes; others are dequantised with their own shard's scales (the released full
layers' k and v: 192 + 128 rows after 3,072 q rows share the shard's block 25).
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mimo_fn.config import ModelConfig
from mimo_fn.quant import BLOCK, FP8_BLOCK, QTensor, dequantize

LAYOUT_FIELD = "attention_projection_layout"
ORDER_FIELD = "fused_qkv_weight_order"
LAYOUTS = ("split", "fused_qkv")
ORDERS = ("plain", "interleaved")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # their order inside a shard of a fused qkv_proj
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # FP8 block scales, MXFP4 per-row group scales


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QKVLayout:
    layout: str | None  # LAYOUTS, or None: config.json does not say (each layer's tensors do)
    order: str  # ORDERS: how a fused qkv_proj's rows are grouped


def qkv_layout(hf: dict[str, Any]) -> QKVLayout:
    """The attention projection layout a config.json (its text_config where it has one) declares."""
    sections = [hf.get("text_config") or {}, hf]

    def field(name: str) -> Any:
        return next((s[name] for s in sections if s.get(name) is not None), None)

    layout, order = field(LAYOUT_FIELD), field(ORDER_FIELD)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"config field {LAYOUT_FIELD!r} = {layout!r}: expected one of {LAYOUTS}")
    if order is not None and order not in ORDERS:
        raise ValueError(f"config field {ORDER_FIELD!r} = {order!r}: expected one of {ORDERS}")
    if order is None:
        quant_method = (field("quantization_config") or {}).get("quant_method")
        order = "interleaved" if layout == "fused_qkv" and quant_method != "modelopt" else "plain"
    return QKVLayout(layout, order)


@dataclass(frozen=True)
class FusedQKV:
    """One layer's fused qkv_proj: its key, the rows of q, k and v over all heads, and the
    checkpoint shards those rows are grouped in (1 for plain)."""

    key: str
    rows: tuple[int, int, int]  # N*D, G*D, G*Dv
    cols: int  # H
    shards: int  # T

    @property
    def shape(self) -> tuple[int, int]:
        return sum(self.rows), self.cols

    @property
    def shard_rows(self) -> int:
        """S: rows of one shard, [q_s; k_s; v_s]."""
        return sum(self.rows) // self.shards

    @property
    def scale_rows(self) -> int:
        """FP8 `weight_scale_inv` rows: ceil(S / 128) per shard."""
        return self.shards * _cdiv(self.shard_rows, BLOCK)


def layer_fused_qkv(cfg: ModelConfig, layer: int, order: str) -> FusedQKV:
    """Layer `layer`'s fused qkv_proj in `order`, checked: interleaved shards hold whole heads."""
    key = f"model.layers.{layer}.self_attn.qkv_proj.weight"
    N, G, T = cfg.num_heads, cfg.kv_heads(layer), cfg.num_kv_heads if order == "interleaved" else 1
    if N % T or G % T:
        raise ValueError(f"checkpoint tensor {key!r}: an interleaved qkv_proj holds num_key_value_heads = {T} "
                         f"shards of whole heads, but layer {layer} has {N} query heads and {G} KV heads; expected "
                         f"both to divide by {T} (or {ORDER_FIELD!r}: 'plain' in config.json)")
    rows = (N * cfg.head_dim, G * cfg.head_dim, G * cfg.v_head_dim)
    return FusedQKV(key, rows, cfg.hidden_size, T)


def fused_layers(keys: set[str], cfg: ModelConfig, layout: QKVLayout) -> dict[str, tuple[FusedQKV, int]]:
    """For each layer read from a fused qkv_proj: its q/k/v hub keys -> (the layer's FusedQKV,
    the projection's index in PROJECTIONS)."""
    out = {}
    for i in range(cfg.num_layers):
        h = f"model.layers.{i}.self_attn."
        fused = h + "qkv_proj.weight"
        split = [h + f"{p}.weight" for p in PROJECTIONS if h + f"{p}.weight" in keys]
        if layout.layout == "split" or (layout.layout is None and fused not in keys):
            continue  # a stray qkv_proj under "split" is reported with the checkpoint's unused tensors
        if split and fused in keys:
            raise ValueError(f"checkpoint holds both {fused!r} and {split[0]!r}: expected one layout per layer")
        if split:
            raise ValueError(f"checkpoint holds {split[0]!r}, but config.json says {LAYOUT_FIELD!r} = 'fused_qkv': "
                             f"expected {fused!r}")
        f = layer_fused_qkv(cfg, i, layout.order)
        for j, p in enumerate(PROJECTIONS):
            out[h + f"{p}.weight"] = (f, j)
    return out


def row_ranges(f: FusedQKV, proj: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Rows [start, stop) of projection `proj` (over all heads, in head order) as ranges of the
    fused matrix's rows, one per checkpoint shard they touch, in order."""
    per_shard = f.rows[proj] // f.shards  # the projection's rows in each shard
    offset = sum(f.rows[:proj]) // f.shards  # its first row inside a shard
    out = []
    while start < stop:
        s = start // per_shard
        end = min(stop, (s + 1) * per_shard)
        first = s * f.shard_rows + offset + start - s * per_shard
        out.append((first, first + end - start))
        start = end
    return out


def join_rows(parts: list[torch.Tensor | QTensor]) -> torch.Tensor | QTensor:
    """Row ranges read one by one -> one matrix. FP8 parts stay FP8 where every part but the
    last is whole 128-row blocks (the joined blocks are then the parts' blocks); otherwise they
    are dequantised (fp32, each with its own scales) and joined with the dense parts."""
    if len(parts) == 1:
        return parts[0]
    fmts = {p.fmt if isinstance(p, QTensor) else "dense" for p in parts}
    if fmts == {"dense"}:
        return torch.cat(parts)
    whole_blocks = all(p.shape[0] % BLOCK == 0 for p in parts[:-1])
    if len(fmts) == 1 and isinstance(parts[0], QTensor) and (parts[0].fmt != FP8_BLOCK or whole_blocks):
        return QTensor(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), parts[0].fmt)
    if any(isinstance(p, QTensor) and p.fmt != FP8_BLOCK for p in parts):
        raise ValueError(f"a fused qkv_proj's row ranges are stored as {sorted(fmts)}: expected one format")
    return torch.cat([dequantize(p, torch.float32) if isinstance(p, QTensor) else p.float() for p in parts])


def read_projection(f: FusedQKV, proj: int, start: int, stop: int,
                    read_rows: Callable[[int, int], torch.Tensor | QTensor]) -> torch.Tensor | QTensor:
    """Rows [start, stop) of projection `proj`; read_rows(a, b) reads the fused matrix's rows
    [a, b) (inside one shard; FP8 on its shard's scale grid)."""
    return join_rows([read_rows(a, b) for a, b in row_ranges(f, proj, start, stop)])


def fuse(parts: dict[str, torch.Tensor], h: str, shards: int, layer: int) -> dict[str, torch.Tensor]:
    """One layer's q_proj / k_proj / v_proj tensors (and their scales) as hub keys -> its fused
    qkv_proj tensors in `shards` shards (1: plain). FP8 keeps the codes and block scales, which
    needs each projection's rows per shard to be whole 128-row blocks (v's may end in a partial
    block when the shard is the whole matrix); MXFP4 scales are per row, so any rows fuse."""
    weights = [parts[h + f"{p}.weight"] for p in PROJECTIONS]
    out = {h + "qkv_proj.weight": _interleave(weights, shards)}
    for sfx in SCALE_SUFFIXES:
        scale_keys = [h + f"{p}.weight{sfx}" for p in PROJECTIONS]
        have = [k for k in scale_keys if k in parts]
        if not have:
            continue
        if len(have) < len(PROJECTIONS):
            raise ValueError(f"save_checkpoint: layer {layer}'s q/k/v projections are stored in different formats "
                             f"(scales only for {have}); a fused qkv_proj needs one format")
        scales = [parts[k] for k in scale_keys]
        if sfx == "_scale_inv":
            per_shard = [w.shape[0] // shards for w in weights]
            if any(n % BLOCK for n in per_shard[:2]) or (shards > 1 and per_shard[2] % BLOCK):
                plural = "s" if shards > 1 else ""
                raise ValueError(f"save_checkpoint: FP8 q/k/v projections of layer {layer} have {per_shard} rows "
                                 f"per checkpoint shard ({shards} shard{plural}); a fused qkv_proj keeps their "
                                 f"scales only where each starts on a {BLOCK}-row block")
            out[h + f"qkv_proj.weight{sfx}"] = _interleave(scales, shards, [_cdiv(n, BLOCK) for n in per_shard])
        else:
            out[h + f"qkv_proj.weight{sfx}"] = _interleave(scales, shards)
    return out


def _interleave(mats: list[torch.Tensor], shards: int, per_shard: list[int] | None = None) -> torch.Tensor:
    """[m_0; m_1; m_2] regrouped as shards, each [m_0 rows of shard s; m_1 rows ...; m_2 rows ...];
    per_shard: rows of each matrix in one shard (default: its rows / shards)."""
    per_shard = per_shard or [m.shape[0] // shards for m in mats]
    assert all(m.shape[0] == n * shards for m, n in zip(mats, per_shard))
    return torch.cat([m[s * n:(s + 1) * n] for s in range(shards) for m, n in zip(mats, per_shard)])
