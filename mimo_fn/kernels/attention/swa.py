"""Sliding-window prefill in one pass per query block: the whole key band at once, no online softmax.

Legend: T query tokens of the batch, B sequences, N query heads, G kv heads, D q/k head dim,
E v head dim, P pages in the pool, S slots per page, L logical pages per sequence.

Same contract and arithmetic as prefill.py's loop kernel with a window (causal, a prefix in the
paged cache, sinks, GQA); `ref.paged_attention_ref` is its oracle, and
`dispatch.paged_attention` sends a call here on CUDA when `unsupported_reason` returns None.

Why a second SWA kernel: at MiMo's window of 128 the loop kernel (prefill.py) walks a band of
five 32-key blocks per query block, each a chain of dependent steps (QK^T, online softmax with
a rescale of the 64 x 128 accumulator, P @ V) whose latencies few programs per SM can hide.
A block of TOK tokens sees at most window + TOK - 1 keys. When that fits in BAND_A + BAND_B keys,
one program does
  scores over the whole band (tile A: the BAND_A keys ending at the block's last token; tile B:
  the BAND_B keys before them) -> one max, one exp2 and one sum per row -> P @ V over both,
with no rescale and no loop over key blocks. The band starts where the block needs it (any
alignment; each key row looks up its own page), so at window 128 a block of 16 tokens reads
144 keys, 128 of them visible to each row (the loop kernel reads 160 for a block of 8).
Both products run over slices of D and E in short loops that Triton pipelines with
asynchronous copies straight into shared memory. A tile loaded outside a loop goes through
registers; with 144 x 192 keys that serialises into several L2 round trips (1.3x slower).

At MiMo's SWA shapes on an H200 it runs closer to the memory-bound minimum than the loop kernel
(docs/benchmarks.md). The dispatch sends it 16-bit inputs only: it was tuned for them, and fp32
tiles would need twice the shared memory.
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from mimo_fn.kernels.attention.common import (
    _check_inputs, _dot, _load_tile, _new_out, _prefill_args, _query_block, _query_rows, _softmax_init)


@dataclasses.dataclass(frozen=True)
class BandConfig:
    block_m: int = 128  # query rows per program: (block_m // h_pack) tokens x h_pack heads
    h_pack: int = 8  # query heads of one kv head per program (they share every K/V row)
    band_a: int = 128  # keys of the newest tile (it ends at the block's last token)
    band_b: int = 16  # keys of the older tile before it
    block_c: int = 64  # columns of D (scores) and of E (P @ V) per pipelined step
    num_warps: int = 8
    num_stages: int = 3
    max_regs: int | None = 128  # Triton's maxnreg: 2 programs of 8 warps per SM

    @property
    def tokens(self) -> int:
        return self.block_m // self.h_pack

    def max_window(self) -> int:
        """Largest window whose band (window + tokens - 1 keys) fits the two tiles."""
        return self.band_a + self.band_b - self.tokens + 1


def default_band_config(num_heads: int, num_kv_heads: int, on_cuda: bool) -> BandConfig:
    """Tiles for an H100/H200, or small ones for the CPU interpreter.

    Picked on an H200 at MiMo's SWA shapes (docs/benchmarks.md): 16 tokens x 8 heads = 128 rows
    in two warpgroups that share every K/V tile; D and E in slices of 64 (all three K slices in
    flight at once with 3 stages). Capped at 128 registers two programs fit per SM (uncapped,
    the compiler took 161 and the kernel ran 1.4x slower with one).
    8 tokens x 8 heads on 4 warps (more programs per SM, twice the K/V reads) measured 12-17%
    slower, 32-wide slices up to 9%.
    """
    gqa = num_heads // num_kv_heads
    h_pack = math.gcd(gqa, 8)
    if not on_cuda:
        return BandConfig(block_m=8 * h_pack, h_pack=h_pack, band_a=16, band_b=16, block_c=16, num_warps=4,
                          num_stages=1, max_regs=None)
    block_m = 16 * h_pack
    return BandConfig(block_m=block_m, h_pack=h_pack, num_warps=8 if block_m >= 128 else 4)


@triton.jit
def _band_rows(pt_row_ptr, keys, key_lo, key_hi, stride_p, stride_s, PAGE_SIZE: tl.constexpr):
    """Offsets of key rows [BAND] in one pool, and which to load: rows outside [key_lo, key_hi)
    may sit in a freed page (-1) or hold garbage, so they are not read (page 0, masked)."""
    ok = (keys >= key_lo) & (keys < key_hi)
    page = tl.load(pt_row_ptr + keys // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    return page * stride_p + (keys % PAGE_SIZE) * stride_s, ok


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _attn_swa_band_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr, sinks_ptr,
    stride_qt, stride_qn, stride_kp, stride_ks, stride_kg, stride_vp, stride_vs, stride_vg,
    stride_ot, stride_on, stride_pb,
    num_seqs, qk_scale, window,
    GQA: tl.constexpr, H_PACK: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BAND_A: tl.constexpr, BAND_B: tl.constexpr, STAGES: tl.constexpr,
    A_CAUSAL: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid (virtual query blocks, head groups), laid out as `prefill._attn_prefill_kernel`'s."""
    TOK: tl.constexpr = BLOCK_M // H_PACK
    vblock = tl.program_id(0)
    head0 = tl.program_id(1) * H_PACK
    seq, q_start, q_len, tok0 = _query_block(cu_q_ptr, num_seqs, vblock, TOK)
    if tok0 >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    first_pos = kv_len - q_len + tok0
    key_hi = kv_len - q_len + tl.minimum(tok0 + TOK, q_len)  # one past the block's last token
    key_lo = tl.maximum(first_pos - window + 1, 0)
    band0 = tl.maximum(key_hi - (BAND_A + BAND_B), 0)  # key_hi - key_lo fits: the launcher checked
    tok_m, head_m, row_ok, pos_m, q_rows = _query_rows(tok0, head0, q_start, q_len, kv_len, stride_qt, stride_qn,
                                                       BLOCK_M, H_PACK)
    kv_head = head0 // GQA
    k_head_ptr = k_ptr + kv_head * stride_kg
    v_head_ptr = v_ptr + kv_head * stride_vg
    pt_row_ptr = pt_ptr + seq * stride_pb
    keys_b = band0 + tl.arange(0, BAND_B)
    keys_a = band0 + BAND_B + tl.arange(0, BAND_A)
    kb_rows, ok_b = _band_rows(pt_row_ptr, keys_b, key_lo, key_hi, stride_kp, stride_ks, PAGE_SIZE)
    ka_rows, ok_a = _band_rows(pt_row_ptr, keys_a, key_lo, key_hi, stride_kp, stride_ks, PAGE_SIZE)

    # Scores [BLOCK_M, BAND_A] and [BLOCK_M, BAND_B], a slice of D per step.
    s_a = tl.zeros([BLOCK_M, BAND_A], tl.float32)
    s_b = tl.zeros([BLOCK_M, BAND_B], tl.float32)
    for d0 in tl.range(0, HEAD_D, BLOCK_C, num_stages=STAGES):
        offs_d = d0 + tl.arange(0, BLOCK_C)
        q_c = _load_tile(q_ptr, q_rows, offs_d, row_ok, HEAD_D, True, HEAD_D % BLOCK_C != 0)
        ka = _load_tile(k_head_ptr, ka_rows, offs_d, ok_a, HEAD_D, True, HEAD_D % BLOCK_C != 0)
        kb = _load_tile(k_head_ptr, kb_rows, offs_d, ok_b, HEAD_D, True, HEAD_D % BLOCK_C != 0)
        s_a = _dot(q_c, tl.trans(ka), s_a, DOT_PREC, UPCAST)
        s_b = _dot(q_c, tl.trans(kb), s_b, DOT_PREC, UPCAST)

    # Visible: pos - window < key <= pos. Tile A starts at most BAND_A keys before a row's
    # position, so a window of at least BAND_A keys never bites there and only the causal test
    # remains (A_CAUSAL). Otherwise one unsigned compare does both (negative differences wrap
    # high). Keys are never negative, and a valid row's visible keys all lie in
    # [key_lo, key_hi), so these tests also drop the rows that were not loaded.
    if A_CAUSAL:
        s_a = tl.where(keys_a[None, :] <= pos_m[:, None], s_a, float("-inf"))
    else:
        s_a = tl.where((pos_m[:, None] - keys_a[None, :]).to(tl.uint32) < window.to(tl.uint32), s_a, float("-inf"))
    s_b = tl.where((pos_m[:, None] - keys_b[None, :]).to(tl.uint32) < window.to(tl.uint32), s_b, float("-inf"))

    # One softmax over the band; the sink (a logit with no value) starts the max and the sum.
    # Scores stay unscaled up to exp2's argument (one FMA each); qk_scale > 0 keeps the max.
    m_i, l_i = _softmax_init(sinks_ptr, head_m, HAS_SINKS, BLOCK_M)
    m = tl.maximum(m_i, tl.maximum(tl.max(s_a, 1), tl.max(s_b, 1)) * qk_scale)
    p_a = tl.math.exp2(s_a * qk_scale - m[:, None])
    p_b = tl.math.exp2(s_b * qk_scale - m[:, None])
    l_i = l_i * tl.math.exp2(m_i - m) + tl.sum(p_a, 1) + tl.sum(p_b, 1)
    p_a = p_a.to(v_ptr.dtype.element_ty)
    p_b = p_b.to(v_ptr.dtype.element_ty)
    inv_l = 1.0 / tl.where(row_ok, l_i, 1.0)  # padded rows may have seen no key: finite, not stored

    # P @ V a slice of E per step, each slice stored when done. The V row offsets are computed
    # only now: kept from the start they cost the registers the cap does not have (spills).
    vb_rows, ok_b = _band_rows(pt_row_ptr, keys_b, key_lo, key_hi, stride_vp, stride_vs, PAGE_SIZE)
    va_rows, ok_a = _band_rows(pt_row_ptr, keys_a, key_lo, key_hi, stride_vp, stride_vs, PAGE_SIZE)
    o_rows = (q_start + tok_m).to(tl.int64) * stride_ot + head_m * stride_on
    for e0 in tl.range(0, HEAD_E, BLOCK_C, num_stages=STAGES):
        offs_e = e0 + tl.arange(0, BLOCK_C)
        va = _load_tile(v_head_ptr, va_rows, offs_e, ok_a, HEAD_E, True, HEAD_E % BLOCK_C != 0)
        vb = _load_tile(v_head_ptr, vb_rows, offs_e, ok_b, HEAD_E, True, HEAD_E % BLOCK_C != 0)
        acc = _dot(p_a, va, None, DOT_PREC, UPCAST)
        acc = _dot(p_b, vb, acc, DOT_PREC, UPCAST)
        o_ptrs = o_ptr + o_rows[:, None] + offs_e[None, :]
        tl.store(o_ptrs, (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_e[None, :] < HEAD_E))


