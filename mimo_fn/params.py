"""Weights as frozen dataclass pytrees, and the one description of every weight.

Legend: V vocab, H hidden, N query heads, G kv heads, D q/k head dim, E_ v head dim,
I intermediate (dense) / expert intermediate, X experts.

`describe(cfg)` is the single source of truth for each weight: its path in the pytree,
its shape, how it is initialised and which hub (save_pretrained) keys hold it. Init,
checkpoint loading/saving and sharding all read it.
"""

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mimo_fn._types import typed
from mimo_fn.config import ModelConfig
from mimo_fn.quant import MX_GROUP, QTensor, quantize_fp8_block, quantize_mxfp4

Weight = torch.Tensor | QTensor


@dataclass(frozen=True)
class Attention:
    wq: Weight  # [N*D, H]
    wk: Weight  # [G*D, H]
    wv: Weight  # [G*E_, H]
    wo: Weight  # [H, N*E_]
    sinks: torch.Tensor | None  # [N] fp32 sink logits, None on layers without sinks


@dataclass(frozen=True)
class DenseMLP:
    w_gate: Weight  # [I, H]
    w_up: Weight  # [I, H]
    w_down: Weight  # [H, I]


@dataclass(frozen=True)
class MoE:
    router: torch.Tensor  # [X, H] router logits weight
    router_bias: torch.Tensor  # [X] fp32 e_score_correction_bias, used for the choice only
    w13: Weight  # [X, 2I, H]: each expert's gate rows then up rows
    w2: Weight  # [X, H, I]


@dataclass(frozen=True)
class Layer:
    attn_norm: torch.Tensor  # [H]
    attn: Attention
    mlp_norm: torch.Tensor  # [H]
    mlp: DenseMLP | MoE


@dataclass(frozen=True)
class Params:
    embed: torch.Tensor  # [V, H]
    layers: tuple[Layer, ...]
    norm: torch.Tensor  # [H]
    lm_head: Weight  # [V, H]


def _flatten(obj: Any) -> tuple[list[Any], tuple[type, tuple[str, ...]]]:
    # Absent weights (None) are structure, not leaves: tree_map never sees them.
    names = tuple(f.name for f in fields(obj) if getattr(obj, f.name) is not None)
    return [getattr(obj, n) for n in names], (type(obj), names)


def _unflatten(children: Any, context: tuple[type, tuple[str, ...]]) -> Any:
    cls, names = context
    kw = {f.name: None for f in fields(cls)}
    kw.update(zip(names, children))
    return cls(**kw)


for _cls in (Attention, DenseMLP, MoE, Layer, Params):
    pytree.register_pytree_node(_cls, _flatten, _unflatten)


@dataclass(frozen=True)
class WeightInfo:
    shape: tuple[int, ...]
    init: str  # "normal" (std 0.02), "ones" or "zeros"
    hub: tuple[str, ...]  # hub keys; several are concatenated/stacked (see checkpoint.py)
    fp32: bool = False  # kept in fp32 whatever the model dtype (router bias, sinks)
    quantizable: bool = False  # a GEMM weight that may be stored as a QTensor


