"""Masked softmax attention with sinks: the one reference every attention path is checked against.

Legend: Q queries, L keys, N query heads, G kv heads, D q/k head dim, E v head dim.

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
