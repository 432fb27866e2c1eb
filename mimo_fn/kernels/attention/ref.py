"""The plain-torch attention references: `attend` (masked softmax with sinks over given keys) and
`paged_attention_ref` (the same over a paged cache and a ragged batch), the oracle of every kernel.

Legend: Q queries, L keys, N query heads, G kv heads, D q/k head dim, E v head dim;
paged: T query tokens of the batch, B sequences, P pages in the pool, S slots per page, and
page_table_BL's L its logical pages per sequence (the paged contract: common.py).

A query at absolute position p attends the keys at positions j with j <= p and, when
`window` > 0, j > p - window (transformers' sliding_window_overlay). A per-head sink
logit joins the softmax denominator and nothing else: out = sum_j e^{s_j} v_j / (sum_j
e^{s_j} + e^{sink}). Math is in fp32 whatever the input dtype.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed


@typed
def attend(
    q_QND: Float[Tensor, "Q N D"],
    k_LGD: Float[Tensor, "L G D"],
    v_LGE: Float[Tensor, "L G E"],
    q_pos_Q: Int[Tensor, " Q"],
    k_pos_L: Int[Tensor, " L"],
    scale: float,
    window: int = 0,
    sinks_N: Float[Tensor, " N"] | None = None,
) -> Float[Tensor, "Q N E"]:
    num_heads, num_kv_heads = q_QND.shape[1], k_LGD.shape[1]
    rep = num_heads // num_kv_heads  # GQA: query head n reads kv head n // rep
    k_LND = k_LGD.float().repeat_interleave(rep, dim=1)
    v_LNE = v_LGE.float().repeat_interleave(rep, dim=1)
    s_NQL = torch.einsum("qnd,lnd->nql", q_QND.float(), k_LND) * scale
    allowed_QL = k_pos_L[None, :] <= q_pos_Q[:, None]
    if window > 0:
        allowed_QL &= k_pos_L[None, :] > q_pos_Q[:, None] - window
    s_NQL = s_NQL.masked_fill(~allowed_QL, float("-inf"))
    if sinks_N is not None:
        sink_NQ1 = sinks_N.float()[:, None, None].expand(-1, s_NQL.shape[1], 1)
        p_NQL = torch.softmax(torch.cat([s_NQL, sink_NQ1], dim=-1), dim=-1)[..., :-1]
    else:
        p_NQL = torch.softmax(s_NQL, dim=-1)
    o_QNE = torch.einsum("nql,lne->qne", p_NQL, v_LNE)
    return o_QNE.to(q_QND.dtype)


@typed
def paged_attention_ref(
    q_TND: Float[Tensor, "T N D"],
    k_pages_PSGD: Float[Tensor, "P S G D"],
    v_pages_PSGE: Float[Tensor, "P S G E"],
    page_table_BL: Int[Tensor, "B L"],
    cu_q_B1: Int[Tensor, " B+1"],
    kv_lens_B: Int[Tensor, " B"],
    scale: float,
    window: int = 0,
    sinks_N: Float[Tensor, " N"] | None = None,
) -> Float[Tensor, "T N E"]:
    page_size = k_pages_PSGD.shape[1]
    out_TNE = q_TND.new_empty(q_TND.shape[0], q_TND.shape[1], v_pages_PSGE.shape[-1])
    cu_q, kv_lens = cu_q_B1.tolist(), kv_lens_B.tolist()  # host sync: reference path only
    for b, kv_len in enumerate(kv_lens):
        q0, q1 = cu_q[b], cu_q[b + 1]
        if q1 == q0:
            continue
        first_q_pos = kv_len - (q1 - q0)
        lo = max(0, first_q_pos - window + 1) if window > 0 else 0
        k_pos_L = torch.arange(lo, kv_len, device=q_TND.device)
        pages_L = page_table_BL[b, k_pos_L // page_size].long()
        assert bool((pages_L >= 0).all()), f"sequence {b} reads a freed page"
        slots_L = k_pos_L % page_size
        q_pos_Q = torch.arange(first_q_pos, kv_len, device=q_TND.device)
        out_TNE[q0:q1] = attend(
            q_TND[q0:q1], k_pages_PSGD[pages_L, slots_L], v_pages_PSGE[pages_L, slots_L],
            q_pos_Q, k_pos_L, scale, window, sinks_N,
        )
    return out_TNE
