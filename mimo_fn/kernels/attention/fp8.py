"""FP8 full attention (issue 46): Q, K and V in float8_e4m3fn with per-row / per-page scales, fp32 softmax.

Legend as in common.py: T query tokens of the batch, B sequences, N query heads, G kv heads,
D q/k head dim, E v head dim, P pages in the pool, S slots per page, L logical pages per sequence.

Off by default: options.attention_fp8 (MIMO_FN_ATTENTION_FP8=1) makes dispatch.paged_attention send
full-attention calls on CUDA here where `unsupported_reason` is None. Two steps per call:
1. The quantisers (fp8_inputs.py). `quantize_paged_kv_fp8`: every page a sequence of the call reads
   (logical page < ceil(kv_len / S)) becomes K8 [P, S, G, D] and V8 stored transposed per page
   [P, G, E, S], with one fp32 scale per (page, kv head) each: scale = max(amax, SCALE_FLOOR) / 448 over
   the page's valid slots (slots past kv_len are written as 0). V is transposed because Hopper's FP8
   wgmma takes both operands K-major: for P @ V the reduction runs over keys, so keys must be
   contiguous. `quantize_q_fp8` gives Q8 [T, N, D] with one scale per (token, head) row. The whole
   prefix is requantised on every call (O(kv_len) bytes against the kernel's O(q_len * kv_len) work). A
   physical page that several sequences of a call share must have the same valid slots for each (whole
   pages, as the engine's forks and prefix cache share them): the programs of both write it, with the
   same bytes.
2. The kernel: on Hopper fp8_ws.py's warp-specialised Gluon kernel (ws.py's structure, this
   arithmetic; MIMO_FN_ATTENTION_WS=0 turns it off), elsewhere `_fp8_attn_kernel`: prefill.py's grid
   and query-block walk, key blocks of BLOCK_N slots of one page (one K and one V scale a block).
   QK^T is an FP8 x FP8 dot (fp32 accumulate); the scores' scale qk_scale * sq_row * sk_page takes
   the one multiply per score that the bf16 kernel spends on qk_scale. Online softmax in base 2 with
   sinks as ref.attend defines them. P is cast to e4m3 for P8 @ V8 as 2^P_SHIFT * exp2(s - m) in
   [0, 2^P_SHIFT], not in [0, 1]: e4m3 has
   normals down to 2^-6 only, and over thousands of keys most probabilities lie below that, where
   [0, 1] would keep 1-3 bits or flush them to 0 (the shift costs nothing: it is folded into the
   subtracted max, and l carries the same factor, so it cancels). The accumulator is kept in units of
   the current page's V scale: the alpha rescale also multiplies by sv_prev / sv_cur, and the end
   by the last sv, so no second accumulator is needed. The row sum l is taken from the fp32 P.

`attention_fp8_ref` is the numerics oracle: the same quantisation (bit for bit: IEEE divisions,
round to nearest even) and the same block-wise running maxima, hence the same e4m3 P, in fp32 torch.
Under the interpreter the kernel matches it to fp32 rounding; on a GPU the FP8 MMAs' accumulation and
the hardware exp2 move some probabilities across an e4m3 rounding boundary (tests/test_attention_fp8.py
says how far).
Against the bf16 oracle `ref.paged_attention_ref` the error is FP8's (tests/test_attention_fp8.py).

Page size: a multiple of BLOCK_N (128) on CUDA, so a key block lies in one page and has one K and
one V scale, and a block's slots are contiguous for the transposed V tile; pages of 16 would need a
scale per key and eight page reads per block (`unsupported_reason` names it; the loop kernel runs).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mimo_fn import options
from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.kernels.attention import fp8_ws
from mimo_fn.kernels.attention.common import (
    LOG2E, NEG_BIG, _check_inputs, _new_out, _query_block, _query_rows, _softmax_init, _split_head_dim,
)
from mimo_fn.kernels.attention.fp8_inputs import quantize_paged_kv_fp8, quantize_q_fp8
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.quant import FP8_DTYPE, FP8_MAX, SCALE_FLOOR

BLOCK_N = 128  # keys per block on CUDA: a wgmma K of 4 x 32 for P @ V; pages must hold whole blocks
P_SHIFT = 8  # P is cast to e4m3 as 2^P_SHIFT * p: at most 256 < 448, normals down to p = 2^-14


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block_m: int = 128  # query rows per program: two wgmma warpgroups of 64 rows at num_warps=8
    block_n: int = BLOCK_N  # keys per step; the page size must be a multiple
    h_pack: int = 2  # query heads of one kv head per program (as prefill.py: L2 reuse of K/V)
    num_warps: int = 8
    num_stages: int = 2  # K8 (128 x 192) + V8 (128 x 128) bytes = 40 KB a stage, half the bf16 kernel's


_INTERPRETER_CONFIG = Fp8Config(block_m=16, block_n=BLOCK_N, h_pack=1, num_warps=4, num_stages=1)


def default_fp8_config(on_cuda: bool, num_heads: int, num_kv_heads: int) -> Fp8Config:
    if not on_cuda:
        return _INTERPRETER_CONFIG
    return Fp8Config(h_pack=2 if (num_heads // max(num_kv_heads, 1)) % 2 == 0 else 1)


def unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) -> str | None:
    """None when `attention_fp8` can run the call with its default config, else why not."""
    if q_TND.dim() != 3 or k_pages_PSGD.dim() != 4 or v_pages_PSGE.dim() != 4:
        return "tensor ranks (the launcher reports them)"
    if window != 0:
        return "sliding window (full attention only)"
    if q_TND.is_cuda and torch.cuda.get_device_capability(q_TND.device) < (8, 9):
        return "needs a GPU with FP8 MMAs (sm_89 or later)"
    if q_TND.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {q_TND.dtype} (bf16 / fp16 / fp32 inputs)"
    head_d, page_size = q_TND.shape[-1], k_pages_PSGD.shape[1]
    if head_d % 32 or head_d < 32:
        return f"head dim D={head_d} (a multiple of 32: the FP8 MMA's K step)"
    if page_size % BLOCK_N:
        return f"page size {page_size} (a multiple of {BLOCK_N}: one K and one V scale per key block)"
    return None


# ---------------------------------------------------------------------------------------
# The attention kernel
# ---------------------------------------------------------------------------------------


@triton.jit
def _fp8_block(acc, l_i, m_i, sv_i, q0, q1, row_scale, k8_ptr, v8_ptr, sk_ptr, sv_ptr, page, start_n, pos_m,
               MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
               HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, P_SHIFT_C: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block [start_n, start_n + BLOCK_N) of one page. No load masks: the quantiser wrote
    every slot of the pages a valid call reads (zeros past kv_len); masked blocks mask scores only."""
    page = page.to(tl.int64)
    slots = start_n % PAGE_SIZE + tl.arange(0, BLOCK_N)
    k_rows = (page * PAGE_SIZE + slots) * (NUM_KV_HEADS * HEAD_D)  # k8_ptr is at this program's kv head
    k0 = tl.load(k8_ptr + (k_rows[:, None] + tl.arange(0, BLOCK_D0)[None, :]))
    qk = tl.dot(q0, tl.trans(k0))  # FP8 x FP8, fp32 out
    if BLOCK_D1 > 0:
        k1 = tl.load(k8_ptr + (k_rows[:, None] + (BLOCK_D0 + tl.arange(0, BLOCK_D1))[None, :]))
        qk = tl.dot(q1, tl.trans(k1), qk)
    offs_e = tl.arange(0, BLOCK_E)
    vt_ptrs = v8_ptr + (page * (NUM_KV_HEADS * HEAD_E * PAGE_SIZE) + offs_e[:, None] * PAGE_SIZE + slots[None, :])
    if BLOCK_E != HEAD_E:
        vt = tl.load(vt_ptrs, mask=(offs_e < HEAD_E)[:, None], other=0.0)  # [BLOCK_E, BLOCK_N]: keys contiguous
    else:
        vt = tl.load(vt_ptrs)
    sk = tl.load(sk_ptr + page * NUM_KV_HEADS)
    sv = tl.load(sv_ptr + page * NUM_KV_HEADS)
    if MASKED:
        qk = tl.where((start_n + tl.arange(0, BLOCK_N))[None, :] <= pos_m[:, None], qk, float("-inf"))
    s = qk * (row_scale * sk)[:, None]  # base-2 logits: qk_scale * sq * sk, one multiply per score
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - (m_new - P_SHIFT_C)[:, None])  # 2^P_SHIFT * exp2(s - m): in [0, 2^P_SHIFT]
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * (alpha * (sv_i / sv))[:, None]  # into units of this page's V scale
    acc = tl.dot(cast_rne(p, tl.float8e4nv, INTERPRET), tl.trans(vt), acc)
    return acc, l_i, m_new, sv


