"""FP8 attention's inputs (fp8.py's step 1): Q8 with a scale per (token, head) row, and the paged K / V
as K8 [P, S, G, D] and V8 transposed per page [P, G, E, S] with a scale per (page, kv head).

Legend as in fp8.py: T query tokens, B sequences, N query heads, G kv heads, D q/k head dim, E v head
dim, P pages in the pool, S slots per page, L logical pages per sequence.

Every scale is max(amax, SCALE_FLOOR) / 448 and every code e4m3(x / scale) with IEEE divisions and a
round to nearest even: `fp8._quantize_ref` / `fp8.quantize_paged_kv_fp8_ref` give the same bits.
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Int, Shaped, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.quant import FP8_DTYPE, FP8_MAX, SCALE_FLOOR

_SLOT_CHUNK = 32  # page slots per step of the KV quantiser (a [32, 256] fp32 tile, not [S, 256])
_Q_ROWS = 32  # (token, head) rows per program of the Q quantiser (with 8 warps)


@triton.jit
def _quant_rows(src_ptr, stride_src, n_valid, dst_ptr, stride_dst_row, stride_dst_col, scale_ptr,
                NUM_ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
                FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, INTERPRET: tl.constexpr):
    """NUM_ROWS x COLS (rows past n_valid read as 0) -> e4m3 and one scale, in two passes of CHUNK rows:
    the amax, then x / scale. dst strides are free: V pages are written transposed."""
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < COLS
    amax = tl.zeros([BLOCK_C], tl.float32)
    for r0 in range(0, NUM_ROWS, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        x = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :],
                    mask=(rows < n_valid)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), FLOOR_C), FP8_MAX_C)
    for r0 in range(0, NUM_ROWS, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        x = tl.load(src_ptr + rows[:, None] * stride_src + cols[None, :],
                    mask=(rows < n_valid)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        y = tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C)
        tl.store(dst_ptr + rows[:, None] * stride_dst_row + cols[None, :] * stride_dst_col,
                 cast_rne(y, tl.float8e4nv, INTERPRET), mask=(rows < NUM_ROWS)[:, None] & col_ok[None, :])
    tl.store(scale_ptr, scale)


@triton.jit
def _quant_kv_kernel(
    k_ptr, v_ptr, k8_ptr, v8_ptr, sk_ptr, sv_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr,
    stride_kp, stride_ks, stride_kg, stride_vp, stride_vs, stride_vg, stride_pb,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
    FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (B, L, G): logical page j of sequence b, kv head g. K8 [P, S, G, D], V8 [P, G, E, S] and
    the scales [P, G] are contiguous."""
    b, j, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    n_valid = tl.minimum(tl.load(kv_lens_ptr + b).to(tl.int32) - j * PAGE_SIZE, PAGE_SIZE)
    if (q_len == 0) | (n_valid <= 0):  # a sequence without queries reads nothing; a page past kv_len
        return
    page = tl.load(pt_ptr + b * stride_pb + j).to(tl.int64)
    if page < 0:
        return
    _quant_rows(k_ptr + page * stride_kp + g * stride_kg, stride_ks, n_valid,
                k8_ptr + (page * PAGE_SIZE * NUM_KV_HEADS + g) * HEAD_D, NUM_KV_HEADS * HEAD_D, 1,
                sk_ptr + page * NUM_KV_HEADS + g,
                PAGE_SIZE, HEAD_D, BLOCK_D, CHUNK, FP8_MAX_C, FLOOR_C, INTERPRET)
    _quant_rows(v_ptr + page * stride_vp + g * stride_vg, stride_vs, n_valid,
                v8_ptr + (page * NUM_KV_HEADS + g) * HEAD_E * PAGE_SIZE, 1, PAGE_SIZE,
                sv_ptr + page * NUM_KV_HEADS + g,
                PAGE_SIZE, HEAD_E, BLOCK_E, CHUNK, FP8_MAX_C, FLOOR_C, INTERPRET)


