"""MTP layers in a hub-layout checkpoint: read (`load_mtp`) and write (`save_mtp`).

config.json's `num_nextn_predict_layers` (or `num_mtp_layers`) counts the layers; their tensors,
under `model.mtp.layers.{i}.` as released (mimo_fn.speculative.mtp.describe_mtp lists them):
  enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H], final_layernorm.weight [H],
  input_layernorm.weight, pre_mlp_layernorm.weight (post_attention_layernorm.weight is read too),
  self_attn.{q,k,v,o}_proj.weight (or one fused self_attn.qkv_proj.weight, in the row order
  config.json gives the main layers: mimo_fn.checkpoint_qkv), self_attn.attention_sink_bias,
  mlp.{gate,up,down}_proj.weight
with the sliding-window layers' attention shapes and the dense MLP's. FP8 weights (with their
`weight_scale_inv`) load as FP8 QTensors, or dequantised with quant="dequantize". A tensor of
another shape than config.json implies is a ValueError that names it; so is a missing one, and
an `model.mtp.*` tensor this layout does not know.

`load_checkpoint` reads the main model and skips these tensors; `save_mtp` writes them beside a
checkpoint `save_checkpoint` wrote (its own file, listed in the index where there is one).
"""

import json
import os
from contextlib import ExitStack

import torch
from safetensors.torch import save_file

from mimo_fn.checkpoint import Reader, list_files, place, read_matrix
from mimo_fn.checkpoint_qkv import PROJECTIONS, FusedQKV, qkv_layout, read_projection
from mimo_fn.config import ModelConfig
from mimo_fn.params import weight_dtype
from mimo_fn.quant import FP8_BLOCK, QTensor
from mimo_fn.speculative.mtp import MTPParams, describe_mtp, mtp_from_flat, mtp_model_config, mtp_to_flat

MTP_FILE = "model-mtp.safetensors"
_RENAMED = {"pre_mlp_layernorm": "post_attention_layernorm"}  # the name read where the released one is missing


def num_mtp_layers(hf: dict) -> int:
    """The MTP layers a config.json declares (0: none)."""
    d = hf.get("text_config") or hf
    n = d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"config field 'num_nextn_predict_layers' = {n!r}: expected a non-negative int")
    return n


def _fused(cfg: ModelConfig, key: str, order: str) -> FusedQKV:
    """An MTP layer's fused qkv_proj: the sliding-window layers' heads, sharded as the main layers'."""
    mcfg = mtp_model_config(cfg)
    G, T = mcfg.kv_heads(0), cfg.num_kv_heads if order == "interleaved" else 1
    if mcfg.num_heads % T or G % T:
        raise ValueError(f"checkpoint tensor {key!r}: an interleaved qkv_proj holds {T} shards of whole heads; "
                         f"{mcfg.num_heads} query heads and {G} KV heads do not divide")
    return FusedQKV(key, (mcfg.num_heads * cfg.head_dim, G * cfg.head_dim, G * cfg.v_head_dim), cfg.hidden_size, T)


def load_mtp(path: str | os.PathLike, cfg: ModelConfig | None = None, dtype: torch.dtype | str = torch.bfloat16,
             device: str | torch.device = "cpu", quant: str = "auto") -> tuple[ModelConfig, MTPParams]:
    """(config, MTP weights) of a checkpoint directory (config.json + *.safetensors). cfg: the
    target's config to check config.json against (default: config.json's own). quant: "auto"
    keeps FP8 weights FP8, "dequantize" turns them into dtype."""
    path, dtype = os.fspath(path), weight_dtype(dtype, "load_mtp")
    if quant not in ("auto", "dequantize"):
        raise ValueError(f"load_mtp: quant={quant!r}, expected 'auto' or 'dequantize'")
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path!r}: no config.json") from None
    own = ModelConfig.from_hf(hf)
    if cfg is not None and cfg != own:
        raise ValueError(f"checkpoint {path!r}: config.json describes another model than the target's config")
    cfg, n = cfg or own, num_mtp_layers(hf)
    if n == 0:
        raise ValueError(f"checkpoint {path!r}: config.json declares no MTP layers (num_nextn_predict_layers)")
    infos, order = describe_mtp(cfg, n), qkv_layout(hf).order
    flat = {}
    with ExitStack() as stack:
        r = Reader(list_files(path), stack, progress=False)
        for name, info in infos.items():
            key = info.hub[0]
            for new, old in _RENAMED.items():
                if new in key and key not in r.handles and key.replace(new, old) in r.handles:
                    key = key.replace(new, old)
            proj = next((j for j, p in enumerate(PROJECTIONS) if key.endswith(f"self_attn.{p}.weight")), None)
            fused_key = key.rsplit("self_attn.", 1)[0] + "self_attn.qkv_proj.weight"
            if proj is not None and key not in r.handles and fused_key in r.handles:
                f = _fused(cfg, fused_key, order)
                t = read_projection(f, proj, 0, f.rows[proj],
                                    lambda a, b, f=f: read_matrix(r, f.key, f.shape, (0, a, b), f.shard_rows))
            elif len(info.shape) == 2:
                t = read_matrix(r, key, info.shape, None)
            else:
                t = r.get(key, info.shape)
            flat[name] = place(t, info, dtype, device, "dequantize" if quant == "dequantize" else "auto")
        unknown = sorted(k for k in set(r.handles) - r.used if k.startswith("model.mtp.")
                         and not k.endswith(("_scale_inv", "_scale")))
    if unknown:
        raise ValueError(f"checkpoint {path!r} holds {len(unknown)} MTP tensors this layout does not know, "
                         f"e.g. {unknown[:3]}")
    return cfg, mtp_from_flat(cfg, n, flat)


def save_mtp(params: MTPParams, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write the MTP layers into checkpoint directory `path` (beside save_checkpoint's files, or
    alone with a config.json of its own): their tensors in MTP_FILE, num_nextn_predict_layers
    in config.json, and the index's weight map where the checkpoint has one."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    flat = mtp_to_flat(params)
    for name, info in describe_mtp(cfg, len(params.layers)).items():
        w = flat[name]
        if isinstance(w, QTensor):
            if w.fmt != FP8_BLOCK:
                raise ValueError(f"save_mtp: {name!r} is a {w.fmt} QTensor; only FP8 block weights are written")
            tensors[info.hub[0]], tensors[info.hub[0] + "_scale_inv"] = w.data.cpu(), w.scale.cpu()
        else:
            tensors[info.hub[0]] = w.detach().cpu()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, MTP_FILE), metadata={"format": "pt"})
    config = os.path.join(path, "config.json")
    hf = json.load(open(config)) if os.path.exists(config) else cfg.to_hf()
    (hf.get("text_config") or hf)["num_nextn_predict_layers"] = len(params.layers)
    with open(config, "w") as f:
        json.dump(hf, f, indent=2)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"].update({k: MTP_FILE for k in tensors})
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
