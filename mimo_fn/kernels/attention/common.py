"""What the paged attention kernels share: the contract, the Triton tile helpers, the input checks.

Legend: T query tokens of the batch (flattened), B sequences, N query heads, G kv heads,
D q/k head dim (192), E v head dim (128), P pages in the pool, S slots per page,
L logical pages per sequence in the page table.

Contract shared by the reference (ref.py) and every kernel (prefill.py, swa.py, ws.py, decode.py):
- Sequence b owns queries cu_q_B1[b]:cu_q_B1[b+1]; its cache holds kv_lens_B[b] tokens,
  the current chunk included (written before attention runs), so its query i sits at
  position kv_lens_B[b] - q_len_b + i.
- Logical token j of sequence b lives at page page_table_BL[b, j // S], slot j % S.
  Entries are -1 for pages never allocated or already freed (outside the sliding
  window); a valid call never needs to read one.
- Masking, window and sinks follow `ref.attend`.
The Triton kernels additionally require cu_q_B1[0] = 0 and cu_q_B1[-1] = T (every token belongs
to a sequence: rows outside all sequences are left unwritten).
"""

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------
# Triton tile helpers (the kernels: prefill.py, swa.py, decode.py).
#
# Scores are kept in base 2: qk_scale = scale * log2(e) is folded into one multiply, so the
# softmax uses exp2 (one MUFU op) and the sink logit is converted once (sink * log2(e)).
# D is split into a power-of-two head BLOCK_D0 and a remainder BLOCK_D1 (192 = 128 + 64),
# two dot products into one accumulator instead of a 256-wide tile with a third wasted.
# ---------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634
# A finite "minus infinity" for running maxima: exp2(NEG_BIG - m) == 0, and no inf - inf = NaN
# in rows that have seen no key yet.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot, or the same product on fp32 copies (exact for 16-bit inputs): Triton's CPU
    interpreter multiplies bf16 tiles as their raw uint16 bits, so it gets UPCAST."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PREC)
    return out