@triton.jit
def _quant_q_kernel(q_ptr, q8_ptr, sq_ptr, R, stride_qt, stride_qn, NUM_HEADS: tl.constexpr,
                    D0: tl.constexpr, D1: tl.constexpr, BLOCK_D1: tl.constexpr, ROWS: tl.constexpr,
                    FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (cdiv(R, ROWS),) over the R = T * N (token, head) rows, one scale each. A row's D = D0 + D1
    columns are read as two tiles, D0 a power of two and the rest (D1 valid of BLOCK_D1), so D=192 (128 +
    64) masks no lane, where a 256-wide tile would idle a quarter of them. Q8 [T, N, D] and sq [T, N]
    contiguous: row r's bytes at r * D."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < R
    rows64 = rows.to(tl.int64)
    src = (rows64 // NUM_HEADS) * stride_qt + (rows64 % NUM_HEADS) * stride_qn
    dst = rows64 * (D0 + D1)
    c0 = tl.arange(0, D0)
    x0 = tl.load(q_ptr + src[:, None] + c0[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x0), 1)
    if D1 > 0:
        c1 = D0 + tl.arange(0, BLOCK_D1)
        ok1 = ok[:, None] & (c1 < D0 + D1)[None, :]
        x1 = tl.load(q_ptr + src[:, None] + c1[None, :], mask=ok1, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x1), 1))
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR_C), FP8_MAX_C)  # [ROWS]
    y0 = tl.minimum(tl.maximum(tl.math.div_rn(x0, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q8_ptr + dst[:, None] + c0[None, :], cast_rne(y0, tl.float8e4nv, INTERPRET), mask=ok[:, None])
    if D1 > 0:
        y1 = tl.minimum(tl.maximum(tl.math.div_rn(x1, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
        tl.store(q8_ptr + dst[:, None] + c1[None, :], cast_rne(y1, tl.float8e4nv, INTERPRET), mask=ok1)
    tl.store(sq_ptr + rows64, scale, mask=ok)


@typed
def quantize_paged_kv_fp8(
    k_pages_PSGD: Float[Tensor, "P S G D"], v_pages_PSGE: Float[Tensor, "P S G E"],
    page_table_BL: Int[Tensor, "B L"], kv_lens_B: Int[Tensor, " B"], cu_q_B1: Int[Tensor, " B+1"] | None = None,
) -> tuple[Shaped[Tensor, "P S G D"], Shaped[Tensor, "P G E S"], Float[Tensor, "P G"], Float[Tensor, "P G"]]:
    """(K8 [P, S, G, D], V8 transposed [P, G, E, S], sk [P, G], sv [P, G]) for the pages the batch
    reads (the module docstring); other pages are left unwritten (torch.empty) and never read.
    cu_q_B1: sequences with no query this call are skipped (None: none are)."""
    num_pages, page_size, num_kv_heads, head_d = k_pages_PSGD.shape
    head_e = v_pages_PSGE.shape[-1]
    if k_pages_PSGD.stride(-1) != 1 or v_pages_PSGE.stride(-1) != 1 or page_table_BL.stride(1) != 1:
        raise ValueError("k_pages_PSGD, v_pages_PSGE and page_table_BL rows must be contiguous in their last dim")
    dev = k_pages_PSGD.device
    k8 = torch.empty(num_pages, page_size, num_kv_heads, head_d, dtype=FP8_DTYPE, device=dev)
    v8 = torch.empty(num_pages, num_kv_heads, head_e, page_size, dtype=FP8_DTYPE, device=dev)
    sk = torch.empty(num_pages, num_kv_heads, dtype=torch.float32, device=dev)
    sv = torch.empty_like(sk)
    num_seqs, num_logical = page_table_BL.shape
    if cu_q_B1 is None:
        cu_q_B1 = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev)  # one query each: all read
    if num_seqs and num_logical and num_kv_heads:
        _quant_kv_kernel[(num_seqs, num_logical, num_kv_heads)](
            k_pages_PSGD, v_pages_PSGE, k8, v8, sk, sv, page_table_BL, cu_q_B1, kv_lens_B,
            k_pages_PSGD.stride(0), k_pages_PSGD.stride(1), k_pages_PSGD.stride(2),
            v_pages_PSGE.stride(0), v_pages_PSGE.stride(1), v_pages_PSGE.stride(2), page_table_BL.stride(0),
            PAGE_SIZE=page_size, NUM_KV_HEADS=num_kv_heads, HEAD_D=head_d, BLOCK_D=triton.next_power_of_2(head_d),
            HEAD_E=head_e, BLOCK_E=triton.next_power_of_2(head_e), CHUNK=min(_SLOT_CHUNK, page_size),
            FP8_MAX_C=FP8_MAX, FLOOR_C=SCALE_FLOOR, INTERPRET=not k_pages_PSGD.is_cuda, num_warps=4)
    return k8, v8, sk, sv


@typed
def quantize_q_fp8(q_TND: Float[Tensor, "T N D"]) -> tuple[Shaped[Tensor, "T N D"], Float[Tensor, "T N"]]:
    """(Q8 [T, N, D] e4m3, sq [T, N]): one scale per (token, head) row, max(amax, floor) / 448."""
    num_tokens, num_heads, head_d = q_TND.shape
    q8 = torch.empty(num_tokens, num_heads, head_d, dtype=FP8_DTYPE, device=q_TND.device)
    sq = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q_TND.device)
    if num_tokens and num_heads:
        rows = num_tokens * num_heads
        d0 = 1 << (head_d.bit_length() - 1)  # the largest power of two in D
        _quant_q_kernel[(triton.cdiv(rows, _Q_ROWS),)](
            q_TND, q8, sq, rows, q_TND.stride(0), q_TND.stride(1), NUM_HEADS=num_heads, D0=d0, D1=head_d - d0,
            BLOCK_D1=triton.next_power_of_2(max(head_d - d0, 1)), ROWS=_Q_ROWS, FP8_MAX_C=FP8_MAX,
            FLOOR_C=SCALE_FLOOR, INTERPRET=not q_TND.is_cuda, num_warps=8)
    return q8, sq
