"""A step's keys and values written into their paged pool slots: both tensors in one kernel.

Legend: T tokens of the step, G kv heads, D k head dim, E v head dim, P pages, S slots per page.

`store_kv_` does what two `index_copy_` calls along the pool's flattened slot dim do (`store_kv_ref`,
also the CPU path): token t's K row [G, D] and V row [G, E] go to slot slot_T[t] of the layer's pools.
torch's index kernel moves an element at a time (2 bytes in bf16); here a program copies
BLOCK_T whole rows of both with 16-byte accesses, and the step's two launches become one. The bytes
are the same (a copy, no arithmetic). Slots are the engine's (StepMeta's slot maps): in range and
distinct, as index_copy_ needs them too; the kernel does not check them. The attention layer runs
the kernel on CUDA only (off CUDA it runs under Triton's interpreter, which the tests use).
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Int, Tensor, typed

_BLOCK_T = 8  # token rows per program
_BLOCK_C = 512  # columns per copy step (a row of G * D is copied in ceil(G * D / 512) steps)


@triton.jit
def _copy_rows(src_ptr, stride_src, dst_ptr, rows64, slots, ok, W: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows `rows64` of src (W elements each, unit stride) to rows `slots` of dst (W elements a row)."""
    for c in tl.static_range(0, W, BLOCK_C):
        cols = c + tl.arange(0, BLOCK_C)
        m = ok[:, None] & (cols < W)[None, :]
        x = tl.load(src_ptr + rows64[:, None] * stride_src + cols[None, :], mask=m)
        tl.store(dst_ptr + slots[:, None] * W + cols[None, :], x, mask=m)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr, T, stride_kt, stride_vt,
                     KW: tl.constexpr, VW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T),): BLOCK_T tokens' K rows (KW = G * D) and V rows (VW = G * E)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    slots = tl.load(slot_ptr + rows, mask=ok, other=0).to(tl.int64)
    rows64 = rows.to(tl.int64)
    _copy_rows(k_ptr, stride_kt, k_pool_ptr, rows64, slots, ok, KW, BLOCK_C)
    _copy_rows(v_ptr, stride_vt, v_pool_ptr, rows64, slots, ok, VW, BLOCK_C)


def unsupported_reason(k_pool_PSGD: torch.Tensor, v_pool_PSGE: torch.Tensor, k_TGD: torch.Tensor,
                       v_TGE: torch.Tensor) -> str | None:
    """None when the kernel can run the call, else why not (`store_kv_ref` runs it then)."""
    if k_TGD.dtype != k_pool_PSGD.dtype or v_TGE.dtype != v_pool_PSGE.dtype:
        return f"k / v {k_TGD.dtype} / {v_TGE.dtype} into pools of {k_pool_PSGD.dtype} / {v_pool_PSGE.dtype} (a cast)"
    if not (k_pool_PSGD.is_contiguous() and v_pool_PSGE.is_contiguous()):
        return "the pools are not contiguous"
    for name, x in (("k", k_TGD), ("v", v_TGE)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return f"{name}'s [G, head dim] rows are not contiguous (strides {x.stride()})"
    return None


@typed
def store_kv_ref(k_pool_PSGD: Float[Tensor, "P S G D"], v_pool_PSGE: Float[Tensor, "P S G E"],
                 slot_T: Int[Tensor, " T"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"]) -> None:
    """Token t's k and v (cast to the pools' dtypes) into flat slot slot_T[t] of each pool, in place."""
    k_pool_PSGD.view(-1, *k_pool_PSGD.shape[2:]).index_copy_(0, slot_T, k_TGD.to(k_pool_PSGD.dtype))
    v_pool_PSGE.view(-1, *v_pool_PSGE.shape[2:]).index_copy_(0, slot_T, v_TGE.to(v_pool_PSGE.dtype))


@typed
def store_kv_(k_pool_PSGD: Float[Tensor, "P S G D"], v_pool_PSGE: Float[Tensor, "P S G E"],
              slot_T: Int[Tensor, " T"], k_TGD: Float[Tensor, "T G D"], v_TGE: Float[Tensor, "T G E"]) -> None:
    """`store_kv_ref` in one kernel where `unsupported_reason` allows it, else the reference."""
    if unsupported_reason(k_pool_PSGD, v_pool_PSGE, k_TGD, v_TGE) is not None:
        return store_kv_ref(k_pool_PSGD, v_pool_PSGE, slot_T, k_TGD, v_TGE)
    num_tokens = k_TGD.shape[0]
    if num_tokens == 0:
        return None
    _store_kv_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
        k_TGD, v_TGE, k_pool_PSGD, v_pool_PSGE, slot_T, num_tokens, k_TGD.stride(0), v_TGE.stride(0),
        KW=k_TGD.shape[1] * k_TGD.shape[2], VW=v_TGE.shape[1] * v_TGE.shape[2], BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C,
        num_warps=4)
    return None
