"""The attention block: QKV projections with partial RoPE and value scale, the attention itself
(dense over one sequence, or paged over the cache), and the output projection.

Legend: T tokens, H hidden, N query heads, G kv heads, D q/k head dim, E v head dim,
P pages in a pool, S slots per page, B sequences, L logical pages per sequence.

deterministic (every function's flag; EngineConfig.deterministic): the projections run the
fixed-tiling linears and the attention the one kernel config of kernels.attention.dispatch, the
dense (reference) forward included, whose keys are then laid out as pages of one sequence.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.batch import StepMeta
from mimo_fn.cache import KVCache
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.attention.dispatch import attention
from mimo_fn.kernels.attention.ref import attend
from mimo_fn.kernels.kv_store import store_kv_, store_kv_ref
from mimo_fn.kernels.rope import rope_
from mimo_fn.layers.linear import linear, quantize_once
from mimo_fn.layers.rope import apply_rope, rope_cos_sin
from mimo_fn.params import Attention
from mimo_fn.quant import QActs


@typed
def project_qkv(
    x_TH: Float[Tensor, "T H"] | QActs, attn: Attention, cfg: ModelConfig, layer: int, pos_T: Int[Tensor, " T"],
    deterministic: bool = False,
) -> tuple[Float[Tensor, "T N D"], Float[Tensor, "T G D"], Float[Tensor, "T G E"]]:
    num_tokens, D, E = x_TH.shape[0], cfg.head_dim, cfg.v_head_dim
    det = deterministic
    x_TH = quantize_once(x_TH, (attn.wq, attn.wk, attn.wv), det)  # one quantiser launch for the three
    # head counts come from the weights: under attention TP they are this rank's heads
    q_TND = linear(x_TH, attn.wq, deterministic=det).view(num_tokens, attn.wq.shape[0] // D, D)
    k_TGD = linear(x_TH, attn.wk, deterministic=det).view(num_tokens, attn.wk.shape[0] // D, D)
    v_TGE = linear(x_TH, attn.wv, deterministic=det).view(num_tokens, attn.wv.shape[0] // E, E) * \
        cfg.attention_value_scale
    cos_TR, sin_TR = rope_cos_sin(pos_T, cfg.rope_dim, cfg.theta(layer), x_TH.dtype)
    # one kernel in place (q and k are this function's own): apply_rope's bits; autograd (a trainer's
    # forward) needs apply_rope's differentiable ops
    if q_TND.is_cuda and not (q_TND.requires_grad or k_TGD.requires_grad):
        return rope_(q_TND, cos_TR, sin_TR), rope_(k_TGD, cos_TR, sin_TR), v_TGE
    return apply_rope(q_TND, cos_TR, sin_TR), apply_rope(k_TGD, cos_TR, sin_TR), v_TGE


@typed
def project_out(o_TNE: Float[Tensor, "T N E"], attn: Attention, deterministic: bool = False) -> Float[Tensor, "T H"]:
    return linear(o_TNE.reshape(o_TNE.shape[0], o_TNE.shape[1] * o_TNE.shape[2]), attn.wo, deterministic=deterministic)


@typed
def attend_dense(
    q_TND: Float[Tensor, "T N D"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"],
    pos_T: Int[Tensor, " T"], cfg: ModelConfig, layer: int, sinks_N: Float[Tensor, " N"] | None,
    deterministic: bool = False,
) -> Float[Tensor, "T N E"]:
    """Layer `layer`'s attention over one whole sequence (positions 0..T-1) with no cache (the
    reference forward). deterministic, on CUDA: the paged steps' kernel in its deterministic
    config, over the keys laid out as the pages of one sequence, so each row has the bits an
    engine step gives it."""
    if deterministic and q_TND.is_cuda:
        return _attend_as_pages(q_TND, k_TGD, v_TGE, cfg.scale, cfg.window(layer), sinks_N)
    return attend(q_TND, k_TGD, v_TGE, pos_T, pos_T, cfg.scale, cfg.window(layer), sinks_N)


_DENSE_PAGE = 128  # the engine's default page size (any size gives the same bits)


def _attend_as_pages(q_TND, k_TGD, v_TGE, scale: float, window: int, sinks_N):
    num_tokens, num_kv_heads = k_TGD.shape[:2]
    num_pages = max(1, -(-num_tokens // _DENSE_PAGE))
    k_PSGD = k_TGD.new_zeros(num_pages * _DENSE_PAGE, num_kv_heads, k_TGD.shape[2])
    v_PSGE = v_TGE.new_zeros(num_pages * _DENSE_PAGE, num_kv_heads, v_TGE.shape[2])
    k_PSGD[:num_tokens], v_PSGE[:num_tokens] = k_TGD, v_TGE
    dev = q_TND.device
    table_1L = torch.arange(num_pages, dtype=torch.int32, device=dev)[None]
    cu_q_2 = torch.tensor([0, num_tokens], dtype=torch.int32, device=dev)
    kv_lens_1 = torch.tensor([num_tokens], dtype=torch.int32, device=dev)
    return attention(q_TND, k_PSGD.view(num_pages, _DENSE_PAGE, *k_PSGD.shape[1:]),
                     v_PSGE.view(num_pages, _DENSE_PAGE, *v_PSGE.shape[1:]), table_1L, cu_q_2, kv_lens_1, scale,
                     window, sinks_N, use_reference=False, deterministic=True)


@typed
def attend_paged(
    q_TND: Float[Tensor, "T N D"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"],
    cache: KVCache, meta: StepMeta, cfg: ModelConfig, layer: int, sinks_N: Float[Tensor, " N"] | None,
    deterministic: bool = False,
) -> Float[Tensor, "T N E"]:
    """Layer `layer`'s attention in a paged step: the chunk's keys and values are written into
    the layer's pool (donated: in place), then every query attends its sequence's cached prefix
    and the chunk. The kernel or the reference runs as kernels.attention.dispatch decides; the
    step's largest chunk (meta.max_q_len) lets a decode step take the split-K kernel, except in
    deterministic mode (one kernel config for every step)."""
    if cfg.is_swa(layer):
        pool, j, slot_T, table_BL = cache.swa, cache.swa_layer_slot[layer], meta.swa_slot_T, meta.swa_table_BL
    else:
        pool, j, slot_T, table_BL = cache.full, cache.full_layer_slot[layer], meta.full_slot_T, meta.full_table_BL
    k_PSGD, v_PSGE = pool.k[j], pool.v[j]
    # donated buffers: the chunk's keys and values are written in place, then read back as the prefix
    (store_kv_ if k_TGD.is_cuda else store_kv_ref)(k_PSGD, v_PSGE, slot_T, k_TGD, v_TGE)
    return attention(q_TND.to(k_PSGD.dtype), k_PSGD, v_PSGE, table_BL, meta.cu_q_B1, meta.kv_lens_B,
                     cfg.scale, cfg.window(layer), sinks_N, max_q_len=meta.max_q_len,
                     deterministic=deterministic).to(q_TND.dtype)
