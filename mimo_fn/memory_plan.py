"""What one rank of a launch will hold, against the GPU's free memory, before anything loads.

Legend: C prefill chunk (tokens a DP rank prefills in one step), K experts per token,
H hidden, I expert intermediate, N query heads, G kv heads, D q/k head dim, Ev v head dim.

Three parts, per rank:
- weights: exact for the formats `load_checkpoint` / `quantize_params` produce, from the same
  rule table that decides each rank's slice (`parallel.sharding.slice_of`): dense weights at
  their dtype (fp32 for the router bias and sinks), FP8 at 1 byte a value plus an fp32 scale
  per 128x128 block, MXFP4 at half a byte plus a byte per 32 values;
- KV cache: exact, the pools `init_state` allocates for the tokens asked for (a rank keeps
  its share of the KV heads under attention TP);
- activations: an estimate of one prefill step's largest temporaries, C tokens at once: the
  MoE's per-(token, k) rows (h [C*K, I] and the down GEMM's y [C*K, H]), attention's q, k, v
  and output rows, a few [C, H] buffers (residual, norm, gathered rows), and with MXFP4 experts
  at large chunks the bf16 copy of the experts' w13 (kernels.moe.mxfp4.dequantize_first). Checked against a
  measured peak in docs/benchmarks.md ("Memory plan"); allocator fragmentation and the CUDA
  context come on top, which is what `headroom` keeps free. With options.attention_fp8
  (MIMO_FN_ATTENTION_FP8=1) a full-attention call also holds its layer's whole K/V pool
  requantised to FP8, and Q8 (`fp8_attention_bytes`): it grows with the pool, not the chunk.
"""

import math
from dataclasses import dataclass

import torch

from mimo_fn import options
from mimo_fn.cache import pool_page_bytes
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.moe.mxfp4 import dequantize_first
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import describe
from mimo_fn.quant import BLOCK, MX_GROUP

WEIGHT_FORMATS = ("none", "fp8", "mxfp4")  # "mxfp4": MXFP4 routed experts, FP8 other GEMM weights
GiB = 2**30


def _local_shape(path: str, shape: tuple[int, ...], cfg: ModelConfig, mesh: Mesh) -> tuple[int, ...]:
    sl = slice_of(path, shape, cfg, mesh)
    if sl is None:
        return shape
    dim, start, stop = sl
    return (*shape[:dim], stop - start, *shape[dim + 1:])


def weight_bytes_per_rank(cfg: ModelConfig, mesh: Mesh, dtype: torch.dtype, quant: str = "none") -> int:
    """Bytes of this rank's weights when stored as `quant` says (see WEIGHT_FORMATS)."""
    if quant not in WEIGHT_FORMATS:
        raise ValueError(f"weight_bytes_per_rank: quant = {quant!r}; expected one of {WEIGHT_FORMATS}")
    elt = torch.empty((), dtype=dtype).element_size()
    total = 0
    for path, info in describe(cfg).items():
        shape = _local_shape(path, info.shape, cfg, mesh)
        values = math.prod(shape)
        *lead, n, k = shape if len(shape) >= 2 else (1, *shape)
        matrices = math.prod(lead)
        if info.fp32:
            total += 4 * values
        elif quant == "mxfp4" and info.quantizable and len(shape) == 3:  # a routed expert stack
            total += values // 2 + values // MX_GROUP
        elif quant != "none" and info.quantizable:
            total += values + 4 * matrices * math.ceil(n / BLOCK) * math.ceil(k / BLOCK)
        else:
            total += elt * values
    return total


def kv_cache_bytes(cfg: ModelConfig, max_tokens: int, page_size: int, dtype: torch.dtype, tp: int = 1,
                   max_swa_tokens: int | None = None) -> int:
    """Bytes of the pools `init_state(max_tokens=..., max_swa_tokens=...)` allocates on a rank."""
    full_b, swa_b = pool_page_bytes(cfg, page_size, dtype, tp)
    return math.ceil(max_tokens / page_size) * full_b + math.ceil((max_swa_tokens or max_tokens) / page_size) * swa_b