@triton.jit
def _fp8_loop(acc, l_i, m_i, sv_i, q0, q1, row_scale, k8_ptr, v8_ptr, sk_ptr, sv_ptr, pt_row_ptr, lo_n, hi_n, pos_m,
              MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
              HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, P_SHIFT_C: tl.constexpr, INTERPRET: tl.constexpr):
    """`_fp8_block` over the blocks starting in [lo_n, hi_n), each block's page read a step ahead
    (prefill._kv_loop's reason: the K/V addresses hang on a loop-carried value)."""
    page = tl.load(pt_row_ptr + lo_n // PAGE_SIZE, mask=lo_n < hi_n, other=0)
    for start_n in range(lo_n, hi_n, BLOCK_N):
        nxt = start_n + BLOCK_N
        next_page = tl.load(pt_row_ptr + nxt // PAGE_SIZE, mask=nxt < hi_n, other=0)
        acc, l_i, m_i, sv_i = _fp8_block(
            acc, l_i, m_i, sv_i, q0, q1, row_scale, k8_ptr, v8_ptr, sk_ptr, sv_ptr, page, start_n, pos_m,
            MASKED, PAGE_SIZE, NUM_KV_HEADS, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E, P_SHIFT_C, INTERPRET)
        page = next_page
    return acc, l_i, m_i, sv_i


@triton.jit(do_not_specialize=["num_seqs"])
def _fp8_attn_kernel(
    q8_ptr, sq_ptr, k8_ptr, v8_ptr, sk_ptr, sv_ptr, o_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr, sinks_ptr,
    stride_ot, stride_on, stride_pb, num_seqs, qk_scale,
    GQA: tl.constexpr, H_PACK: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr,
    HEAD_E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, P_SHIFT_C: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (virtual query blocks, head groups), as prefill._attn_prefill_kernel without a window."""
    TOK: tl.constexpr = BLOCK_M // H_PACK
    vblock = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) blocks first
    head0 = tl.program_id(1) * H_PACK
    seq, q_start, q_len, tok0 = _query_block(cu_q_ptr, num_seqs, vblock, TOK)
    if tok0 >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int32)
    first_pos = kv_len - q_len + tok0
    last_pos = kv_len - q_len + tl.minimum(tok0 + TOK, q_len) - 1
    tok_m, head_m, row_ok, pos_m, q_rows = _query_rows(tok0, head0, q_start, q_len, kv_len, NUM_HEADS * HEAD_D,
                                                       HEAD_D, BLOCK_M, H_PACK)
    q0 = tl.load(q8_ptr + (q_rows[:, None] + tl.arange(0, BLOCK_D0)[None, :]), mask=row_ok[:, None], other=0.0)
    if BLOCK_D1 > 0:
        q1 = tl.load(q8_ptr + (q_rows[:, None] + (BLOCK_D0 + tl.arange(0, BLOCK_D1))[None, :]),
                     mask=row_ok[:, None], other=0.0)
    else:
        q1 = q0
    sq_rows = (q_start + tok_m).to(tl.int64) * NUM_HEADS + head_m
    row_scale = qk_scale * tl.load(sq_ptr + sq_rows, mask=row_ok, other=1.0)
    m_i, l_i = _softmax_init(sinks_ptr, head_m, HAS_SINKS, BLOCK_M)
    l_i = l_i * (1 << P_SHIFT_C)  # the sink's term in the same units as p
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    sv_i = tl.full([], 1.0, tl.float32)  # acc is 0: any unit

    kv_head = head0 // GQA
    k_head_ptr = k8_ptr + kv_head * HEAD_D
    v_head_ptr = v8_ptr + kv_head * (HEAD_E * PAGE_SIZE)
    sk_head_ptr = sk_ptr + kv_head
    sv_head_ptr = sv_ptr + kv_head
    pt_row_ptr = pt_ptr + seq * stride_pb
    key_hi = tl.minimum(kv_len, last_pos + 1)
    full_hi = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # below: keys every row sees, no score mask
    acc, l_i, m_i, sv_i = _fp8_loop(
        acc, l_i, m_i, sv_i, q0, q1, row_scale, k_head_ptr, v_head_ptr, sk_head_ptr, sv_head_ptr, pt_row_ptr,
        0, full_hi, pos_m, False, PAGE_SIZE, NUM_KV_HEADS, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E,
        P_SHIFT_C, INTERPRET)
    acc, l_i, m_i, sv_i = _fp8_loop(
        acc, l_i, m_i, sv_i, q0, q1, row_scale, k_head_ptr, v_head_ptr, sk_head_ptr, sv_head_ptr, pt_row_ptr,
        full_hi, key_hi, pos_m, True, PAGE_SIZE, NUM_KV_HEADS, BLOCK_N, HEAD_D, BLOCK_D0, BLOCK_D1, HEAD_E, BLOCK_E,
        P_SHIFT_C, INTERPRET)

    l_i = tl.where(row_ok, l_i, 1.0)  # padded rows: finite, never stored
    out = acc * (sv_i / l_i)[:, None]
    o_rows = (q_start + tok_m).to(tl.int64) * stride_ot + head_m * stride_on
    offs_e = tl.arange(0, BLOCK_E)
    dt: tl.constexpr = o_ptr.dtype.element_ty
    if dt != tl.float32:
        out = cast_rne(out, dt, INTERPRET)
    tl.store(o_ptr + o_rows[:, None] + offs_e[None, :], out, mask=row_ok[:, None] & (offs_e[None, :] < HEAD_E))


def launch_fp8_attention(q8_TND, sq_TN, k8_PSGD, v8_PGES, sk_PG, sv_PG, page_table_BL, cu_q_B1, kv_lens_B, scale,
                         sinks_N, out_TNE, config: Fp8Config):
    """The attention kernel alone, on quantised inputs (benchmarks time it apart from the quantisers)."""
    num_tokens, num_heads, head_d = q8_TND.shape
    _, page_size, num_kv_heads, _ = k8_PSGD.shape
    head_e = v8_PGES.shape[2]
    gqa = num_heads // num_kv_heads
    if page_size % config.block_n or gqa % config.h_pack or config.block_m % config.h_pack:
        raise ValueError(f"config {config}: block_n must divide the page size {page_size}, h_pack divide "
                         f"N/G={gqa} and block_m")
    num_seqs = kv_lens_B.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out_TNE
    block_d0, block_d1 = _split_head_dim(head_d)
    tok = config.block_m // config.h_pack
    grid = (num_tokens // tok + num_seqs, num_heads // config.h_pack)
    _fp8_attn_kernel[grid](
        q8_TND, sq_TN, k8_PSGD, v8_PGES, sk_PG, sv_PG, out_TNE, page_table_BL, cu_q_B1, kv_lens_B,
        sq_TN if sinks_N is None else sinks_N,  # never read without sinks
        out_TNE.stride(0), out_TNE.stride(1), page_table_BL.stride(0), num_seqs, scale * LOG2E,
        GQA=gqa, H_PACK=config.h_pack, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size,
        HEAD_D=head_d, BLOCK_D0=block_d0, BLOCK_D1=block_d1, HEAD_E=head_e,
        BLOCK_E=max(16, triton.next_power_of_2(head_e)), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HAS_SINKS=sinks_N is not None, P_SHIFT_C=P_SHIFT, INTERPRET=not q8_TND.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out_TNE


@typed
def attention_fp8(
    q_TND: Float[Tensor, "T N D"],
    k_pages_PSGD: Float[Tensor, "P S G D"],
    v_pages_PSGE: Float[Tensor, "P S G E"],
    page_table_BL: Int[Tensor, "B L"],
    cu_q_B1: Int[Tensor, " B+1"],
    kv_lens_B: Int[Tensor, " B"],
    scale: float,
    window: int = 0,
    sinks_N: Float[Tensor, " N"] | None = None,
    config: Fp8Config | None = None,
    out_TNE: Float[Tensor, "T N E"] | None = None,
) -> Float[Tensor, "T N E"]:
    """Full attention with Q, K, V in FP8 (the module docstring): the quantisers, then the kernel:
    fp8_ws.py's warp-specialised Gluon kernel on Hopper (unless MIMO_FN_ATTENTION_WS=0 or a `config`
    asks for the Triton kernel), the Triton kernel elsewhere. Output in q_TND's dtype, [T, N, E] as
    the other kernels'. No host sync."""
    num_heads, num_kv_heads, head_d, head_e, page_size, _ = _check_inputs(
        q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N)
    if window != 0:
        raise ValueError(f"attention_fp8 serves full attention only (window 0), got window={window}")
    if head_d % 32:
        raise ValueError(f"attention_fp8 needs a head dim D that is a multiple of 32, got {head_d}")
    out_TNE = _new_out(q_TND, head_e, out_TNE)
    q8, sq = quantize_q_fp8(q_TND)
    k8, v8, sk, sv = quantize_paged_kv_fp8(k_pages_PSGD, v_pages_PSGE, page_table_BL, kv_lens_B, cu_q_B1)
    if config is None and options.current().attention_ws and \
            fp8_ws.unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) is None:
        return fp8_ws.launch_fp8_ws(q8, sq, k8, v8, sk, sv, page_table_BL, cu_q_B1, kv_lens_B, scale, sinks_N,
                                    out_TNE, P_SHIFT)
    cfg = config or default_fp8_config(q_TND.is_cuda, num_heads, num_kv_heads)
    return launch_fp8_attention(q8, sq, k8, v8, sk, sv, page_table_BL, cu_q_B1, kv_lens_B, scale, sinks_N,
                                out_TNE, cfg)


# ---------------------------------------------------------------------------------------
# The plain-torch twin
# ---------------------------------------------------------------------------------------


def _quantize_ref(x, dims):
    """e4m3 of x / scale and the scale, max(amax, floor) / 448 over `dims` (fp32 IEEE, RNE cast)."""
    x = x.float()
    amax = x.abs().amax(dim=dims, keepdim=True).clamp_min(SCALE_FLOOR)
    # a tensor divisor: torch on CUDA divides by a Python number as a multiply by its reciprocal,
    # which is not the kernels' IEEE division (an ulp off in some scales)
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_paged_kv_fp8_ref(k_pages_PSGD, v_pages_PSGE, page_table_BL, kv_lens_B, cu_q_B1=None):
    """`quantize_paged_kv_fp8` in torch: the same values on the pages the batch reads, zeros elsewhere."""
    num_pages, page_size, num_kv_heads, head_d = k_pages_PSGD.shape
    k8 = torch.zeros(num_pages, page_size, num_kv_heads, head_d, dtype=FP8_DTYPE, device=k_pages_PSGD.device)
    v8 = torch.zeros(num_pages, num_kv_heads, v_pages_PSGE.shape[-1], page_size, dtype=FP8_DTYPE,
                     device=k_pages_PSGD.device)
    sk = torch.zeros(num_pages, num_kv_heads, device=k_pages_PSGD.device)
    sv = torch.zeros_like(sk)
    cu_q = cu_q_B1.tolist() if cu_q_B1 is not None else list(range(len(kv_lens_B) + 1))
    for b, kv_len in enumerate(kv_lens_B.tolist()):  # host sync: reference path only
        if cu_q[b + 1] == cu_q[b]:
            continue
        for j in range(-(-kv_len // page_size)):
            page = int(page_table_BL[b, j])
            if page < 0:
                continue
            n = min(kv_len - j * page_size, page_size)
            k = torch.zeros(page_size, num_kv_heads, head_d, device=k8.device)
            v = torch.zeros(page_size, num_kv_heads, v_pages_PSGE.shape[-1], device=k8.device)
            k[:n], v[:n] = k_pages_PSGD[page, :n].float(), v_pages_PSGE[page, :n].float()
            k8[page], s = _quantize_ref(k, (0, 2))
            sk[page] = s.view(num_kv_heads)
            v8_page, s = _quantize_ref(v, (0, 2))
            v8[page] = v8_page.permute(1, 2, 0)
            sv[page] = s.view(num_kv_heads)
    return k8, v8, sk, sv


def attention_fp8_ref(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window=0,
                      sinks_N=None, block_n: int = BLOCK_N, q_chunk: int = 256, p_shift: int = P_SHIFT):
    """`attention_fp8` in fp32 torch: the same quantised inputs, the same per-block running maxima
    (key blocks of block_n aligned to position 0, in order), P rounded to e4m3 as the kernel rounds it;
    only the fp32 sums' order differs. Queries in chunks of q_chunk (memory)."""
    if window != 0:
        raise ValueError(f"attention_fp8_ref serves full attention only (window 0), got window={window}")
    num_heads, page_size = q_TND.shape[1], k_pages_PSGD.shape[1]
    rep = num_heads // k_pages_PSGD.shape[2]
    q8, sq = _quantize_ref(q_TND, (2,))
    k8, v8, sk, sv = quantize_paged_kv_fp8_ref(k_pages_PSGD, v_pages_PSGE, page_table_BL, kv_lens_B, cu_q_B1)
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32)  # the kernel's fp32 argument
    out_TNE = q_TND.new_empty(q_TND.shape[0], num_heads, v_pages_PSGE.shape[-1])
    cu_q = cu_q_B1.tolist()
    for b, kv_len in enumerate(kv_lens_B.tolist()):
        q0, q1 = cu_q[b], cu_q[b + 1]
        if q1 == q0:
            continue
        num_blocks = -(-kv_len // block_n)
        pos_L = torch.arange(num_blocks * block_n, device=q_TND.device)
        pages_L = page_table_BL[b, (pos_L // page_size).clamp_max(page_table_BL.shape[1] - 1)].long()
        pages_L = torch.where(pos_L < kv_len, pages_L, 0)  # padding keys: masked below
        slots_L = pos_L % page_size
        k_NLD = k8[pages_L, slots_L].float().repeat_interleave(rep, 1).transpose(0, 1)
        v_NLE = v8[pages_L, :, :, slots_L].float().repeat_interleave(rep, 1).transpose(0, 1)
        sk_NL = sk[pages_L].repeat_interleave(rep, 1).T
        sv_NL = sv[pages_L].repeat_interleave(rep, 1).T
        for c0 in range(q0, q1, q_chunk):
            c1 = min(c0 + q_chunk, q1)
            pos_Q = torch.arange(c0, c1, device=q_TND.device) - q0 + kv_len - (q1 - q0)
            row_NQ = qk_scale * sq[c0:c1, :, 0].T
            s_NQL = torch.einsum("qnd,nld->nql", q8[c0:c1].float(), k_NLD) * (row_NQ[:, :, None] * sk_NL[:, None])
            s_NQL = s_NQL.masked_fill(pos_L[None, None] > pos_Q[None, :, None], float("-inf"))
            s_NQKb = s_NQL.view(num_heads, c1 - c0, num_blocks, block_n)  # Kb key blocks of block_n
            m0_NQ = torch.full_like(row_NQ, NEG_BIG.value)
            if sinks_N is not None:
                m0_NQ = torch.maximum((sinks_N.float() * LOG2E)[:, None].expand_as(row_NQ), m0_NQ)
            m_NQK = torch.maximum(s_NQKb.amax(-1).cummax(-1).values, m0_NQ[..., None])  # running max after block k
            p_NQKb = torch.exp2(s_NQKb - (m_NQK - p_shift)[..., None])
            w_NQK = torch.exp2(m_NQK - m_NQK[..., -1:])  # block k's later rescales, all at once
            l_NQ = (p_NQKb.sum(-1) * w_NQK).sum(-1)
            if sinks_N is not None:
                l_NQ = l_NQ + torch.exp2(m0_NQ - m_NQK[..., -1]) * 2.0**p_shift
            pv_NQKE = torch.einsum("nqkb,nkbe->nqke", p_NQKb.to(FP8_DTYPE).float(),
                                   v_NLE.reshape(num_heads, num_blocks, block_n, -1))
            sv_NK = sv_NL.view(num_heads, num_blocks, block_n)[..., 0]
            acc_NQE = (pv_NQKE * (w_NQK * sv_NK[:, None])[..., None]).sum(2)
            out_TNE[c0:c1] = (acc_NQE / l_NQ[..., None]).transpose(0, 1).to(q_TND.dtype)
    return out_TNE
