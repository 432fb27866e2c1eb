"""Paged ragged attention prefill: the Triton flash-attention forward over a ragged batch.

Legend as in common.py: T query tokens of the batch, B sequences, N query heads, G kv heads,
D q/k head dim, E v head dim, P pages in the pool, S slots per page, L logical pages per sequence.

Causal with a prefix in the paged cache, sliding window, sinks, GQA, any query counts, no host
sync; the contract is common.py's and `ref.paged_attention_ref` its oracle. This loop kernel
serves every call on the CPU interpreter and, on CUDA, what the faster special kernels do not
(dispatch.paged_attention picks: ws.py for full attention on Hopper, swa.py for windows).
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from mimo_fn.kernels.attention.common import (
    _block_page, _check_inputs, _kv_block, _load_tile, _new_out, _prefill_args, _query_block, _query_rows,
    _softmax_init, _split_head_dim,
)


@triton.jit
def _kv_loop(
    acc, l_i, m_i, q0, q1,
    k_ptr, v_ptr, pt_row_ptr, lo_n, hi_n, pos_m, key_lo, key_hi, window, qk_scale,
    stride_kp, stride_ks, stride_vp, stride_vs,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """`_kv_block` over the key blocks starting in [lo_n, hi_n).

    When one page holds a block, the loop reads the next block's page a step ahead: the K/V
    addresses then hang on a loop-carried value instead of a load in the same step, so the
    pipeliner issues each step's K/V copies without first waiting on a page-table load.
    """
    page = _block_page(pt_row_ptr, lo_n, hi_n, PAGE_SIZE, BLOCK_N)
    for start_n in range(lo_n, hi_n, BLOCK_N):
        next_page = _block_page(pt_row_ptr, start_n + BLOCK_N, hi_n, PAGE_SIZE, BLOCK_N)
        acc, l_i, m_i = _kv_block(
            acc, l_i, m_i, q0, q1, k_ptr, v_ptr, pt_row_ptr, page, start_n, pos_m,
            key_lo, key_hi, window, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
            MASKED, HAS_WINDOW, PAGE_SIZE, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E, DOT_PREC, UPCAST)
        page = next_page
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _attn_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr, sinks_ptr,
    stride_qt, stride_qn, stride_kp, stride_ks, stride_kg, stride_vp, stride_vs, stride_vg,
    stride_ot, stride_on, stride_pb,
    num_seqs, qk_scale, window,
    GQA: tl.constexpr, H_PACK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (virtual query blocks, head groups). A block is TOK tokens x H_PACK heads of one sequence."""
    TOK: tl.constexpr = BLOCK_M // H_PACK
    # Virtual block v of sequence b starts at cu_q[b] // TOK + b: an upper bound on the blocks
    # before b that needs no host sync and no per-block table. Launch the last blocks first:
    # under causal masking they are the longest, so the short ones fill the tail.
    vblock = tl.num_programs(0) - 1 - tl.program_id(0)
    head0 = tl.program_id(1) * H_PACK
    seq, q_start, q_len, tok0 = _query_block(cu_q_ptr, num_seqs, vblock, TOK)
    if tok0 >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    first_pos = kv_len - q_len + tok0  # absolute position of the block's first token
    last_pos = kv_len - q_len + tl.minimum(tok0 + TOK, q_len) - 1
    tok_m, head_m, row_ok, pos_m, q_rows = _query_rows(tok0, head0, q_start, q_len, kv_len, stride_qt, stride_qn,
                                                       BLOCK_M, H_PACK)
    q0 = _load_tile(q_ptr, q_rows, tl.arange(0, BLOCK_D0), row_ok, HEAD_D, True, False)
    if BLOCK_D1 > 0:
        q1 = _load_tile(q_ptr, q_rows, BLOCK_D0 + tl.arange(0, BLOCK_D1), row_ok, HEAD_D,
                        True, BLOCK_D0 + BLOCK_D1 != HEAD_D)
    else:
        q1 = q0
    m_i, l_i = _softmax_init(sinks_ptr, head_m, HAS_SINKS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)

    kv_head = head0 // GQA
    k_head_ptr = k_ptr + kv_head * stride_kg
    v_head_ptr = v_ptr + kv_head * stride_vg
    pt_row_ptr = pt_ptr + seq * stride_pb
    key_hi = tl.minimum(kv_len, last_pos + 1)
    if HAS_WINDOW:
        # The band is short (~5 blocks of 32 keys at window 128): one masked loop keeps them in
        # one pipeline. Splitting off its unmasked middle measured 1.37x slower with pages that
        # hold whole blocks (three loop prologues per program); blocks wholly below the window
        # are never visited.
        key_lo = tl.maximum(first_pos - window + 1, 0)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q0, q1, k_head_ptr, v_head_ptr, pt_row_ptr, (key_lo // BLOCK_N) * BLOCK_N, key_hi, pos_m,
            key_lo, key_hi, window, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
            True, HAS_WINDOW, PAGE_SIZE, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E, DOT_PREC, UPCAST)
    else:
        # Keys below full_hi are visible to every row (below the causal diagonal): no masks
        # there; the blocks crossing the diagonal are masked.
        key_lo = 0
        full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q0, q1, k_head_ptr, v_head_ptr, pt_row_ptr, 0, full_hi, pos_m,
            key_lo, key_hi, window, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
            False, HAS_WINDOW, PAGE_SIZE, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E, DOT_PREC, UPCAST)
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q0, q1, k_head_ptr, v_head_ptr, pt_row_ptr, full_hi, key_hi, pos_m,
            key_lo, key_hi, window, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
            True, HAS_WINDOW, PAGE_SIZE, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E, DOT_PREC, UPCAST)

    l_i = tl.where(row_ok, l_i, 1.0)  # padded rows may have seen no key: keep them finite, unstored
    out = acc * (1.0 / l_i)[:, None]
    o_rows = (q_start + tok_m).to(tl.int64) * stride_ot + head_m * stride_on
    offs_e = tl.arange(0, BLOCK_E)
    o_ptrs = o_ptr + o_rows[:, None] + offs_e[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_e[None, :] < HEAD_E))