@triton.jit
def _load_tile(ptr, rows, cols, row_ok, col_limit, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
    """ptr[rows[:, None] + cols[None, :]], masked only where the caller says bounds can bite.
    The offsets are summed before the pointer: loop-invariant offsets stay hoisted."""
    ptrs = ptr + (rows[:, None] + cols[None, :])
    if ROW_MASK:
        if COL_MASK:
            x = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < col_limit), other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if COL_MASK:
            x = tl.load(ptrs, mask=cols[None, :] < col_limit, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _kv_block(
    acc, l_i, m_i, q0, q1,
    k_ptr, v_ptr, pt_row_ptr, page, start_n, pos_m, key_lo, key_hi, window, qk_scale,
    stride_kp, stride_ks, stride_vp, stride_vs,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """One key block [start_n, start_n + BLOCK_N) of online softmax for a tile of query rows.

    Unmasked blocks (MASKED=False) hold only keys every row may see and that are all
    readable; masked blocks also clip loads to [key_lo, key_hi): outside it a page may be
    freed (-1) and a slot may hold garbage (even NaN, which 0 * NaN would spread through P @ V).
    When one page holds the block (PAGE_SIZE % BLOCK_N == 0) the caller passes that page, read
    one block ahead by `_kv_loop`; otherwise `page` is unused and each row finds its own.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)  # logical key positions
    load_n = (offs_n >= key_lo) & (offs_n < key_hi)
    if PAGE_SIZE % BLOCK_N == 0 and HAS_WINDOW:
        # BLOCK_N consecutive slots of one page: a scalar base per step, and row offsets that
        # are the same every step (hoisted out of the loop), not a per-row modulo and multiply.
        # The instruction-bound SWA loop runs 12% fewer instructions (it then needs a register
        # cap, PrefillConfig.max_regs, to keep 3 programs per SM); the full kernel, at 255
        # registers, measured 1-3% slower with it, so it keeps per-row offsets.
        slot0 = start_n % PAGE_SIZE
        k_ptr = k_ptr + (page.to(tl.int64) * stride_kp + slot0 * stride_ks)
        v_ptr = v_ptr + (page.to(tl.int64) * stride_vp + slot0 * stride_vs)
        k_n = tl.arange(0, BLOCK_N) * stride_ks
        v_n = tl.arange(0, BLOCK_N) * stride_vs
    elif PAGE_SIZE % BLOCK_N == 0:
        slot_n = offs_n % PAGE_SIZE
        k_n = page.to(tl.int64) * stride_kp + slot_n * stride_ks
        v_n = page.to(tl.int64) * stride_vp + slot_n * stride_vs
    else:
        slot_n = offs_n % PAGE_SIZE
        if MASKED:
            page_n = tl.load(pt_row_ptr + offs_n // PAGE_SIZE, mask=load_n, other=0).to(tl.int64)
        else:
            page_n = tl.load(pt_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
        k_n = page_n * stride_kp + slot_n * stride_ks
        v_n = page_n * stride_vp + slot_n * stride_vs

    k0 = _load_tile(k_ptr, k_n, tl.arange(0, BLOCK_D0), load_n, HEAD_D, MASKED, False)
    v = _load_tile(v_ptr, v_n, tl.arange(0, BLOCK_E), load_n, HEAD_E, MASKED, BLOCK_E != HEAD_E)
    qk = _dot(q0, tl.trans(k0), None, DOT_PREC, UPCAST)
    if BLOCK_D1 > 0:
        k1 = _load_tile(k_ptr, k_n, BLOCK_D0 + tl.arange(0, BLOCK_D1), load_n, HEAD_D,
                        MASKED, BLOCK_D0 + BLOCK_D1 != HEAD_D)
        qk = _dot(q1, tl.trans(k1), qk, DOT_PREC, UPCAST)
    if MASKED:
        # A valid row's visible keys all lie in [key_lo, key_hi), so these tests alone also
        # drop the unloaded ones; padded rows past the chunk may see garbage but are not stored.
        if HAS_WINDOW:
            # pos - window < key <= pos as one unsigned compare (negative differences wrap high)
            allowed = (pos_m[:, None] - offs_n[None, :]).to(tl.uint32) < window.to(tl.uint32)
        else:
            allowed = offs_n[None, :] <= pos_m[:, None]
        qk = tl.where(allowed, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(v.dtype), v, acc, DOT_PREC, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _block_page(pt_row_ptr, start_n, hi_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical page of key block start_n (0 past hi_n) when one page holds the block, else 0.

    Blocks start at multiples of BLOCK_N, so PAGE_SIZE % BLOCK_N == 0 puts each in one page,
    and it is allocated: every visited block holds at least one key in [key_lo, key_hi).
    """
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pt_row_ptr + start_n // PAGE_SIZE, mask=start_n < hi_n, other=0)
    else:
        page = 0
    return page


@triton.jit
def _find_seq(cu_q_ptr, num_seqs, vblock, TOK: tl.constexpr):
    """Binary search: the last sequence b with cu_q[b] // TOK + b <= vblock."""
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid).to(tl.int32) // TOK + mid <= vblock:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _query_block(cu_q_ptr, num_seqs, vblock, TOK: tl.constexpr):
    """Virtual query block vblock: (sequence, its chunk's first row and length, the block's first
    token in the chunk). tok0 >= q_len marks a spare block: its program has nothing to do."""
    seq = _find_seq(cu_q_ptr, num_seqs, vblock, TOK)
    q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
    tok0 = (vblock - q_start // TOK - seq) * TOK
    return seq, q_start, q_len, tok0


@triton.jit
def _query_rows(tok0, head0, q_start, q_len, kv_len, stride_qt, stride_qn,
                BLOCK_M: tl.constexpr, H_PACK: tl.constexpr):
    """Per query row r (token r // H_PACK, head r % H_PACK): token in the chunk, head, valid,
    absolute position, and its offset in q (T N D)."""
    offs_m = tl.arange(0, BLOCK_M)
    tok_m = tok0 + offs_m // H_PACK
    head_m = head0 + offs_m % H_PACK
    row_ok = tok_m < q_len
    pos_m = kv_len - q_len + tok_m
    q_rows = (q_start + tok_m).to(tl.int64) * stride_qt + head_m * stride_qn
    return tok_m, head_m, row_ok, pos_m, q_rows


@triton.jit
def _softmax_init(sinks_ptr, head_m, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Running (max, sum) before any key. The sink is a logit with no value: it starts both."""
    if HAS_SINKS:
        sink_m = tl.load(sinks_ptr + head_m).to(tl.float32) * 1.4426950408889634
        m_i = tl.maximum(sink_m, NEG_BIG)
        l_i = tl.math.exp2(sink_m - m_i)
    else:
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


# ---------------------------------------------------------------------------------------
# Launcher helpers: tile split of the head dim, input checks, output buffer, kernel arguments.
# ---------------------------------------------------------------------------------------


def _split_head_dim(head_d: int) -> tuple[int, int]:
    """192 -> (128, 64): a power-of-two tile and a remainder tile (0 when D is a power of two)."""
    block_d0 = 1 << (head_d.bit_length() - 1)
    rest = head_d - block_d0
    return block_d0, 0 if rest == 0 else max(16, triton.next_power_of_2(rest))


def _check_inputs(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N):
    """Shapes, dtypes, devices and strides the kernels rely on; returns (N, G, D, E, S, B)."""
    if q_TND.dim() != 3 or k_pages_PSGD.dim() != 4 or v_pages_PSGE.dim() != 4:
        raise ValueError(
            f"expected q_TND 3-d, k_pages_PSGD and v_pages_PSGE 4-d; got shapes {tuple(q_TND.shape)}, "
            f"{tuple(k_pages_PSGD.shape)}, {tuple(v_pages_PSGE.shape)}")
    _, num_heads, head_d = q_TND.shape
    num_pages, page_size, num_kv_heads, k_head_d = k_pages_PSGD.shape
    head_e = v_pages_PSGE.shape[-1]
    if q_TND.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q_TND.dtype must be bfloat16, float16 or float32, got {q_TND.dtype}")
    for name, x in (("k_pages_PSGD", k_pages_PSGD), ("v_pages_PSGE", v_pages_PSGE)):
        if x.dtype != q_TND.dtype:
            raise ValueError(f"{name}.dtype must equal q_TND.dtype {q_TND.dtype}, got {x.dtype}")
    if k_head_d != head_d:
        raise ValueError(f"k_pages_PSGD head dim must equal q_TND's D={head_d}, got {k_head_d}")
    if tuple(v_pages_PSGE.shape[:3]) != (num_pages, page_size, num_kv_heads):
        raise ValueError(f"v_pages_PSGE.shape[:3] must equal k_pages_PSGD's {(num_pages, page_size, num_kv_heads)}, "
                         f"got {tuple(v_pages_PSGE.shape[:3])}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads G={num_kv_heads}")
    if head_d < 16 or head_e < 1:
        raise ValueError(f"head dims must be D >= 16 and E >= 1 (tensor-core tiles), got D={head_d}, E={head_e}")
    for name, x in (("page_table_BL", page_table_BL), ("cu_q_B1", cu_q_B1), ("kv_lens_B", kv_lens_B)):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}.dtype must be int32 or int64, got {x.dtype}")
    if page_table_BL.dim() != 2 or cu_q_B1.dim() != 1 or kv_lens_B.dim() != 1:
        raise ValueError(f"expected page_table_BL 2-d, cu_q_B1 and kv_lens_B 1-d; got shapes "
                         f"{tuple(page_table_BL.shape)}, {tuple(cu_q_B1.shape)}, {tuple(kv_lens_B.shape)}")
    num_seqs = kv_lens_B.shape[0]
    if cu_q_B1.shape[0] != num_seqs + 1 or page_table_BL.shape[0] != num_seqs:
        raise ValueError(f"with B={num_seqs} (kv_lens_B), cu_q_B1 must have B+1 entries and page_table_BL B rows; "
                         f"got {cu_q_B1.shape[0]} and {page_table_BL.shape[0]}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = no window), got {window}")
    if sinks_N is not None and tuple(sinks_N.shape) != (num_heads,):
        raise ValueError(f"sinks_N must have shape ({num_heads},), got {tuple(sinks_N.shape)}")
    named = (("q_TND", q_TND), ("k_pages_PSGD", k_pages_PSGD), ("v_pages_PSGE", v_pages_PSGE),
             ("page_table_BL", page_table_BL), ("cu_q_B1", cu_q_B1), ("kv_lens_B", kv_lens_B))
    named += (("sinks_N", sinks_N),) if sinks_N is not None else ()
    for name, x in named:
        if x.device != q_TND.device:
            raise ValueError(f"{name} is on {x.device}, q_TND on {q_TND.device}: all inputs must share a device")
    for name, x in named[:3]:
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {x.stride()}")
    if cu_q_B1.stride(0) != 1 or kv_lens_B.stride(0) != 1 or page_table_BL.stride(1) != 1:
        raise ValueError("cu_q_B1, kv_lens_B and the rows of page_table_BL must be contiguous")
    return num_heads, num_kv_heads, head_d, head_e, page_size, num_seqs


def _new_out(q_TND, head_e, out_TNE):
    if out_TNE is None:
        return q_TND.new_empty(q_TND.shape[0], q_TND.shape[1], head_e)
    if out_TNE.shape != (q_TND.shape[0], q_TND.shape[1], head_e) or out_TNE.dtype != q_TND.dtype \
            or out_TNE.stride(-1) != 1:
        raise ValueError(f"out_TNE must be a {q_TND.dtype} tensor of shape {(q_TND.shape[0], q_TND.shape[1], head_e)} "
                         f"with stride 1 in its last dim")
    return out_TNE


def _prefill_args(q_TND, k_pages_PSGD, v_pages_PSGE, out_TNE, page_table_BL, cu_q_B1, kv_lens_B, sinks_N,
                  num_seqs, scale, window):
    """The leading positional arguments of the Triton prefill kernels (prefill.py and swa.py):
    tensors, their strides, then num_seqs, the base-2 score scale and the window."""
    return (
        q_TND, k_pages_PSGD, v_pages_PSGE, out_TNE, page_table_BL, cu_q_B1, kv_lens_B,
        q_TND if sinks_N is None else sinks_N,  # never read without sinks
        q_TND.stride(0), q_TND.stride(1),
        k_pages_PSGD.stride(0), k_pages_PSGD.stride(1), k_pages_PSGD.stride(2),
        v_pages_PSGE.stride(0), v_pages_PSGE.stride(1), v_pages_PSGE.stride(2),
        out_TNE.stride(0), out_TNE.stride(1), page_table_BL.stride(0),
        num_seqs, scale * LOG2E, window,
    )
