"""FP8 full attention, warp-specialised for Hopper (sm_90), written in Gluon.

Legend as in fp8.py: T query tokens, B sequences, N query heads, G kv heads, D q/k head dim,
E v head dim (128), P pages in the pool, S slots per page, L logical pages per sequence.

The same contract and the same arithmetic as fp8.py's Triton kernel (`launch_fp8_attention`: Q8 with a
scale per (token, head) row, K8 [P, S, G, D] and V8 transposed [P, G, E, S] with a scale per (page,
kv head), P cast to e4m3 as 2^P_SHIFT * p, the accumulator kept in units of the current page's V
scale); `fp8.attention_fp8_ref` is the oracle of both. The structure is ws.py's (read its docstring):
a producer warp streams each key block's K8 and V8 through TMA into a ring, two consumer warpgroups
(one query head each, 64 tokens) run QK^T and P @ V as FP8 wgmma with the softmax in registers, and
no CTA-wide barrier between them. In FP8 a stage is half the bytes, so the ring is deeper (3 stages).
What FP8 changes inside a consumer:
- both wgmma operands must be K-major: K8 tiles [BN keys, 64 of D] are read permuted (D contiguous);
  V8 tiles come transposed from the quantiser, [64 of E, BN keys], and are read permuted (keys
  contiguous), so no transpose happens on the GPU;
- the consumer reads the block's page once more (for its K / V scales; the producer read it for the
  addresses) a block ahead, so the two scalar loads are never waited on.
The quantised pages hold zeros past kv_len (fp8_inputs.quantize_paged_kv_fp8), so unlike ws.py no V row
needs zeroing: every slot a block reads is finite.

Gluon has no CPU interpreter: this kernel runs on the GPU only (tests/test_attention_fp8.py compares
it with the twin there and compiles it for sm_90 everywhere).
"""

import torch
import triton

from mimo_fn.kernels.attention.common import LOG2E, NEG_BIG
from mimo_fn.kernels.ws_common import HAS_GLUON
from mimo_fn.quant import FP8_DTYPE

if HAS_GLUON:
    from mimo_fn.kernels.attention.ws import _find_seq, _ring, _ring_done, _store_o  # as the bf16 kernel's
    from mimo_fn.kernels.ws_common import TensorDescriptor, gl, gluon, mbarrier, tma_load, warpgroup_mma, \
        warpgroup_mma_wait

BLOCK_N = 128  # keys per block; pages hold whole blocks (one TMA box per block and chunk)
TOK = 64  # query tokens per program: one wgmma M tile per consumer warpgroup
CHUNK = 64  # D and E in 64-element (64-byte) chunks: one TMA box each
STAGES = 3  # ring depth: 3 x 128 keys x (192 + 128) bytes = 120 KB, plus Q8 (24 KB)
MAX_REGS = 160  # ws.py's register split: 12 warps x 32 x 160; the producer keeps 24 a thread
CONSUMER_REGS = 232


