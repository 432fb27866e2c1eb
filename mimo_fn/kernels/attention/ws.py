"""Warp-specialised full-attention prefill for Hopper (sm_90), written in Gluon.

Legend: T query tokens of the batch, B sequences, N query heads, G kv heads, D q/k head dim,
E v head dim (128), P pages in the pool, S slots per page, L logical pages per sequence.

Same contract and the same arithmetic as prefill.py's loop kernel without a window (causal;
optional sinks; GQA; the prefix read from the paged cache); `ref.paged_attention_ref` is its
oracle. `dispatch.paged_attention` sends a call here when `unsupported_reason` returns None.

Why a second kernel: the Triton kernel (prefill.py) has four CTA-wide barriers per key block,
where its two warpgroups wait for each other on the shared K/V stage (ncu: 31% of issue gaps).
Here one program has three roles with no barrier between them:
- a producer warp streams Q once and each key block's K and V through TMA into a 2-stage ring
  (a `ready` mbarrier per stage, and an `empty` one that both consumers arrive on);
- two consumer warpgroups, one query head each (two heads of one kv head share every K/V
  block), 64 tokens: QK^T and P @ V with wgmma, the online softmax in registers.
On an H200 (bf16, 64 heads, 4 kv heads, D=192, 8K-64K tokens) it runs ~1.2x the Triton kernel's
throughput, with outputs equal to the Triton kernel's bit for bit (python -m mimo_fn.bench attention;
docs/benchmarks.md).

Gluon has no CPU interpreter: this kernel is tested on the GPU only (tests/test_attention_kernel.py);
everywhere else the Triton kernel runs.
"""

import re

import torch
import triton

try:  # Gluon ships with Triton >= 3.5; its names moved between releases (3.6 on the GPU image, 3.9 here)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    # run on 3.6, compiled for sm_90 on 3.9; older Gluon spelled warp_specialize differently
    _ver = re.match(r"(\d+)\.(\d+)", triton.__version__)
    HAS_GLUON = _ver is not None and (int(_ver[1]), int(_ver[2])) >= (3, 6)
except ImportError:  # pragma: no cover - older Triton: the Triton kernel serves every call
    HAS_GLUON = False

from mimo_fn import options
from mimo_fn.kernels.attention.common import LOG2E, _check_inputs, _new_out

BLOCK_N = 128  # keys per block; pages must hold whole blocks (one TMA box per block and chunk)
TOK = 64  # query tokens per program: one wgmma M tile per consumer warpgroup
STAGES = 2  # K/V ring depth: 2 x 128 keys x (192 + 128) bf16 = 160 KB, plus Q (48 KB)
# Registers: the 4 + 4 + 1 warps are padded to 12 (whole warpgroups, so each can hand registers
# back); 12 x 32 threads x 160 = 61,440 of the 65,536. The producer drops to 24 a thread, the
# second consumer takes CONSUMER_REGS, the first what is left. A 168 cap measured 2-3% slower.
MAX_REGS = 160
CONSUMER_REGS = 232


def unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) -> str | None:
    """None when this kernel can run the call, else why not (the Triton kernel runs it then)."""
    if not (options.current().attention_ws and HAS_GLUON):
        return "disabled (MIMO_FN_ATTENTION_WS=0)" if HAS_GLUON else f"Triton {triton.__version__} (Gluon >= 3.6)"
    if not q_TND.is_cuda or torch.cuda.get_device_capability(q_TND.device) != (9, 0):
        return "needs a Hopper GPU (sm_90)"
    if q_TND.dim() != 3 or k_pages_PSGD.dim() != 4 or v_pages_PSGE.dim() != 4:
        return "tensor ranks (the launcher reports them)"
    if window != 0:
        return "sliding window (swa.py and the Triton loop kernel serve windows)"
    if q_TND.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q_TND.dtype} (bf16 / fp16 only)"
    _, num_heads, head_d = q_TND.shape
    _, page_size, num_kv_heads, _ = k_pages_PSGD.shape
    if head_d not in (64, 128, 192) or v_pages_PSGE.shape[-1] != 128:
        return f"head dims D={head_d}, E={v_pages_PSGE.shape[-1]} (D in 64/128/192, E=128)"
    if page_size % BLOCK_N:
        return f"page size {page_size} (a multiple of {BLOCK_N})"
    if num_kv_heads == 0 or num_heads % num_kv_heads or (num_heads // num_kv_heads) % 2:
        return f"N={num_heads} query heads over G={num_kv_heads} kv heads (an even number per kv head)"
    # TMA: 16-byte aligned bases and row strides; q's heads and the pools' slots must be rows of 2-D views
    if q_TND.stride(2) != 1 or q_TND.stride(1) != head_d or (q_TND.stride(0) * q_TND.element_size()) % 16:
        return "q_TND's heads are not contiguous rows"
    for t in (q_TND, k_pages_PSGD, v_pages_PSGE):
        if t.data_ptr() % 16:
            return "a base pointer is not 16-byte aligned"
    if not (k_pages_PSGD.is_contiguous() and v_pages_PSGE.is_contiguous()):
        return "the K/V pools are not contiguous"
    return None


if HAS_GLUON:

    @gluon.jit
    def _find_seq(cu_q_ptr, num_seqs, vblock, TOK: gl.constexpr):
        """The last sequence b with cu_q[b] // TOK + b <= vblock (common._find_seq's twin)."""
        lo = num_seqs * 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if gl.load(cu_q_ptr + mid).to(gl.int32) // TOK + mid <= vblock:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @gluon.jit
    def _ring(NS: gl.constexpr):
        """The barriers of a program: the K/V ring's `ready` (the stage's TMA bytes landed) and `empty`
        (both consumer warpgroups are done with it), a stage each, and Q's."""
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumer warpgroups release a stage
        mbarrier.init(q_bar, count=1)
        return ready, empty, q_bar

    @gluon.jit
    def _ring_done(ready, empty, q_bar, NS: gl.constexpr):
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))
        mbarrier.invalidate(q_bar)

    @gluon.jit
    def _store_o(o_ptr, acc0, acc1, inv, tok0, q_start, q_len, head, stride_ot, stride_on):
        """o rows tok0.. of the sequence (those below q_len) for one head: [acc0 | acc1] (E = 2 x 64
        columns) times inv, the rows' 1 / softmax denominator."""
        TOK: gl.constexpr = acc0.type.shape[0]
        rows_o = gl.arange(0, TOK, layout=gl.SliceLayout(1, acc0.type.layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, acc0.type.layout))
        tok_o = tok0 + rows_o
        o_rows = (q_start + tok_o).to(gl.int64) * stride_ot + head * stride_on
        keep_o = (tok_o < q_len)[:, None]  # rows past the sequence are not stored
        gl.store(o_ptr + o_rows[:, None] + cols[None, :], (acc0 * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=keep_o)
        gl.store(o_ptr + o_rows[:, None] + (64 + cols)[None, :], (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty),
                 mask=keep_o)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                  pt_row_ptr, q_row, head0, kv_head, key_hi, PAGE_SIZE: gl.constexpr):
        # q_smem [2 * DC, TOK, 64]: head0's D chunks then head0 + 1's; k_smem [STAGES * DC, BN, 64],
        # v_smem [STAGES * 2, BN, 64]. Constexprs do not cross into a partition: shapes come from types.
        DC: gl.constexpr = q_smem.type.shape[0] // 2
        BN: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = v_smem.type.shape[0] // 2
        HEAD_D: gl.constexpr = DC * 64
        ELT: gl.constexpr = q_smem.dtype.primitive_bitwidth // 8
        mbarrier.expect(q_bar, 2 * DC * q_smem.type.shape[1] * 64 * ELT)
        for w in gl.static_range(2):
            for c in gl.static_range(DC):
                _tma_load(q_desc, [q_row, (head0 + w) * HEAD_D + c * 64], q_bar, q_smem.index(w * DC + c))
        for b in range(gl.cdiv(key_hi, BN)):
            start_n = b * BN
            page = gl.load(pt_row_ptr + start_n // PAGE_SIZE).to(gl.int32)
            s = b % NS
            mbarrier.wait(empty.index(s), ((b // NS) & 1) ^ 1)  # phase 1 passes on a fresh barrier
            bar = ready.index(s)
            row = page * PAGE_SIZE + start_n % PAGE_SIZE
            mbarrier.expect(bar, (DC + 2) * BN * 64 * ELT)
            for c in gl.static_range(DC):
                _tma_load(k_desc, [row, kv_head * HEAD_D + c * 64], bar, k_smem.index(s * DC + c))
            for c in gl.static_range(2):
                _tma_load(v_desc, [row, kv_head * 128 + c * 64], bar, v_smem.index(s * 2 + c))

    @gluon.jit
    def _consumer(o_ptr, sinks_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
                  wg, q_start, q_len, tok0, first_pos, key_hi, head0, qk_scale, stride_ot, stride_on,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, HAS_SINKS: gl.constexpr):
        # One warpgroup: query head head0 + wg, tokens tok0 .. tok0 + TOK of its sequence.
        DC: gl.constexpr = q_smem.type.shape[0] // 2
        TOK: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = v_smem.type.shape[0] // 2
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        head = head0 + wg
        rows_s = gl.arange(0, TOK, layout=gl.SliceLayout(1, s_layout))
        pos_m = first_pos + rows_s
        if HAS_SINKS:  # the sink is a logit with no value: it starts the running max and sum
            sink = gl.load(sinks_ptr + head + rows_s * 0).to(gl.float32) * 1.4426950408889634  # one per row
            m_i = gl.maximum(sink, -1.0e30)
            l_i = gl.exp2(sink - m_i)
        else:  # a finite "minus infinity": exp2(-1e30 - m) == 0 and no inf - inf
            m_i = gl.full([TOK], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([TOK], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc0 = gl.zeros([TOK, 64], gl.float32, layout=o_layout)  # E = 128 as two 64-wide halves
        acc1 = gl.zeros([TOK, 64], gl.float32, layout=o_layout)
        full_hi = ((first_pos + 1) // BN) * BN  # keys below are visible to every row: no mask
        mbarrier.wait(q_bar, 0)
        for b in range(gl.cdiv(key_hi, BN)):
            start_n = b * BN
            s = b % NS
            mbarrier.wait(ready.index(s), (b // NS) & 1)
            if start_n + BN > key_hi:
                # Slots at or past key_hi may hold garbage, NaN included, and 0 * NaN would reach
                # the accumulator through P @ V: zero those V rows first. Both warpgroups do it;
                # they write the same values, so the overlap is harmless.
                kr = start_n + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
                keep = (kr < key_hi)[:, None]
                vt0 = v_smem.index(s * 2).load(ld)
                vt1 = v_smem.index(s * 2 + 1).load(ld)
                v_smem.index(s * 2).store(gl.where(keep, vt0, 0.0))
                v_smem.index(s * 2 + 1).store(gl.where(keep, vt1, 0.0))
                fence_async_shared()  # generic-proxy writes before the wgmma's async-proxy reads
                _partition_barrier()
            qk = gl.zeros([TOK, BN], gl.float32, layout=s_layout)
            for c in gl.static_range(DC):
                qk = warpgroup_mma(q_smem.index(wg * DC + c), k_smem.index(s * DC + c).permute((1, 0)), qk,
                                   use_acc=c > 0, is_async=True)
            qk = warpgroup_mma_wait(0, deps=(qk,))
            if start_n >= full_hi:  # the blocks crossing the causal diagonal
                offs_n = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
                qk = gl.where(offs_n[None, :] <= pos_m[:, None], qk, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
            p = gl.exp2(qk * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            acc0 = acc0 * alpha_o[:, None]
            acc1 = acc1 * alpha_o[:, None]
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)  # P stays in registers as the A operand
            acc0 = warpgroup_mma(p_op, v_smem.index(s * 2), acc0, is_async=True)
            acc1 = warpgroup_mma(p_op, v_smem.index(s * 2 + 1), acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index(s), count=1)  # this warpgroup is done with stage s
        inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        _store_o(o_ptr, acc0, acc1, inv, tok0, q_start, q_len, head, stride_ot, stride_on)

    @gluon.jit
    def _attn_prefill_ws_kernel(
        q_desc, k_desc, v_desc, o_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr, sinks_ptr,
        stride_ot, stride_on, stride_pb, num_seqs, qk_scale, gqa,
        HEAD_D: gl.constexpr, PAGE_SIZE: gl.constexpr, HAS_SINKS: gl.constexpr, BN: gl.constexpr,
        TOK: gl.constexpr, NS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Grid (virtual TOK-token query blocks, head pairs), blocks and sequences as in prefill.py."""
        DC: gl.constexpr = HEAD_D // 64  # D in 64-wide chunks: one 128-byte swizzled TMA box each
        vblock = gl.num_programs(0) - 1 - gl.program_id(0)  # longest (last) blocks first
        head0 = gl.program_id(1) * 2
        seq = _find_seq(cu_q_ptr, num_seqs, vblock, TOK)
        q_start = gl.load(cu_q_ptr + seq).to(gl.int32)
        q_len = gl.load(cu_q_ptr + seq + 1).to(gl.int32) - q_start
        tok0 = (vblock - q_start // TOK - seq) * TOK
        if tok0 < q_len:
            kv_len = gl.load(kv_lens_ptr + seq).to(gl.int32)
            first_pos = kv_len - q_len + tok0
            key_hi = gl.minimum(kv_len, kv_len - q_len + gl.minimum(tok0 + TOK, q_len))
            dt: gl.constexpr = q_desc.dtype
            q_smem = gl.allocate_shared_memory(dt, [2 * DC, TOK, 64], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dt, [NS * DC, BN, 64], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dt, [NS * 2, BN, 64], v_desc.layout)
            ready, empty, q_bar = _ring(NS)
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BN, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, 64, 16])
            pt_row_ptr = pt_ptr + seq * stride_pb
            # the argument tuples stay inline: a constexpr (a layout) survives only there
            gl.warp_specialize([
                (_consumer, (o_ptr, sinks_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
                             0, q_start, q_len, tok0, first_pos, key_hi, head0, qk_scale, stride_ot, stride_on,
                             s_layout, o_layout, HAS_SINKS)),
                (_consumer, (o_ptr, sinks_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
                             1, q_start, q_len, tok0, first_pos, key_hi, head0, qk_scale, stride_ot, stride_on,
                             s_layout, o_layout, HAS_SINKS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                             pt_row_ptr, q_start + tok0, head0, head0 // gqa, key_hi, PAGE_SIZE)),
            ], [4, 1], [CONSUMER_REGS, 24])
            _ring_done(ready, empty, q_bar, NS)


def launch_prefill_ws(q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, scale, window=0,
                      sinks_N=None, out_TNE=None):
    """`dispatch.paged_attention` through this kernel; ValueError where it cannot run (see unsupported_reason)."""
    num_heads, num_kv_heads, head_d, head_e, page_size, num_seqs = _check_inputs(
        q_TND, k_pages_PSGD, v_pages_PSGE, page_table_BL, cu_q_B1, kv_lens_B, window, sinks_N)
    reason = unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window)
    if reason is not None:
        raise ValueError(f"launch_prefill_ws: unsupported call: {reason}")
    out_TNE = _new_out(q_TND, head_e, out_TNE)
    num_tokens = q_TND.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out_TNE
    gl_dtype = gl.bfloat16 if q_TND.dtype == torch.bfloat16 else gl.float16
    # 2-D views whose rows TMA copies: q [T, N*D] (a head's D chunk is a box of 64 tokens x 64),
    # the pools [P*S, G*D] and [P*S, G*E] (one page's 128 slots of a kv head's chunk per box)
    q_2d = q_TND.as_strided((num_tokens, num_heads * head_d), (q_TND.stride(0), 1))
    k_2d = k_pages_PSGD.view(-1, num_kv_heads * head_d)
    v_2d = v_pages_PSGE.view(-1, num_kv_heads * head_e)
    box_q, box_kv = [TOK, 64], [BLOCK_N, 64]
    q_desc = TensorDescriptor(q_2d, list(q_2d.shape), list(q_2d.stride()), box_q,
                              gl.NVMMASharedLayout.get_default_for(box_q, gl_dtype))
    kv_layout = gl.NVMMASharedLayout.get_default_for(box_kv, gl_dtype)
    k_desc = TensorDescriptor(k_2d, list(k_2d.shape), list(k_2d.stride()), box_kv, kv_layout)
    v_desc = TensorDescriptor(v_2d, list(v_2d.shape), list(v_2d.stride()), box_kv, kv_layout)
    grid = (num_tokens // TOK + num_seqs, num_heads // 2)
    try:
        _attn_prefill_ws_kernel[grid](
            q_desc, k_desc, v_desc, out_TNE, page_table_BL, cu_q_B1, kv_lens_B,
            q_TND if sinks_N is None else sinks_N,  # never read without sinks
            out_TNE.stride(0), out_TNE.stride(1), page_table_BL.stride(0), num_seqs, scale * LOG2E,
            num_heads // num_kv_heads,
            HEAD_D=head_d, PAGE_SIZE=page_size, HAS_SINKS=sinks_N is not None, BN=BLOCK_N, TOK=TOK, NS=STAGES,
            CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
        )
    except (triton.CompilationError, RuntimeError) as exc:  # e.g. a Gluon API this code does not know
        raise RuntimeError(f"the warp-specialised attention kernel failed on Triton {triton.__version__} "
                           f"({type(exc).__name__}); MIMO_FN_ATTENTION_WS=0 runs the Triton kernel instead") from exc
    return out_TNE
