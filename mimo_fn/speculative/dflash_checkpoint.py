"""DFlash draft checkpoints in z-lab's hub layout (github.com/z-lab/dflash): read and write.

config.json is a Qwen3 config (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_parameters.rope_theta or
rope_theta) with the draft's own fields in `dflash_config` (or at the top level):
target_layer_ids, mask_token_id, block_size. Tensors, one safetensors file or several:
  fc.weight [H, L*H], hidden_norm.weight [H], norm.weight [H], and per layer i
  layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
  layers.{i}.mlp.{gate,up,down}_proj.weight
and, for a draft with its own vocabulary (mimo_fn.speculative.draft_vocab), draft_vocab: int64
[Vd], the target's token ids it proposes (this engine's own tensor; EAGLE-3 keeps the same map as
d2t offsets).
The names and the forward (mimo_fn.speculative.dflash) follow z-lab's published model code; no
DFlash checkpoint for MiMo-V2-Flash exists to check one against.

What this engine's draft does not implement is refused with a ValueError that names it:
the DFlash2 variant (dynamic convolutions, a candidate selector), sliding-window or causal
draft layers, attention biases, and scaled or soft-capped draft logits.
"""

import json
import os
from dataclasses import fields

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mimo_fn.config import ModelConfig
from mimo_fn.speculative.dflash_params import DFlashConfig, DFlashParams, DraftLayer
from mimo_fn.speculative.draft_vocab import check_vocab

_LAYER_NAMES = {  # DraftLayer field -> tensor name under layers.{i}.
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
_TOP_NAMES = {"fc": "fc.weight", "hidden_norm": "hidden_norm.weight", "norm": "norm.weight"}
VOCAB = "draft_vocab"


def dflash_config_from_hf(hf: dict, cfg: ModelConfig) -> DFlashConfig:
    """The DFlashConfig of a z-lab config.json dict, checked against the target config."""
    draft = {**hf, **hf.get("dflash_config", {})}

    def need(name):
        if draft.get(name) is None:
            raise ValueError(f"DFlash config: {name!r} is missing (expected in dflash_config or at the top level)")
        return draft[name]

    arch = hf.get("architectures") or []
    if any("DFlash2" in a for a in arch):
        raise ValueError(f"DFlash config: architecture {arch} (DFlash2: dynamic convolutions and a candidate "
                         "selector) is not supported; expected DFlashDraftModel")
    for name in ("selector_rank", "conv_kernel_size"):
        if draft.get(name) is not None:
            raise ValueError(f"DFlash config: {name!r} belongs to DFlash2, which is not supported")
    if "sliding_attention" in (hf.get("layer_types") or []) or hf.get("is_causal"):
        raise ValueError("DFlash config: sliding-window or causal draft layers are not supported; "
                         "expected full bidirectional attention in every draft layer")
    if hf.get("attention_bias"):
        raise ValueError("DFlash config: attention_bias = true is not supported")
    if float(draft.get("output_multiplier") or 1.0) != 1.0 or float(draft.get("final_logit_softcapping") or 0):
        raise ValueError("DFlash config: output_multiplier / final_logit_softcapping on the draft logits are "
                         "not supported")
    if need("hidden_size") != cfg.hidden_size:
        raise ValueError(f"DFlash config: hidden_size {hf['hidden_size']} differs from the target's "
                         f"{cfg.hidden_size}: the draft reads the target's hidden states and embeddings")
    rope = hf.get("rope_parameters") or {}
    heads = need("num_attention_heads")
    dcfg = DFlashConfig(
        target_layers=tuple(int(i) for i in need("target_layer_ids")), mask_token_id=int(need("mask_token_id")),
        block_size=int(draft.get("block_size", 16)), num_layers=int(need("num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(need("num_key_value_heads")), head_dim=int(hf.get("head_dim") or cfg.hidden_size // heads),
        intermediate_size=int(need("intermediate_size")),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )
    dcfg.check(cfg)
    return dcfg


def dflash_config_to_hf(dcfg: DFlashConfig, cfg: ModelConfig) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "num_hidden_layers": dcfg.num_layers, "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads, "head_dim": dcfg.head_dim,
        "intermediate_size": dcfg.intermediate_size, "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": dcfg.rope_theta, "rope_type": "default"}, "attention_bias": False,
        "vocab_size": cfg.vocab_size, "num_target_layers": cfg.num_layers,
        "dflash_config": {"target_layer_ids": list(dcfg.target_layers), "mask_token_id": dcfg.mask_token_id,
                          "block_size": dcfg.block_size},
    }


def _flat_names(num_layers: int) -> list[str]:
    return list(_TOP_NAMES.values()) + [f"layers.{i}.{n}" for i in range(num_layers) for n in _LAYER_NAMES.values()]


def load_dflash(path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu") -> tuple[DFlashConfig, DFlashParams]:
    """Read a DFlash draft directory (config.json + *.safetensors) for the target `cfg`."""
    path = os.fspath(path)
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"DFlash checkpoint {path!r}: no config.json") from None
    dcfg = dflash_config_from_hf(hf, cfg)
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"DFlash checkpoint {path!r}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    want = _flat_names(dcfg.num_layers)
    missing, extra = [n for n in want if n not in tensors], sorted(set(tensors) - set(want) - {VOCAB})
    if missing or extra:
        raise ValueError(f"DFlash checkpoint {path!r}: missing tensors {missing[:4]}{'...' if len(missing) > 4 else ''}"
                         f", unknown tensors {extra[:4]}{'...' if len(extra) > 4 else ''}")
    H, N, G, D, F = cfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size
    shapes = {"attn_norm": (H,), "wq": (N * D, H), "wk": (G * D, H), "wv": (G * D, H), "wo": (H, N * D),
              "q_norm": (D,), "k_norm": (D,), "mlp_norm": (H,), "w_gate": (F, H), "w_up": (F, H), "w_down": (H, F),
              "fc": (H, len(dcfg.target_layers) * H), "hidden_norm": (H,), "norm": (H,)}

    def take(field: str, name: str) -> torch.Tensor:
        t = tensors[name]
        if tuple(t.shape) != shapes[field]:
            raise ValueError(f"DFlash checkpoint {path!r}: {name} has shape {list(t.shape)}, expected "
                             f"{list(shapes[field])} from config.json")
        return t.to(device=device, dtype=dtype)

    layers = tuple(DraftLayer(**{f: take(f, f"layers.{i}.{n}") for f, n in _LAYER_NAMES.items()})
                   for i in range(dcfg.num_layers))
    vocab = tensors.get(VOCAB)
    if vocab is not None:
        check_vocab(vocab, cfg.vocab_size, f"DFlash checkpoint {path!r}: {VOCAB}")
        vocab = vocab.to(device)
    params = DFlashParams(take("fc", "fc.weight"), take("hidden_norm", "hidden_norm.weight"), layers,
                          take("norm", "norm.weight"), vocab)
    return dcfg, params


def save_dflash(params: DFlashParams, dcfg: DFlashConfig, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write config.json and model.safetensors in z-lab's layout (what load_dflash reads)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dflash_config_to_hf(dcfg, cfg), f, indent=2)
    flat = {name: getattr(params, field) for field, name in _TOP_NAMES.items()}
    for i, layer in enumerate(params.layers):
        flat.update({f"layers.{i}.{_LAYER_NAMES[f.name]}": getattr(layer, f.name) for f in fields(layer)})
    if params.vocab is not None:
        flat[VOCAB] = params.vocab
    save_file({k: v.detach().contiguous().cpu() for k, v in flat.items()}, os.path.join(path, "model.safetensors"))