def unsupported_reason(num_heads: int, num_kv_heads: int, window: int, config: BandConfig) -> str | None:
    """None when the band kernel can run a call with this window and config, else why not."""
    if window <= 0:
        return "no sliding window (full attention has no bounded band)"
    gqa = num_heads // num_kv_heads
    if gqa % config.h_pack != 0 or config.block_m % config.h_pack != 0:
        return f"h_pack={config.h_pack} must divide N/G={gqa} and block_m={config.block_m}"
    if window > config.max_window():
        return (f"window {window} > {config.max_window()}: a block of {config.tokens} tokens sees up to "
                f"window + {config.tokens - 1} keys, more than the band's {config.band_a} + {config.band_b}")
    return None


def launch_swa_band(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window,
                    sinks_N=None, config: BandConfig | None = None, out_TNE=None):
    """`dispatch.paged_attention` with a sliding window, through the band kernel; ValueError if it cannot
    run the call."""
    num_heads, num_kv_heads, head_d, head_e, page_size, num_seqs = _check_inputs(
        q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N)
    cfg = config or default_band_config(num_heads, num_kv_heads, q_TND.is_cuda)
    reason = unsupported_reason(num_heads, num_kv_heads, window, cfg)
    if reason is not None:
        raise ValueError(f"the SWA band kernel cannot run this call: {reason}")
    out_TNE = _new_out(q_TND, head_e, out_TNE)
    num_tokens = q_TND.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out_TNE
    # Sequence b's blocks sit at virtual indices cu_q[b] // tokens + b + j (as in prefill.py);
    # the count bounds them all from shapes alone, and spare programs exit at once.
    grid = (num_tokens // cfg.tokens + num_seqs, num_heads // cfg.h_pack)
    _attn_swa_band_kernel[grid](
        *_prefill_args(q_TND, k_pages_PSGD, v_pages_PSGE, out_TNE, page_table_BL, cu_q_B1, kv_lens_B, sinks_N,
                       num_seqs, scale, window),
        GQA=num_heads // num_kv_heads, H_PACK=cfg.h_pack, PAGE_SIZE=page_size,
        HEAD_D=head_d, HEAD_E=head_e, BLOCK_C=cfg.block_c, BLOCK_M=cfg.block_m,
        BAND_A=cfg.band_a, BAND_B=cfg.band_b, STAGES=cfg.num_stages,
        A_CAUSAL=window >= cfg.band_a, HAS_SINKS=sinks_N is not None,
        DOT_PREC="ieee" if q_TND.dtype == torch.float32 else "tf32",  # fp32 in, fp32-exact dots
        UPCAST=not q_TND.is_cuda and q_TND.dtype != torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
    )
    return out_TNE