def unsupported_reason(q_TND, k_pages_PSGD, v_pages_PSGE, window) -> str | None:
    """None when this kernel can run the call (after fp8.unsupported_reason's checks), else why not."""
    if not HAS_GLUON:
        return f"Triton {triton.__version__} (Gluon >= 3.6)"
    if not q_TND.is_cuda or torch.cuda.get_device_capability(q_TND.device) != (9, 0):
        return "needs a Hopper GPU (sm_90)"
    if window != 0:
        return "sliding window (full attention only)"
    num_heads, head_d = q_TND.shape[1], q_TND.shape[2]
    page_size, num_kv_heads = k_pages_PSGD.shape[1], k_pages_PSGD.shape[2]
    if head_d % CHUNK or v_pages_PSGE.shape[-1] != 128:
        return f"head dims D={head_d}, E={v_pages_PSGE.shape[-1]} (D a multiple of {CHUNK}, E=128)"
    if page_size % BLOCK_N:
        return f"page size {page_size} (a multiple of {BLOCK_N})"
    if num_kv_heads == 0 or num_heads % num_kv_heads or (num_heads // num_kv_heads) % 2:
        return f"N={num_heads} query heads over G={num_kv_heads} kv heads (an even number per kv head)"
    return None


if HAS_GLUON:

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                  pt_row_ptr, q_row, head0, kv_head, key_hi, PAGE_SIZE: gl.constexpr, NUM_KV_HEADS: gl.constexpr):
        # q_smem [2 * DC, TOK, 64]: head0's D chunks, then head0 + 1's; k_smem [NS * DC, BN, 64];
        # v_smem [NS * EC, 64, BN] (E rows, keys contiguous). Shapes come from the types.
        DC: gl.constexpr = q_smem.type.shape[0] // 2
        BN: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = k_smem.type.shape[0] // DC
        EC: gl.constexpr = v_smem.type.shape[0] // NS
        CH: gl.constexpr = q_smem.type.shape[2]
        HEAD_D: gl.constexpr = DC * CH
        mbarrier.expect(q_bar, 2 * DC * q_smem.type.shape[1] * CH)  # one byte an element
        for w in gl.static_range(2):
            for c in gl.static_range(DC):
                tma_load(q_desc, [q_row, (head0 + w) * HEAD_D + c * CH], q_bar, q_smem.index(w * DC + c))
        for b in range(gl.cdiv(key_hi, BN)):
            start_n = b * BN
            page = gl.load(pt_row_ptr + start_n // PAGE_SIZE).to(gl.int32)
            s = b % NS
            mbarrier.wait(empty.index(s), ((b // NS) & 1) ^ 1)  # phase 1 passes on a fresh barrier
            bar = ready.index(s)
            mbarrier.expect(bar, (DC + EC) * BN * CH)
            k_row = page * PAGE_SIZE + start_n % PAGE_SIZE
            for c in gl.static_range(DC):
                tma_load(k_desc, [k_row, kv_head * HEAD_D + c * CH], bar, k_smem.index(s * DC + c))
            v_row = (page * NUM_KV_HEADS + kv_head) * (EC * CH)  # V8 as [P*G*E, S]: this page's E rows
            for c in gl.static_range(EC):
                tma_load(v_desc, [v_row + c * CH, start_n % PAGE_SIZE], bar, v_smem.index(s * EC + c))

    @gluon.jit
    def _qk(q_smem, k_smem, wg, s, TOK: gl.constexpr, BN: gl.constexpr, DC: gl.constexpr, s_layout: gl.constexpr):
        """Q8 @ K8^T of stage s for warpgroup wg, issued (async; the caller waits)."""
        qk = gl.zeros([TOK, BN], gl.float32, layout=s_layout)
        for c in gl.static_range(DC):
            qk = warpgroup_mma(q_smem.index(wg * DC + c), k_smem.index(s * DC + c).permute((1, 0)), qk,
                               use_acc=c > 0, is_async=True)
        return qk

    @gluon.jit
    def _softmax_pv(qk, acc0, acc1, m_i, l_i, sv_i, sk, sv, row_scale, start_n, full_hi, pos_m, v_smem, s,
                    s_layout: gl.constexpr, o_layout: gl.constexpr, P_SHIFT_C: gl.constexpr):
        """One key block's online softmax on its finished scores, the rescale of the accumulator into
        this page's V units, and P8 @ V8 issued (async; the caller waits)."""
        BN: gl.constexpr = v_smem.type.shape[2]
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)  # 8-bit A
        sc = qk * (row_scale * sk)[:, None]  # base-2 logits: qk_scale * sq * sk
        if start_n >= full_hi:  # the blocks crossing the causal diagonal
            offs_n = start_n + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            sc = gl.where(offs_n[None, :] <= pos_m[:, None], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        p = gl.exp2(sc - (m_new - P_SHIFT_C)[:, None])  # 2^P_SHIFT * exp2(s - m), in [0, 2^P_SHIFT]
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        rescale = gl.convert_layout(alpha * (sv_i / sv), gl.SliceLayout(1, o_layout))  # into this page's units
        acc0 = acc0 * rescale[:, None]
        acc1 = acc1 * rescale[:, None]
        p_op = gl.convert_layout(p.to(gl.float8e4nv), p_layout)  # P8 stays in registers as the A operand
        acc0 = warpgroup_mma(p_op, v_smem.index(s * 2).permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(p_op, v_smem.index(s * 2 + 1).permute((1, 0)), acc1, is_async=True)
        return acc0, acc1, m_new, l_i

    @gluon.jit
    def _consumer(o_ptr, sq_ptr, sk_ptr, sv_ptr, sinks_ptr, pt_row_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
                  wg, q_start, q_len, tok0, first_pos, key_hi, head0, kv_head, qk_scale, stride_ot, stride_on,
                  s_layout: gl.constexpr, o_layout: gl.constexpr, HAS_SINKS: gl.constexpr,
                  NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr,
                  P_SHIFT_C: gl.constexpr, NEG_BIG_C: gl.constexpr):
        # One warpgroup: query head head0 + wg, tokens tok0 .. tok0 + TOK of its sequence.
        DC: gl.constexpr = q_smem.type.shape[0] // 2
        TOK: gl.constexpr = q_smem.type.shape[1]
        BN: gl.constexpr = k_smem.type.shape[1]
        NS: gl.constexpr = k_smem.type.shape[0] // DC
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        head = head0 + wg
        rows_s = gl.arange(0, TOK, layout=row_l)
        pos_m = first_pos + rows_s
        row_ok = tok0 + rows_s < q_len
        # qk_scale * sq per row: the scores' scale before the block's K scale
        row_scale = qk_scale * gl.load(sq_ptr + (q_start + tok0 + rows_s).to(gl.int64) * NUM_HEADS + head,
                                       mask=row_ok, other=1.0)
        if HAS_SINKS:  # the sink is a logit with no value: it starts the running max and sum
            sink = gl.load(sinks_ptr + head + rows_s * 0).to(gl.float32) * 1.4426950408889634
            m_i = gl.maximum(sink, NEG_BIG_C)
            l_i = gl.exp2(sink - m_i) * (1 << P_SHIFT_C)  # in the units of p (2^P_SHIFT at the max)
        else:
            m_i = gl.full([TOK], NEG_BIG_C, gl.float32, layout=row_l)
            l_i = gl.zeros([TOK], gl.float32, layout=row_l)
        acc0 = gl.zeros([TOK, 64], gl.float32, layout=o_layout)  # E = 128 as two 64-wide halves
        acc1 = gl.zeros([TOK, 64], gl.float32, layout=o_layout)
        sv_i = 1.0  # acc is 0: any unit
        full_hi = ((first_pos + 1) // BN) * BN  # keys below are visible to every row: no mask
        page = gl.load(pt_row_ptr).to(gl.int64)
        sk = gl.load(sk_ptr + page * NUM_KV_HEADS + kv_head)
        sv = gl.load(sv_ptr + page * NUM_KV_HEADS + kv_head)
        n_blocks = gl.cdiv(key_hi, BN)
        mbarrier.wait(q_bar, 0)
        for b in range(n_blocks):
            s = b % NS
            # the next block's scales, a block ahead (the last block reads its own page again)
            nxt = gl.minimum(b + 1, n_blocks - 1) * BN
            next_page = gl.load(pt_row_ptr + nxt // PAGE_SIZE).to(gl.int64)
            next_sk = gl.load(sk_ptr + next_page * NUM_KV_HEADS + kv_head)
            next_sv = gl.load(sv_ptr + next_page * NUM_KV_HEADS + kv_head)
            mbarrier.wait(ready.index(s), (b // NS) & 1)
            qk = warpgroup_mma_wait(0, deps=(_qk(q_smem, k_smem, wg, s, TOK, BN, DC, s_layout),))
            acc0, acc1, m_i, l_i = _softmax_pv(qk, acc0, acc1, m_i, l_i, sv_i, sk, sv, row_scale, b * BN, full_hi,
                                               pos_m, v_smem, s, s_layout, o_layout, P_SHIFT_C)
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index(s), count=1)  # this warpgroup is done with stage s
            sv_i = sv
            sk = next_sk
            sv = next_sv
        l_i = gl.where(row_ok, l_i, 1.0)  # padded rows: finite, never stored
        inv = gl.convert_layout(sv_i / l_i, gl.SliceLayout(1, o_layout))
        _store_o(o_ptr, acc0, acc1, inv, tok0, q_start, q_len, head, stride_ot, stride_on)

    @gluon.jit
    def _fp8_ws_kernel(
        q_desc, k_desc, v_desc, o_ptr, sq_ptr, sk_ptr, sv_ptr, pt_ptr, cu_q_ptr, kv_lens_ptr, sinks_ptr,
        stride_ot, stride_on, stride_pb, num_seqs, qk_scale, gqa,
        HEAD_D: gl.constexpr, NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, PAGE_SIZE: gl.constexpr,
        HAS_SINKS: gl.constexpr, BN: gl.constexpr, TOK: gl.constexpr, NS: gl.constexpr,
        P_SHIFT_C: gl.constexpr, NEG_BIG_C: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Grid (virtual TOK-token query blocks, head pairs), blocks and sequences as in prefill.py."""
        DC: gl.constexpr = HEAD_D // 64
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
            kv_head = head0 // gqa
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * DC, TOK, 64], q_desc.layout)
            k_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS * DC, BN, 64], k_desc.layout)
            v_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS * 2, 64, BN], v_desc.layout)
            ready, empty, q_bar = _ring(NS)
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BN, 32])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, 64, 32])
            pt_row_ptr = pt_ptr + seq * stride_pb
            # the argument tuples stay inline: a constexpr (a layout) survives only there
            gl.warp_specialize([
                (_consumer, (o_ptr, sq_ptr, sk_ptr, sv_ptr, sinks_ptr, pt_row_ptr, q_smem, k_smem, v_smem, q_bar,
                             ready, empty, 0, q_start, q_len, tok0, first_pos, key_hi, head0, kv_head, qk_scale,
                             stride_ot, stride_on, s_layout, o_layout, HAS_SINKS, NUM_HEADS, NUM_KV_HEADS,
                             PAGE_SIZE, P_SHIFT_C, NEG_BIG_C)),
                (_consumer, (o_ptr, sq_ptr, sk_ptr, sv_ptr, sinks_ptr, pt_row_ptr, q_smem, k_smem, v_smem, q_bar,
                             ready, empty, 1, q_start, q_len, tok0, first_pos, key_hi, head0, kv_head, qk_scale,
                             stride_ot, stride_on, s_layout, o_layout, HAS_SINKS, NUM_HEADS, NUM_KV_HEADS,
                             PAGE_SIZE, P_SHIFT_C, NEG_BIG_C)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                             pt_row_ptr, q_start + tok0, head0, kv_head, key_hi, PAGE_SIZE, NUM_KV_HEADS)),
            ], [4, 1], [CONSUMER_REGS, 24])
            _ring_done(ready, empty, q_bar, NS)


def launch_fp8_ws(q8_TND, sq_TN, k8_PSGD, v8_PGES, sk_PG, sv_PG, page_table_BL, cu_q_B1, kv_lens_B, scale,
                  sinks_N, out_TNE, p_shift: int, stages: int = STAGES):
    """fp8.launch_fp8_attention's contract through this kernel (inputs from fp8's quantisers; p_shift
    is fp8.P_SHIFT, passed in since fp8.py imports this module)."""
    num_tokens, num_heads, head_d = q8_TND.shape
    _, page_size, num_kv_heads, _ = k8_PSGD.shape
    if q8_TND.dtype != FP8_DTYPE or not all(t.is_contiguous() for t in (q8_TND, k8_PSGD, v8_PGES)):
        raise ValueError("launch_fp8_ws takes fp8_inputs.quantize_q_fp8 / quantize_paged_kv_fp8 outputs "
                         "(contiguous e4m3)")
    num_seqs = kv_lens_B.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out_TNE
    # 2-D views whose rows TMA copies: Q8 [T, N*D], K8 [P*S, G*D], V8 [P*G*E, S] (keys contiguous)
    q_2d = q8_TND.view(num_tokens, num_heads * head_d)
    k_2d = k8_PSGD.view(-1, num_kv_heads * head_d)
    v_2d = v8_PGES.view(-1, page_size)
    box_q, box_k, box_v = [TOK, CHUNK], [BLOCK_N, CHUNK], [CHUNK, BLOCK_N]
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), box,
                              gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))
             for t, box in ((q_2d, box_q), (k_2d, box_k), (v_2d, box_v))]
    grid = (num_tokens // TOK + num_seqs, num_heads // 2)
    try:
        _fp8_ws_kernel[grid](
            *descs, out_TNE, sq_TN, sk_PG, sv_PG, page_table_BL, cu_q_B1, kv_lens_B,
            sq_TN if sinks_N is None else sinks_N,  # never read without sinks
            out_TNE.stride(0), out_TNE.stride(1), page_table_BL.stride(0), num_seqs, scale * LOG2E,
            num_heads // num_kv_heads,
            HEAD_D=head_d, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size,
            HAS_SINKS=sinks_N is not None, BN=BLOCK_N, TOK=TOK, NS=stages, P_SHIFT_C=p_shift,
            NEG_BIG_C=NEG_BIG.value, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
        )
    except (triton.CompilationError, RuntimeError) as exc:
        raise RuntimeError(f"the warp-specialised FP8 attention kernel failed on Triton {triton.__version__} "
                           f"({type(exc).__name__})") from exc
    return out_TNE
