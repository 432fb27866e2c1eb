"""Configuration records: ModelConfig (the architecture), CacheConfig and ParallelConfig.

All are frozen dataclasses of plain values; derived values are properties. An invalid
value raises ValueError naming the field, the value and what was expected.
"""

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any

FULL, SWA = "full_attention", "sliding_attention"
DENSE, MOE = "dense", "sparse"


def _fail(name: str, value: Any, expected: str) -> None:
    raise ValueError(f"config field {name!r} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 152576
    hidden_size: int = 4096
    intermediate_size: int = 16384  # dense SwiGLU MLP of layer 0
    num_layers: int = 48
    num_heads: int = 64  # query heads, same on both layer types
    num_kv_heads: int = 4  # full-attention layers
    num_swa_kv_heads: int = 8  # sliding-window layers carry twice the KV heads
    head_dim: int = 192  # q and k
    v_head_dim: int = 128
    layer_types: tuple[str, ...] = ()  # FULL or SWA per layer; () = the released pattern
    mlp_types: tuple[str, ...] = ()  # DENSE or MOE per layer; () = dense layer 0, MoE after
    sliding_window: int = 128  # a query at p sees keys p-window+1 .. p
    rope_theta: float = 5_000_000.0  # full-attention layers
    swa_rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.334  # RoPE on the first int(head_dim * f) dims
    attention_value_scale: float = 0.707  # V multiplied by this before attention
    swa_sinks: bool = True  # learned per-head sink logit on SWA layers
    full_sinks: bool = False
    num_experts: int = 256
    top_k: int = 8
    moe_intermediate_size: int = 2048
    n_group: int = 1  # router: experts split into groups, best topk_group groups kept
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144

    def __post_init__(self) -> None:
        n = self.num_layers
        if not self.layer_types:
            pattern = tuple(FULL if i == 0 or (i + 1) % 6 == 0 else SWA for i in range(n))
            object.__setattr__(self, "layer_types", pattern)
        if not self.mlp_types:
            object.__setattr__(self, "mlp_types", (DENSE,) + (MOE,) * (n - 1))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                _fail(f.name, v, "a positive int")
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SWA}:
            _fail("layer_types", self.layer_types, f"{self.num_layers} entries of {FULL!r}/{SWA!r}")
        if len(self.mlp_types) != self.num_layers or not set(self.mlp_types) <= {DENSE, MOE}:
            _fail("mlp_types", self.mlp_types, f"{self.num_layers} entries of {DENSE!r}/{MOE!r}")
        for name in ("num_kv_heads", "num_swa_kv_heads"):
            if self.num_heads % getattr(self, name):
                _fail(name, getattr(self, name), f"a divisor of num_heads={self.num_heads}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rope_dim % 2:
            _fail("partial_rotary_factor", self.partial_rotary_factor,
                  f"in (0, 1] with int(head_dim * f) even (head_dim={self.head_dim})")
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"<= num_experts={self.num_experts}")
        if self.num_experts % self.n_group:
            _fail("n_group", self.n_group, f"a divisor of num_experts={self.num_experts}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            _fail("n_group", self.n_group, "groups of at least 2 experts (groups are scored by their top-2)")
        if not 1 <= self.topk_group <= self.n_group:
            _fail("topk_group", self.topk_group, f"in [1, n_group={self.n_group}]")
        if self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            _fail("topk_group", self.topk_group, f"groups holding at least top_k={self.top_k} experts")
        for name in ("rope_theta", "swa_rope_theta", "rms_norm_eps", "routed_scaling_factor",
                     "attention_value_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                _fail(name, v, "a positive finite number")

    # ---- derived ----
    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def is_swa(self, layer: int) -> bool:
        return self.layer_types[layer] == SWA

    def is_moe(self, layer: int) -> bool:
        return self.mlp_types[layer] == MOE

    def kv_heads(self, layer: int) -> int:
        return self.num_swa_kv_heads if self.is_swa(layer) else self.num_kv_heads

    def has_sinks(self, layer: int) -> bool:
        return self.swa_sinks if self.is_swa(layer) else self.full_sinks

    def window(self, layer: int) -> int:
        return self.sliding_window if self.is_swa(layer) else 0

    def theta(self, layer: int) -> float:
        return self.swa_rope_theta if self.is_swa(layer) else self.rope_theta

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_swa(i))

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_swa(i))

    # ---- presets ----
    @classmethod
    def flash(cls, **overrides: Any) -> "ModelConfig":
        """The released MiMo-V2-Flash dimensions; flash(num_layers=6) is its first six layers
        (full, 4 x SWA, full; dense layer 0, MoE after), the slice the benchmarks run."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """CPU-test size with every feature present: full + SWA layers, sinks, GQA on both
        layer types, head_dim != v_head_dim, partial RoPE, dense first layer, grouped router."""
        base = dict(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=4,
            num_kv_heads=1, num_swa_kv_heads=2, head_dim=24, v_head_dim=16,
            layer_types=(FULL, SWA, SWA, FULL), mlp_types=(DENSE, MOE, MOE, MOE),
            sliding_window=8, rope_theta=5e6, swa_rope_theta=1e4, partial_rotary_factor=0.334,
            num_experts=8, top_k=2, moe_intermediate_size=32, n_group=2, topk_group=1,
            routed_scaling_factor=1.5, max_position_embeddings=4096,
        )
        base.update(overrides)
        return cls(**base)

    # ---- config.json ----
    @classmethod
    def from_hf(cls, path_or_dict: "str | os.PathLike | dict[str, Any]") -> "ModelConfig":
        """Read transformers' MiMoV2FlashConfig config.json, or the originally released one.

        The released file names things differently: `hybrid_layer_pattern` (0 full, 1 SWA),
        `moe_layer_freq` (0 dense, 1 MoE), `swa_num_key_value_heads`, `swa_rope_theta`,
        `sliding_window_size`, `add_{swa,full}_attention_sink_bias`, `layernorm_epsilon`,
        and `routed_scaling_factor: null` (meaning 1.0).
        """
        if isinstance(path_or_dict, dict):
            d = path_or_dict
        else:
            p = os.fspath(path_or_dict)
            p = os.path.join(p, "config.json") if os.path.isdir(p) else p
            with open(p) as f:
                d = json.load(f)
        d = d.get("text_config", d)
        # Fields that set the model's shape or its attention pattern must be in the file: a
        # default here would load weights of another size, or run another model. (Aliases: the
        # released file's names.) The others default below as transformers' MiMoV2FlashConfig does.
        for keys in (("vocab_size",), ("hidden_size",), ("intermediate_size",), ("num_hidden_layers",),
                     ("num_attention_heads",), ("num_key_value_heads",), ("head_dim",), ("v_head_dim",),
                     ("n_routed_experts",), ("num_experts_per_tok",), ("moe_intermediate_size",),
                     ("sliding_window", "sliding_window_size"), ("layer_types", "hybrid_layer_pattern")):
            if all(d.get(k) is None for k in keys):
                raise ValueError(f"config.json has no {' or '.join(repr(k) for k in keys)}: it sets the model's "
                                 "shape, so it has no default")
        for key in ("layer_types", "mlp_layer_types", "hybrid_layer_pattern", "moe_layer_freq"):
            if d.get(key) is not None and not isinstance(d[key], (list, tuple)):
                _fail(key, d[key], "a list with one entry per layer")
        # transformers' default; the released file says 262144
        kw: dict[str, Any] = {"max_position_embeddings": 131072}

        def take(src: str, dst: str, conv=lambda v: v) -> None:
            if d.get(src) is not None:
                kw[dst] = conv(d[src])

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "v_head_dim", "moe_intermediate_size",
                    "n_group", "topk_group", "norm_topk_prob", "tie_word_embeddings",
                    "max_position_embeddings", "attention_value_scale", "rms_norm_eps",
                    "routed_scaling_factor", "partial_rotary_factor", "rope_theta"):
            take(key, {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads"}.get(key, key))
        take("num_hidden_layers", "num_layers")
        take("n_routed_experts", "num_experts")
        take("num_experts_per_tok", "top_k")
        take("layernorm_epsilon", "rms_norm_eps")
        take("sliding_window", "sliding_window")
        take("sliding_window_size", "sliding_window")
        take("swa_rope_theta", "swa_rope_theta")
        take("add_swa_attention_sink_bias", "swa_sinks", bool)
        take("add_full_attention_sink_bias", "full_sinks", bool)
        take("layer_types", "layer_types", tuple)
        take("mlp_layer_types", "mlp_types", tuple)
        take("hybrid_layer_pattern", "layer_types", lambda v: tuple(SWA if x else FULL for x in v))
        take("moe_layer_freq", "mlp_types", lambda v: tuple(MOE if x else DENSE for x in v))
        # Full and SWA layers share query heads and head dims in this family; say so if not.
        for key, ref in (("swa_num_attention_heads", "num_heads"), ("swa_head_dim", "head_dim"),
                         ("swa_v_head_dim", "v_head_dim")):
            if d.get(key) is not None and d[key] != kw.get(ref, getattr(cls, ref)):
                _fail(key, d[key], f"equal to {ref}={kw.get(ref, getattr(cls, ref))} (not supported otherwise)")
        if "swa_num_key_value_heads" in d:
            kw["num_swa_kv_heads"] = d["swa_num_key_value_heads"]
        elif "num_kv_heads" in kw:  # transformers doubles the KV heads on SWA layers
            kw["num_swa_kv_heads"] = 2 * kw["num_kv_heads"]
        rope = d.get("rope_parameters") or {}
        if FULL in rope or SWA in rope:
            for lt, dst in ((FULL, "rope_theta"), (SWA, "swa_rope_theta")):
                if rope.get(lt):
                    kw[dst] = float(rope[lt]["rope_theta"])
                    kw["partial_rotary_factor"] = rope[lt].get("partial_rotary_factor", 0.334)
                    if rope[lt].get("rope_type", "default") != "default":
                        _fail(f"rope_parameters.{lt}.rope_type", rope[lt]["rope_type"], "'default'")
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            _fail("scoring_func", d["scoring_func"], "'sigmoid'")
        if d.get("hidden_act", "silu") != "silu":
            _fail("hidden_act", d["hidden_act"], "'silu'")
        if "attention_value_scale" in d and d["attention_value_scale"] is None:
            kw["attention_value_scale"] = 1.0
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """config.json as transformers' MiMoV2FlashConfig writes it."""
        rope = {lt: {"rope_type": "default", "rope_theta": th, "partial_rotary_factor": self.partial_rotary_factor}
                for lt, th in ((FULL, self.rope_theta), (SWA, self.swa_rope_theta))}
        if self.num_swa_kv_heads != 2 * self.num_kv_heads or self.full_sinks or not self.swa_sinks:
            raise ValueError(
                "to_hf: transformers' MiMoV2Flash needs num_swa_kv_heads == 2 * num_kv_heads, sinks on SWA "
                f"layers only; got num_swa_kv_heads={self.num_swa_kv_heads}, num_kv_heads={self.num_kv_heads}, "
                f"swa_sinks={self.swa_sinks}, full_sinks={self.full_sinks}")
        return dict(
            model_type="mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, v_head_dim=self.v_head_dim,
            layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_types),
            sliding_window=self.sliding_window, rope_parameters=rope,
            attention_value_scale=self.attention_value_scale, n_routed_experts=self.num_experts,
            num_experts_per_tok=self.top_k, moe_intermediate_size=self.moe_intermediate_size,
            n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
        )
