"""The attention block: QKV projections with partial RoPE and value scale, the attention itself
(dense over one sequence, or paged over the cache), and the output projection.

Legend: T tokens, H hidden, N query heads, G kv heads, D q/k head dim, E v head dim,
P pages in a pool, S slots per page, B sequences, L logical pages per sequence.
"""

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.batch import StepMeta
from mimo_fn.cache import KVCache
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.attention.dispatch import attention
from mimo_fn.kernels.attention.ref import attend
from mimo_fn.kernels.rope import rope_
from mimo_fn.layers.linear import linear, quantize_once
from mimo_fn.layers.rope import apply_rope, rope_cos_sin
from mimo_fn.params import Attention
from mimo_fn.quant import QActs


@typed
def project_qkv(
    x_TH: Float[Tensor, "T H"] | QActs, attn: Attention, cfg: ModelConfig, layer: int, pos_T: Int[Tensor, " T"]
) -> tuple[Float[Tensor, "T N D"], Float[Tensor, "T G D"], Float[Tensor, "T G E"]]:
    num_tokens, D, E = x_TH.shape[0], cfg.head_dim, cfg.v_head_dim
    x_TH = quantize_once(x_TH, (attn.wq, attn.wk, attn.wv))  # decode: one quantiser launch for the three
    # head counts come from the weights: under attention TP they are this rank's heads
    q_TND = linear(x_TH, attn.wq).view(num_tokens, attn.wq.shape[0] // D, D)
    k_TGD = linear(x_TH, attn.wk).view(num_tokens, attn.wk.shape[0] // D, D)
    v_TGE = linear(x_TH, attn.wv).view(num_tokens, attn.wv.shape[0] // E, E) * cfg.attention_value_scale
    cos_TR, sin_TR = rope_cos_sin(pos_T, cfg.rope_dim, cfg.theta(layer), x_TH.dtype)
    # one kernel in place (q and k are this function's own): apply_rope's bits; autograd (a trainer's
    # forward) needs apply_rope's differentiable ops
    if q_TND.is_cuda and not (q_TND.requires_grad or k_TGD.requires_grad):
        return rope_(q_TND, cos_TR, sin_TR), rope_(k_TGD, cos_TR, sin_TR), v_TGE
    return apply_rope(q_TND, cos_TR, sin_TR), apply_rope(k_TGD, cos_TR, sin_TR), v_TGE


@typed
def project_out(o_TNE: Float[Tensor, "T N E"], attn: Attention) -> Float[Tensor, "T H"]:
    return linear(o_TNE.reshape(o_TNE.shape[0], o_TNE.shape[1] * o_TNE.shape[2]), attn.wo)


@typed
def attend_dense(
    q_TND: Float[Tensor, "T N D"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"],
    pos_T: Int[Tensor, " T"], cfg: ModelConfig, layer: int, sinks_N: Float[Tensor, " N"] | None,
) -> Float[Tensor, "T N E"]:
    """Layer `layer`'s attention over one whole sequence with no cache (the reference forward)."""
    return attend(q_TND, k_TGD, v_TGE, pos_T, pos_T, cfg.scale, cfg.window(layer), sinks_N)


@typed
def attend_paged(
    q_TND: Float[Tensor, "T N D"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"],
    cache: KVCache, meta: StepMeta, cfg: ModelConfig, layer: int, sinks_N: Float[Tensor, " N"] | None,
) -> Float[Tensor, "T N E"]:
    """Layer `layer`'s attention in a paged step: the chunk's keys and values are written into
    the layer's pool (donated: in place), then every query attends its sequence's cached prefix
    and the chunk. The kernel or the reference runs as kernels.attention.dispatch decides; the
    step's largest chunk (meta.max_q_len) lets a decode step take the split-K kernel."""
    if cfg.is_swa(layer):
        pool, j, slot_T, table_BL = cache.swa, cache.swa_layer_slot[layer], meta.swa_slot_T, meta.swa_table_BL
    else:
        pool, j, slot_T, table_BL = cache.full, cache.full_layer_slot[layer], meta.full_slot_T, meta.full_table_BL
    k_PSGD, v_PSGE = pool.k[j], pool.v[j]
    # donated buffers: the chunk's keys and values are written in place, then read back as the prefix
    k_PSGD.view(-1, *k_PSGD.shape[2:]).index_copy_(0, slot_T, k_TGD.to(k_PSGD.dtype))
    v_PSGE.view(-1, *v_PSGE.shape[2:]).index_copy_(0, slot_T, v_TGE.to(v_PSGE.dtype))
    return attention(q_TND.to(k_PSGD.dtype), k_PSGD, v_PSGE, table_BL, meta.cu_q_B1, meta.kv_lens_B,
                     cfg.scale, cfg.window(layer), sinks_N, max_q_len=meta.max_q_len).to(q_TND.dtype)
