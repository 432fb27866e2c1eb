"""Paged ragged attention for MiMo: causal with a prefix in the cache, sliding window, sinks, GQA.

Legend: T query tokens of the batch (flattened), B sequences, N query heads, G kv heads,
D q/k head dim (192), E v head dim (128), P pages in the pool, S slots per page,
L logical pages per sequence in the page table.

Contract shared by the reference and the Triton kernel:
- Sequence b owns queries cu_q_B1[b]:cu_q_B1[b+1]; its cache holds kv_lens_B[b] tokens,
  the current chunk included (written before attention runs), so its query i sits at
  position kv_lens_B[b] - q_len_b + i.
- Logical token j of sequence b lives at page page_table_BL[b, j // S], slot j % S.
  Entries are -1 for pages never allocated or already freed (outside the sliding
  window); a valid call never needs to read one.
- Masking, window and sinks follow `mimo_fn.layers.attend.attend`.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.layers.attend import attend


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