def describe(cfg: ModelConfig) -> dict[str, WeightInfo]:
    """Every weight by its pytree path ('layers.3.attn.wq'), in checkpoint order."""
    H, N, D, Ev = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.v_head_dim
    out = {"embed": WeightInfo((cfg.vocab_size, H), "normal", ("model.embed_tokens.weight",))}
    for i in range(cfg.num_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        G = cfg.kv_heads(i)
        out[p + "attn_norm"] = WeightInfo((H,), "ones", (h + "input_layernorm.weight",))
        for name, shape, key in (("wq", (N * D, H), "q_proj"), ("wk", (G * D, H), "k_proj"),
                                 ("wv", (G * Ev, H), "v_proj"), ("wo", (H, N * Ev), "o_proj")):
            out[p + "attn." + name] = WeightInfo(shape, "normal", (h + f"self_attn.{key}.weight",), quantizable=True)
        if cfg.has_sinks(i):
            out[p + "attn.sinks"] = WeightInfo((N,), "normal", (h + "self_attn.attention_sink_bias",), fp32=True)
        out[p + "mlp_norm"] = WeightInfo((H,), "ones", (h + "post_attention_layernorm.weight",))
        if cfg.is_moe(i):
            X, I = cfg.num_experts, cfg.moe_intermediate_size
            ex = h + "mlp.experts.{e}."
            out[p + "mlp.router"] = WeightInfo((X, H), "normal", (h + "mlp.gate.weight",))
            out[p + "mlp.router_bias"] = WeightInfo(
                (X,), "zeros", (h + "mlp.gate.e_score_correction_bias",), fp32=True)
            out[p + "mlp.w13"] = WeightInfo(
                (X, 2 * I, H), "normal", (ex + "gate_proj.weight", ex + "up_proj.weight"), quantizable=True)
            out[p + "mlp.w2"] = WeightInfo((X, H, I), "normal", (ex + "down_proj.weight",), quantizable=True)
        else:
            I = cfg.intermediate_size
            for name, shape, key in (("w_gate", (I, H), "gate_proj"), ("w_up", (I, H), "up_proj"),
                                     ("w_down", (H, I), "down_proj")):
                out[p + "mlp." + name] = WeightInfo(shape, "normal", (h + f"mlp.{key}.weight",), quantizable=True)
    out["norm"] = WeightInfo((H,), "ones", ("model.norm.weight",))
    out["lm_head"] = WeightInfo((cfg.vocab_size, H), "normal", ("lm_head.weight",))
    return out


def from_flat(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Assemble Params from {path: weight} as `describe` names them."""
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "attn."
        attn = Attention(flat[a + "wq"], flat[a + "wk"], flat[a + "wv"], flat[a + "wo"], flat.get(a + "sinks"))
        m = p + "mlp."
        if cfg.is_moe(i):
            mlp: DenseMLP | MoE = MoE(flat[m + "router"], flat[m + "router_bias"], flat[m + "w13"], flat[m + "w2"])
        else:
            mlp = DenseMLP(flat[m + "w_gate"], flat[m + "w_up"], flat[m + "w_down"])
        layers.append(Layer(flat[p + "attn_norm"], attn, flat[p + "mlp_norm"], mlp))
    return Params(flat["embed"], tuple(layers), flat["norm"], flat["lm_head"])


def to_flat(params: Params) -> dict[str, Any]:
    """{path: weight}, the inverse of `from_flat` (None weights are left out)."""
    out: dict[str, Any] = {"embed": params.embed}
    for i, layer in enumerate(params.layers):
        p = f"layers.{i}."
        out[p + "attn_norm"] = layer.attn_norm
        for f in fields(layer.attn):
            if getattr(layer.attn, f.name) is not None:
                out[p + "attn." + f.name] = getattr(layer.attn, f.name)
        out[p + "mlp_norm"] = layer.mlp_norm
        for f in fields(layer.mlp):
            out[p + "mlp." + f.name] = getattr(layer.mlp, f.name)
    out["norm"], out["lm_head"] = params.norm, params.lm_head
    return out


WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_dtype(dtype: torch.dtype | str, where: str) -> torch.dtype:
    """A weights' dtype given as a torch dtype or its name ("bfloat16", as transformers and vLLM
    take it); a ValueError for anything else."""
    if isinstance(dtype, str) and dtype in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[dtype]
    if dtype not in WEIGHT_DTYPES.values():
        raise ValueError(f"{where}: dtype = {dtype!r}; expected one of {list(WEIGHT_DTYPES)} (or the torch dtype)")
    return dtype


@typed
def init_params(
    cfg: ModelConfig, seed: int = 0, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
    quantize: str | None = None,
) -> Params:
    """Random weights, deterministic in (seed, device type): N(0, 0.02) for matrices and sinks,
    ones for norms, zeros for the router bias (as transformers initialises them). Drawn on the
    target device, so the released dims initialise in seconds on a GPU. quantize ("fp8" or
    "mxfp4", quantize_params' expert formats): each weight quantised as soon as it is drawn, the
    same result as quantize_params of the full-precision weights without holding them all (a
    server's dummy FP8 slice beside a colocated trainer: 33 GiB at its peak, not 64)."""
    dtype = weight_dtype(dtype, "init_params")
    if quantize is not None and quantize not in EXPERT_FORMATS:
        raise ValueError(f"init_params: quantize = {quantize!r}; expected None or one of {EXPERT_FORMATS}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"init_params: seed = {seed!r}; expected an int")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    flat = {}
    for path, info in describe(cfg).items():
        out_dtype = torch.float32 if info.fp32 else dtype
        if info.init == "normal":
            t = torch.empty(info.shape, dtype=out_dtype, device=device)
            step = max(1, 2**26 // max(1, t[0].numel()))  # in slabs: no full-size fp32 temporary
            for r in range(0, t.shape[0], step):
                t[r:r + step] = torch.randn(t[r:r + step].shape, generator=gen, device=device) * 0.02
        elif info.init == "ones":
            t = torch.ones(info.shape, dtype=out_dtype, device=device)
        else:
            t = torch.zeros(info.shape, dtype=out_dtype, device=device)
        flat[path] = _quantized(t, info, quantize) if quantize is not None else t
    return from_flat(cfg, flat)


EXPERT_FORMATS = ("fp8", "mxfp4")  # quantize_params(experts=...)


def quantize_params(cfg: ModelConfig, params: Params, experts: str = "fp8") -> Params:
    """Every GEMM weight `describe` marks quantizable as a 128x128-block FP8 QTensor (new
    tensors); embeddings, norms, router, sinks and the LM head stay as they are. experts="mxfp4"
    stores the routed expert stacks (w13, w2) as MXFP4 instead, as the RL release does
    (K, i.e. hidden and expert intermediate sizes, must be multiples of 32). Weights that are
    QTensors already are kept in their format."""
    return from_flat(cfg, quantize_flat(cfg, to_flat(params), experts))


def quantize_flat(cfg: ModelConfig, flat: dict, experts: str = "fp8") -> dict:
    """quantize_params on to_flat's dict, in place, one weight at a time: where the caller holds
    no other reference, each full-precision weight is freed as its quantised one is made, so the
    peak is the full-precision model plus one weight."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"quantize_params: experts = {experts!r}; expected one of {EXPERT_FORMATS}")
    infos = describe(cfg)
    for k in list(flat):
        flat[k] = _quantized(flat[k], infos[k], experts, k)
    return flat


def _quantized(v, info, experts: str, name: str = "") -> torch.Tensor | QTensor:
    """One weight as quantize_params stores it."""
    if not info.quantizable or isinstance(v, QTensor):
        return v
    if experts == "mxfp4" and len(info.shape) == 3:  # the only 3-dim weights: expert stacks
        if v.shape[-1] % MX_GROUP:
            raise ValueError(f"quantize_params: {name!r} is {list(v.shape)}; MXFP4 needs its last dim "
                             f"(K) a multiple of {MX_GROUP}")
        return quantize_mxfp4(v)
    return quantize_fp8_block(v)


def quiet_layers(params: Params, factor: float, inplace: bool = False) -> Params:
    """params with every layer's output projections (attention wo, MLP down) divided by
    `factor` (1: unchanged), for tests and benchmarks on random weights: a random model's greedy
    continuations are close to chaotic, and with quieter layers the residual stream is left to
    the current token's embedding, so the next token depends mostly on the last few. inplace
    divides params' own tensors (no copy: for weights that fill the card) and returns params."""
    if factor == 1.0:
        return params
    if inplace:
        with torch.no_grad():
            for layer in params.layers:
                layer.attn.wo.div_(factor)
                (layer.mlp.w_down if isinstance(layer.mlp, DenseMLP) else layer.mlp.w2).div_(factor)
        return params
    layers = []
    for layer in params.layers:
        mlp = layer.mlp
        mlp = replace(mlp, w_down=mlp.w_down / factor) if isinstance(mlp, DenseMLP) else replace(mlp, w2=mlp.w2 / factor)
        layers.append(replace(layer, attn=replace(layer.attn, wo=layer.attn.wo / factor), mlp=mlp))
    return replace(params, layers=tuple(layers))


def random_params(cfg: ModelConfig, seed: int, dtype: torch.dtype, device, quantize: str | None = None,
                  quiet: float = 1.0) -> Params:
    """init_params' random weights with quiet_layers(quiet) applied before quantize (as init_params
    takes it): with quiet = 1 exactly init_params'; else the full-precision weights are drawn,
    divided in place and quantised one weight at a time (peak: the model in `dtype` plus one
    weight). What benchmarks of speculative decoding serve and train their drafts on."""
    if quiet == 1.0:
        return init_params(cfg, seed=seed, dtype=dtype, device=device, quantize=quantize)
    params = quiet_layers(init_params(cfg, seed=seed, dtype=dtype, device=device), quiet, inplace=True)
    if quantize is None:
        return params
    flat = to_flat(params)
    del params
    return from_flat(cfg, quantize_flat(cfg, flat, quantize))


def weight_bytes(params: Params) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(params))