# ---------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128  # query rows per program: two wgmma warpgroups of 64 rows at num_warps=8
    block_n: int = 128  # keys per step; K (BLOCK_N x 192) + V (BLOCK_N x 128) bf16 per pipeline stage
    h_pack: int = 1  # query heads of one kv head per program; rows = (block_m // h_pack tokens) x h_pack heads
    num_warps: int = 8
    # With pages of at least block_n keys, `_kv_loop` reads each page a step ahead and the
    # K/V copies of step i+1 go out during step i: 2 stages hold those two steps (3 would need
    # 288 KB at 128 x 128). With smaller pages each row's page load takes a stage of its own.
    num_stages: int = 2
    max_regs: int | None = None  # register cap per thread (Triton's maxnreg); None: the compiler's choice


_INTERPRETER_PREFILL = PrefillConfig(block_m=16, block_n=16, h_pack=1, num_warps=4, num_stages=1)


def default_prefill_config(num_heads: int, num_kv_heads: int, window: int, on_cuda: bool,
                           page_size: int = 128, dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    """Tiles for an H100/H200 (CUDA) or small tiles for the CPU interpreter (fast, many block edges).

    Picked by `python -m mimo_fn.bench attention --sweep` on an H200 with Triton 3.6 at MiMo's shapes
    (docs/benchmarks.md), for pages that hold whole key blocks (the engine's 128) and for 16.
    Full attention in fp32 (the numerics path) takes 64 x 32 tiles: the 16-bit 128 x 128 tiles
    would ask for 320 KB of shared memory at head dims 192 / 128, where sm_90 has 227 KB
    (tests/test_kernel_smem.py compiles the defaults for sm_90 and checks).
    """
    if not on_cuda:
        return _INTERPRETER_PREFILL
    gqa = num_heads // num_kv_heads
    if dtype == torch.float32 and window == 0:
        return PrefillConfig(block_m=64, block_n=32, h_pack=math.gcd(gqa, 2), num_warps=4, num_stages=2)
    if window > 0:
        # Window 128: a band of ~5 key blocks per query block. Packing the 8 heads of a kv head
        # into the rows reads each K/V tile once for all of them, and 8 tokens per block waste
        # few keys at the band edges. 64 x 32 tiles, 4 warps: 3 programs per SM (2 at 3 stages). Deeper
        # pipelines or 64-key blocks measured slower: fewer programs per SM, more masked keys.
        # Pages holding whole blocks hoist the K/V row offsets (see _kv_block): the compiler then
        # takes ~174 registers, 2 programs per SM; capped at 168, 3 fit, and the kernel measured
        # 3-6% faster than before the hoisting (which the cap alone does not give).
        whole = page_size % 32 == 0
        return PrefillConfig(block_m=64, block_n=32, h_pack=math.gcd(gqa, 8), num_warps=4,
                             num_stages=2 if whole else 3, max_regs=168 if whole else None)
    # Compute-bound: 128 x 128 tiles (~250 registers, 214 KB shared: one program of 8 warps per
    # SM); two heads of a kv head per program (64 tokens x 2) helps L2 reuse by ~2%.
    return PrefillConfig(block_m=128, block_n=128, h_pack=math.gcd(gqa, 2), num_warps=8,
                         num_stages=2 if page_size % 128 == 0 else 3)


def deterministic_prefill_config(num_heads: int, num_kv_heads: int, window: int, on_cuda: bool,
                                 dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    """The one config of deterministic mode (dispatch.attention), for prefill, verify and decode
    steps and the reference forward alike: default_prefill_config at the engine's default page
    size, whatever the pool's. The kernel visits a row's keys in BLOCK_N blocks aligned to absolute
    positions, in ascending order; blocks that hold no key the row sees leave its running max, sum
    and accumulator as they were (p = 0, alpha = 1), so a row's bits depend on its position and its
    keys, not on which chunk, tile or batch it was computed in."""
    return default_prefill_config(num_heads, num_kv_heads, window, on_cuda, 128, dtype)


def launch_prefill(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window=0,
                   sinks_N=None, config: PrefillConfig | None = None, out_TNE=None):
    """`paged_attention` with an explicit tile config and output buffer (tests, benchmarks)."""
    num_heads, num_kv_heads, head_d, head_e, page_size, num_seqs = _check_inputs(
        q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N)
    cfg = config or default_prefill_config(num_heads, num_kv_heads, window, q_TND.is_cuda, page_size,
                                         q_TND.dtype)
    gqa = num_heads // num_kv_heads
    if gqa % cfg.h_pack != 0 or cfg.block_m % cfg.h_pack != 0:
        raise ValueError(f"h_pack={cfg.h_pack} must divide N/G={gqa} and block_m={cfg.block_m}")
    out_TNE = _new_out(q_TND, head_e, out_TNE)
    num_tokens = q_TND.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out_TNE
    block_d0, block_d1 = _split_head_dim(head_d)
    tokens_per_block = cfg.block_m // cfg.h_pack
    # Sequence b's blocks sit at virtual indices cu_q[b] // tokens_per_block + b + j; the count
    # below bounds them all, from shapes alone. Spare programs exit at once.
    grid = (num_tokens // tokens_per_block + num_seqs, num_heads // cfg.h_pack)
    _attn_prefill_kernel[grid](
        *_prefill_args(q_TND, k_pages_PSGD, v_pages_PSGE, out_TNE, page_table_BL, cu_q_B1, kv_lens_B, sinks_N,
                       num_seqs, scale, window),
        GQA=gqa, H_PACK=cfg.h_pack, PAGE_SIZE=page_size,
        HEAD_D=head_d, BLOCK_D0=block_d0, BLOCK_D1=block_d1,
        HEAD_E=head_e, BLOCK_E=max(16, triton.next_power_of_2(head_e)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_WINDOW=window > 0, HAS_SINKS=sinks_N is not None,
        DOT_PREC="ieee" if q_TND.dtype == torch.float32 else "tf32",  # fp32 in, fp32-exact dots
        UPCAST=not q_TND.is_cuda and q_TND.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
    )
    return out_TNE
