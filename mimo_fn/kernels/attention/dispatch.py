"""Which attention implementation runs a paged call: decided here, once, and nowhere else.

Legend as in common.py: T query tokens, B sequences, N query heads, G kv heads, D q/k head dim,
E v head dim, P pages in the pool, S slots per page, L logical pages per sequence.

`attention` picks between the reference and the kernels: the plain-torch reference off CUDA (or
with options.attention_ref); on CUDA the split-K decode kernel when the caller knows every
sequence has one query, else `paged_attention`. That picks among the prefill kernels on CUDA:
with options.attention_fp8 (MIMO_FN_ATTENTION_FP8=1, off by default) FP8 attention (fp8.py: its
quantisers, then the warp-specialised Gluon FP8 kernel of fp8_ws.py on Hopper, its Triton kernel
elsewhere) for full attention it supports (`fp8_serves`), then the warp-specialised Gluon kernel
(ws.py) for full attention on Hopper, the one-pass band kernel (swa.py) for 16-bit windows that fit
its band, and the Triton loop kernel (prefill.py) for the rest; off CUDA (the interpreter) the loop
kernel. All share common.py's contract, which the reference off CUDA checks too (`_check_inputs`):
a CPU test then refuses what only a GPU's kernel would (a stride-0 page table, say).

Deterministic mode (`attention(..., deterministic=True)` on CUDA) runs the loop kernel for every
call, decode and verify steps included, with one config (prefill.deterministic_prefill_config):
its key-block order for a query row is fixed by the row's position, so the row's bits are the same
whether its keys came from this chunk, an earlier one, a forked prefix or a cache entry. The
split-K decode kernel (its split count follows the batch) and the Gluon / band / FP8 kernels (other
tilings than decode's; FP8 other numerics) are left out.
"""

import torch

from mimo_fn import options
from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.kernels.attention import fp8, swa, ws
from mimo_fn.kernels.attention.common import _check_inputs
from mimo_fn.kernels.attention.decode import paged_decode_attention
from mimo_fn.kernels.attention.prefill import deterministic_prefill_config, launch_prefill
from mimo_fn.kernels.attention.ref import paged_attention_ref


def fp8_serves(q_TND, k_pages_PSGD, v_pages_PSGE, window: int) -> bool:
    """Whether `paged_attention` sends this call (on CUDA) to the FP8 kernel: options.attention_fp8
    is on and fp8.unsupported_reason has no objection (full attention, pages of whole key blocks)."""
    return options.current().attention_fp8 and \
        fp8.unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) is None


@typed
def paged_attention(
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
    """Flash attention over the ragged batch (any query counts); no host sync. On CUDA, full
    attention runs the FP8 kernel (fp8.py) where options.attention_fp8 asks for it and it supports
    the call (`fp8_serves`); otherwise full attention on Hopper runs the warp-specialised Gluon
    kernel (ws.py) and a window that fits its band (16-bit inputs) the one-pass SWA kernel
    (swa.py), where each supports the call
    (and options.attention_ws / attention_band leave it on); everything else runs the Triton
    loop kernel (prefill.py)."""
    args = (q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window, sinks_N)
    if q_TND.is_cuda and window == 0:
        if fp8_serves(q_TND, k_pages_PSGD, v_pages_PSGE, window):
            return fp8.attention_fp8(*args)
        if ws.unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) is None:
            return ws.launch_prefill_ws(*args)
    if q_TND.is_cuda and window > 0 and q_TND.dtype != torch.float32:
        num_heads, num_kv_heads = q_TND.shape[1], k_pages_PSGD.shape[2]
        if options.current().attention_band and num_kv_heads > 0 and num_heads % num_kv_heads == 0:
            cfg = swa.default_band_config(num_heads, num_kv_heads, on_cuda=True)
            if swa.unsupported_reason(num_heads, num_kv_heads, window, cfg) is None:
                return swa.launch_swa_band(*args, config=cfg)
    return launch_prefill(*args)


@typed
def attention(
    q_TND: Float[Tensor, "T N D"],
    k_pages_PSGD: Float[Tensor, "P S G D"],
    v_pages_PSGE: Float[Tensor, "P S G E"],
    page_table_BL: Int[Tensor, "B L"],
    cu_q_B1: Int[Tensor, " B+1"],
    kv_lens_B: Int[Tensor, " B"],
    scale: float,
    window: int = 0,
    sinks_N: Float[Tensor, " N"] | None = None,
    *,
    max_q_len: int | None = None,
    use_reference: bool | None = None,
    deterministic: bool = False,
) -> Float[Tensor, "T N E"]:
    """Triton on CUDA (split-K decode when the caller knows max_q_len == 1), the reference elsewhere.

    max_q_len is host-side knowledge the scheduler already has; without it the general
    kernel runs (correct for decode too). use_reference=None follows options.attention_ref
    (MIMO_FN_ATTENTION_REF=1). deterministic: the loop kernel in one config for every call on
    CUDA (the module docstring).
    """
    args = (q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window, sinks_N)
    if use_reference is None:
        use_reference = options.current().attention_ref
    if use_reference or not q_TND.is_cuda:
        if not q_TND.is_cuda:  # where a GPU would run a kernel: its input contract
            _check_inputs(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N)
        return paged_attention_ref(*args)
    if deterministic:
        num_heads, num_kv_heads = q_TND.shape[1], k_pages_PSGD.shape[2]
        cfg = deterministic_prefill_config(num_heads, max(num_kv_heads, 1), window, True, q_TND.dtype)
        return launch_prefill(*args, config=cfg)
    if max_q_len == 1:
        return paged_decode_attention(*args)
    return paged_attention(*args)