def activation_bytes(cfg: ModelConfig, chunk: int, dtype: torch.dtype, tp: int = 1, quant: str = "none",
                     dp: int = 1, ep: int = 1) -> int:
    """An estimate of one prefill step's temporaries at `chunk` tokens (see the module docstring).
    MXFP4 experts add the dense copy of a rank's w13 where the chunk's pairs per expert (the dp
    ranks' chunks reach every expert) take the MoE dispatch's dequantised-copy path."""
    elt = torch.empty((), dtype=dtype).element_size()
    copy = 0
    if quant == "mxfp4" and dequantize_first(dp * chunk * cfg.top_k / cfg.num_experts, on_cuda=True):
        copy = elt * (cfg.num_experts // ep) * 2 * cfg.moe_intermediate_size * cfg.hidden_size
    moe = chunk * cfg.top_k * (cfg.moe_intermediate_size + cfg.hidden_size)
    dense = chunk * 2 * cfg.intermediate_size  # layer 0's gate and up rows
    heads = max(1, cfg.num_heads // tp)
    attn = chunk * (heads * (2 * cfg.head_dim + 2 * cfg.v_head_dim))  # q, k / v (at most q's heads), out
    rows = chunk * 6 * cfg.hidden_size
    return elt * (max(moe, dense) + attn + rows) + copy


def fp8_attention_page_bytes(cfg: ModelConfig, page_size: int, tp: int = 1) -> int:
    """Bytes kernels.attention.fp8_inputs.quantize_paged_kv_fp8 holds per page of the full-attention pool
    while options.attention_fp8 is on (0 when off): one layer's K8 and V8 (a byte a value) and an
    fp32 K and V scale per kv head; a rank keeps its share of the KV heads as pool_page_bytes does."""
    if not options.current().attention_fp8:
        return 0
    kv_heads = max(1, cfg.num_kv_heads // tp)
    return kv_heads * (page_size * (cfg.head_dim + cfg.v_head_dim) + 2 * 4)


def fp8_attention_bytes(cfg: ModelConfig, max_tokens: int, page_size: int, chunk: int, tp: int = 1) -> int:
    """options.attention_fp8's temporaries in one full-attention call (0 when off): the pool's pages
    requantised (`fp8_attention_page_bytes`) and Q8 with an fp32 scale per (token, head)."""
    if not options.current().attention_fp8:
        return 0
    heads = max(1, cfg.num_heads // tp)
    return math.ceil(max_tokens / page_size) * fp8_attention_page_bytes(cfg, page_size, tp) + \
        chunk * heads * (cfg.head_dim + 4)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_cache: int
    activations: int
    free: int | None  # the device's free bytes now (None where not known: the CPU)
    headroom: float  # the share of `free` left unplanned (fragmentation, CUDA context, NCCL buffers)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.free is None or self.total <= (1 - self.headroom) * self.free

    def summary(self) -> str:
        free = "free memory unknown" if self.free is None else f"{self.free / GiB:.1f} GiB free"
        return (f"per rank: weights {self.weights / GiB:.2f} GiB + KV cache {self.kv_cache / GiB:.2f} GiB + "
                f"prefill activations ~{self.activations / GiB:.2f} GiB = {self.total / GiB:.2f} GiB; {free}")

    def check(self) -> None:
        """ValueError naming the parts and what would shrink them when the plan does not fit."""
        if self.fits:
            return
        raise ValueError(
            f"this launch does not fit: {self.summary()}, of which {1 - self.headroom:.0%} is planned. "
            "Shrink it: more ranks over the weights (--tp / --ep), FP8 or MXFP4 weights (--quant), fewer "
            "tokens in flight (prompts, --isl) or a smaller prefill chunk (--chunk)")


def plan_memory(
    cfg: ModelConfig, mesh: Mesh, dtype: torch.dtype, quant: str, max_tokens: int, page_size: int, chunk: int,
    free: int | None, headroom: float = 0.1, extra_weights: int = 0,
) -> MemoryPlan:
    """The plan of one rank: weights as `quant` stores them (plus extra_weights, e.g. a whole
    unsharded copy kept for a reference), KV for max_tokens, one prefill chunk (and FP8
    attention's requantised pool where options.attention_fp8 is on)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"plan_memory: headroom = {headroom}; expected a share in [0, 1)")
    mesh.validate(cfg)
    return MemoryPlan(weight_bytes_per_rank(cfg, mesh, dtype, quant) + extra_weights,
                      kv_cache_bytes(cfg, max_tokens, page_size, dtype, mesh.tp),
                      activation_bytes(cfg, chunk, dtype, mesh.tp, quant, mesh.dp, mesh.ep)
                      + fp8_attention_bytes(cfg, max_tokens, page_size, chunk, mesh.tp), free, headroom)
