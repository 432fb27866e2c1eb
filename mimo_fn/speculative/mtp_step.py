"""The MTP layers' forward over paged keys and values, every request of a step batched: what
mimo_fn.speculative.mtp's proposer runs (its docstring has the chain's semantics).

Legend: T rows of a call (all requests'), R requests, J chain steps after the first draft,
H hidden, N query heads, G KV heads, D q/k head dim, E v head dim, P pages, S slots per page,
W page-table width, V vocab.

Each call writes its rows' keys and values into the layer's pages at slot_T (page * S + offset)
and then attends with one paged call (kernels.attention.dispatch.attention: Triton on CUDA, the
reference elsewhere), the rows of a request being the last queries of its kv_lens keys, as the
paged contract (kernels/attention/common.py) has it. The layer is `mtp_model_config`'s one SWA
layer: its window and sinks; a caller passes the window the call's logical positions need.
"""

import torch

from mimo_fn._types import Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.attention.dispatch import attention
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.model import decoder_layer
from mimo_fn.params import Params


@typed
def mtp_rows(layer, mcfg: ModelConfig, target: Params, k_pages: Tensor, v_pages: Tensor, tok_T: Int[Tensor, " T"],
             h_TH: Tensor, pos_T: Int[Tensor, " T"], slot_T: Int[Tensor, " T"], table_BW: Int[Tensor, "B W"],
             cu_q_B1: Int[Tensor, " B+1"], kv_lens_B: Int[Tensor, " B"], window: int,
             max_q_len: int | None = None) -> Tensor:
    """MTP layer `layer` (an MTPLayer) on rows (token, hidden, position) of B requests; returns
    its output [T, H] after the final norm. pos_T: the rows' true positions (their rotary
    angles); slot_T, table_BW, cu_q_B1, kv_lens_B: where they sit in the pages [P, S, G, D|E]."""
    eps = mcfg.rms_norm_eps
    e_TH = rms_norm(target.embed[tok_T].to(layer.enorm.dtype), layer.enorm, eps)
    x_TH = linear(torch.cat([e_TH, rms_norm(h_TH.to(e_TH.dtype), layer.hnorm, eps)], dim=-1), layer.eh_proj)

    def attn_fn(_, q_TND, k_TGD, v_TGE):
        k_pages.view(-1, *k_pages.shape[2:])[slot_T] = k_TGD.to(k_pages.dtype)
        v_pages.view(-1, *v_pages.shape[2:])[slot_T] = v_TGE.to(v_pages.dtype)
        o_TNE = attention(q_TND.to(k_pages.dtype), k_pages, v_pages, table_BW, cu_q_B1, kv_lens_B, mcfg.scale,
                          window, layer.block.attn.sinks, max_q_len=max_q_len)
        return o_TNE.to(q_TND.dtype)

    y_TH, _ = decoder_layer(x_TH, layer.block, mcfg, 0, pos_T, attn_fn)
    return rms_norm(y_TH, layer.final_norm, eps)


def draft_tokens(out_RH: Tensor, target: Params, probs: bool = False) -> tuple[Tensor, Tensor | None]:
    """The target's LM head on MTP outputs (already through their final norm): its argmax [R]
    and, with probs, that token's probability [R] in fp32 (the draft's belief in it: draft_cut's
    input; a softmax over the vocabulary, so only where a cut reads it)."""
    logits_RV = linear(out_RH.to(target.embed.dtype), target.lm_head)
    return logits_RV.argmax(dim=-1), torch.softmax(logits_RV.float(), dim=-1).amax(dim=-1) if probs else None


def mtp_chain(layers, mcfg: ModelConfig, target: Params, k_pages, v_pages, out_RH: Tensor, pos_JR: Tensor,
              slot_JR: Tensor, kv_lens_JR: Tensor, table_RW: Tensor, windows: tuple[int, ...],
              probs: bool = False) -> tuple[Tensor, Tensor | None]:
    """The chain's drafts [R, J + 1] and, with probs, each draft's probability under its step's
    logits (fp32 [R, J + 1]; a confidence cut's input, draft_cut): draft 1 from out_RH (layer 0's output at
    each request's last verified position), then J steps, step j (1-based) running layer
    min(j, len(layers) - 1) on (draft j, the step before's output) at pos_JR[j - 1], its keys and
    values written at slot_JR[j - 1] of that layer's pages (k_pages / v_pages: one per layer),
    attending kv_lens_JR[j - 1] keys of the request's table row in the window windows[layer]. One
    query a request: the split-K decode kernel on CUDA. No host sync: a CUDA graph can hold it."""
    R = out_RH.shape[0]
    cu_q_R1 = torch.arange(R + 1, dtype=torch.int32, device=out_RH.device)
    d_R, p_R = draft_tokens(out_RH, target, probs)
    drafts, beliefs = [d_R], [p_R]
    for j in range(pos_JR.shape[0]):
        li = min(j + 1, len(layers) - 1)
        out_RH = mtp_rows(layers[li], mcfg, target, k_pages[li], v_pages[li], d_R, out_RH, pos_JR[j], slot_JR[j],
                          table_RW, cu_q_R1, kv_lens_JR[j], windows[li], max_q_len=1)
        d_R, p_R = draft_tokens(out_RH, target, probs)
        drafts.append(d_R)
        beliefs.append(p_R)
    return torch.stack(drafts, dim=1), torch.stack(beliefs, dim=1) if probs else None
