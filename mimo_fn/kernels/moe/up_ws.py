"""The FP8 MoE up GEMM, warp-specialised for Hopper (sm_90) in Gluon: `moe_up_fp8_ws`.

Legend: T tokens, K experts per token, P = T*K (token, k) pairs, E experts, H hidden (the
reduction), I expert intermediate (h's columns), M padded slots of align.py's layout (128-row
blocks), Hb / Ib = H / 128, I / 128 scale groups, S ring stages.

Same contract as gemm.py's `_moe_up` for FP8: h[s] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T) for
slot s holding pair p = t*K + k of expert e, quantised per slot in 1x128 groups: (h_q_MI, hs_MIb),
hs stored [Ib, M] (M-major: the down GEMM loads a K step's scales of consecutive slots at once).
Padding slots' rows are finite (zeros); rows past the used blocks are not written (as the Triton
kernel's: nothing reads them).

Why: the Triton up kernel (gemm_kernels._up_tile) waits for each 128-deep K step's two wgmmas
before it scales their fp32 partials, so the tensor cores idle on the promotion (777 TFLOP/s at 64K
tokens on an H200). Two launches here, no host sync:
1. `gather_slots` (Triton) copies x's FP8 rows and scales into slot order, x_MH and xs [Hb, M]:
   TMA on Hopper copies boxes, not row lists. Padding slots get zero codes and scale 0 (finite
   h = 0); slots past the used blocks are not written (the GEMM never reads them).
2. the GEMM, down_ws's design with a two-box weight stage: a tile is one aligned block of 128
   slots (one expert) times 128 columns of h (one quantisation group), computed in two passes of
   64 columns. Per K step a producer warp TMA-loads the block's two 64-row x boxes and, for the
   pass's columns n.., w13's gate rows e*2I + n.. and up rows e*2I + I + n.. (64 x 128 each) into
   one [128, 128] stage of an S-stage ring. Two consumer warpgroups of 64 slots each run one
   m64n128k32 wgmma chain a step (gate and up columns together: x's tile is read from shared
   memory once, where two m64n64 MMAs read it twice) into alternating partials; the previous
   step's partial is then scaled (the rows' x scale times the gate's or the up's 128-row weight
   block scale, a column half each) and added while the next MMA runs: fp8_gemm_ws's pipelining.
   Registers: the gate and up accumulators [64, 64] (32 fp32 a thread each) and two [64, 128]
   partials (64 each), 192 a thread. Epilogue: h = silu(g) * u in fp32; the first pass's h waits in shared memory; after
   the second, both are quantised with the group's amax (quantize_fp8_act_ref's arithmetic) into
   h_q and hs. h never goes through memory in bf16.
Next step: the gather writes and reads M x H bytes (2.2 GB each way at 64K tokens); loading the x
rows by slot in the producer (cp.async of row lists: Hopper's TMA copies boxes only) would save it.

Determinism: no split-K, one K order for every row, rows independent (the MMAs, the scales, the
quantiser's groups): a pair's h row has the same bits whichever slot, block or token count it
comes with (tests/test_moe_up_ws.py checks on the GPU). The bits are not the Triton kernel's (another
MMA shape and promotion order), so deterministic mode never runs this.
Gluon has no interpreter: tests compile the GEMM for sm_90 on the CPU and run its numerics on a GPU;
the gather runs in the interpreter.
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels import fp8_gemm_ws as fgw
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.kernels.ws_common import tma_ready
from mimo_fn.quant import BLOCK, FP8_DTYPE

HAS_GLUON = fgw.HAS_GLUON
HALF_M = fgw.HALF_M  # slots a consumer warpgroup: one wgmma M tile
BLOCK_M = fgw.BLOCK_M  # 128 slots: one aligned block
HALF_N = 64  # columns of h a pass: its 64 gate and 64 up weight rows make one m64n128k32 MMA
BLOCK_N = 2 * HALF_N  # columns of h a tile: one 1x128 quantisation group, in two passes
BLOCK_K = BLOCK  # one x scale group and one weight block column a K step
STAGES = 6  # a stage: x 128 x 128 + gate and up 2 x 64 x 128 fp8 = 32 KB; 6 stages + h's 32 KB: 224 of 227 KB
GROUP_M = fgw.GROUP_M
# fp8_gemm_ws's register split: 12 warps x 32 x 168; the producer drops to 24 a thread, the second
# consumer takes 232, the first what is left. A consumer holds the gate and up accumulators and two
# partials, 192 fp32 a thread (ptxas: no spills).
MAX_REGS, CONSUMER_REGS = fgw.MAX_REGS, fgw.CONSUMER_REGS
_GATHER_S, _GATHER_H = 16, 1024  # gather tile: 16 slots x 1024 bytes of x


@triton.jit
def _gather_kernel(x_ptr, xs_ptr, xo_ptr, xso_ptr, sorted_ids_ptr, num_post_pad_ptr, num_pairs, H,
                   stride_xt, stride_xst, stride_xsg, stride_xom, stride_xsom, stride_xsog,
                   TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    # x as uint8 codes: a byte copy (the interpreter has no fp8 loads)
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    live = slots < tl.load(num_post_pad_ptr)  # ids past the used blocks are unwritten garbage
    pair = tl.load(sorted_ids_ptr + slots, mask=live, other=num_pairs)
    real = pair < num_pairs  # padding slots (sentinel P) read zeros: h = 0, finite
    tok = tl.where(real, pair // TOP_K, 0).to(tl.int64)
    rows = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c_ok = cols < H
    v = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :], mask=real[:, None] & c_ok[None, :], other=0)
    tl.store(xo_ptr + rows[:, None] * stride_xom + cols[None, :], v, mask=live[:, None] & c_ok[None, :])
    G: tl.constexpr = BLOCK_H // 128
    grp = tl.program_id(1) * G + tl.arange(0, G)
    g_ok = grp * 128 < H
    s = tl.load(xs_ptr + tok[:, None] * stride_xst + grp[None, :] * stride_xsg,
                mask=real[:, None] & g_ok[None, :], other=0.0)
    tl.store(xso_ptr + rows[:, None] * stride_xsom + grp[None, :] * stride_xsog, s, mask=live[:, None] & g_ok[None, :])


def gather_slots(x_q_TH: torch.Tensor, x_scale_TG: torch.Tensor, al: MoeAlignment, top_k: int):
    """(x_MH fp8, xs_MHb fp32 stored [Hb, M]): slot s holds x row sorted_ids[s] // top_k and its
    scales; padding slots zeros and scale 0; slots past num_tokens_post_pad unwritten. H % 128 == 0."""
    m, hid = al.sorted_ids_M.numel(), x_q_TH.shape[1]
    x_MH = torch.empty(m, hid, dtype=FP8_DTYPE, device=x_q_TH.device)
    xs_MHb = torch.empty(hid // BLOCK, m, dtype=torch.float32, device=x_q_TH.device).t()
    if m == 0:
        return x_MH, xs_MHb
    x_u8, xo_u8 = x_q_TH.view(torch.uint8), x_MH.view(torch.uint8)
    if x_u8.stride(1) != 1:  # the kernel steps along a row by bytes
        x_u8 = x_u8.contiguous()
    block_h = min(_GATHER_H, triton.next_power_of_2(hid))
    _gather_kernel[(triton.cdiv(m, _GATHER_S), triton.cdiv(hid, block_h))](
        x_u8, x_scale_TG, xo_u8, xs_MHb, al.sorted_ids_M, al.num_tokens_post_pad_1, al.num_pairs, hid,
        x_u8.stride(0), *x_scale_TG.stride(), xo_u8.stride(0), *xs_MHb.stride(),
        TOP_K=top_k, BLOCK_S=_GATHER_S, BLOCK_H=block_h, num_warps=4,
    )
    return x_MH, xs_MHb


def gather_slots_ref(x_q_TH: torch.Tensor, x_scale_TG: torch.Tensor, al: MoeAlignment, top_k: int):
    """Plain-torch twin of `gather_slots` (host sync: reference only); rows past the used slots are
    zeros here, where the kernel leaves them unwritten."""
    m, hid = al.sorted_ids_M.numel(), x_q_TH.shape[1]
    pair_M = al.sorted_ids_M.long()
    real_M = (torch.arange(m, device=pair_M.device) < int(al.num_tokens_post_pad_1)) & (pair_M < al.num_pairs)
    tok_R = pair_M[real_M] // top_k
    x_MH = torch.zeros(m, hid, dtype=torch.uint8, device=x_q_TH.device)
    x_MH[real_M] = x_q_TH.view(torch.uint8)[tok_R]
    xs_MHb = torch.zeros(m, hid // BLOCK, dtype=torch.float32, device=x_q_TH.device)
    xs_MHb[real_M] = x_scale_TG[tok_R]
    return x_MH.view(FP8_DTYPE), xs_MHb


if HAS_GLUON:
    from mimo_fn.kernels.ws_common import TensorDescriptor, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from mimo_fn.kernels.ws_common import tile_coords as _tile_coords
    from mimo_fn.kernels.ws_common import tma_load as _tma_load

    @gluon.jit
    def _producer(x_desc, w_desc, a_smem, b_smem, ready, empty, expert_of_block_ptr, num_tiles, num_k,
                  grid_m, grid_n, N, GROUP: gl.constexpr):
        # a_smem [2 * S, HM, BK]: stage s's slots 0-63, then 64-127; b_smem [S, 2 * HN, BK]: stage s's
        # HN gate rows, then the HN up rows of the same h columns. A tile's two passes (its column
        # halves) load the same x boxes again: L2 hits.
        NS: gl.constexpr = b_smem.type.shape[0]
        HM: gl.constexpr = a_smem.type.shape[1]
        HN: gl.constexpr = w_desc.block_type.shape[0]
        BK: gl.constexpr = b_smem.type.shape[2]
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
            row_g = gl.load(expert_of_block_ptr + pid_m) * 2 * N + pid_n * 2 * HN  # w13 as [E * 2I, H]
            for half in range(2):
                for kb in range(num_k):
                    s = it % NS
                    mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)  # phase 1 passes on a fresh barrier
                    bar = ready.index(s)
                    mbarrier.expect(bar, (2 * HM + 2 * HN) * BK)  # fp8: one byte an element
                    _tma_load(x_desc, [pid_m * 2 * HM, kb * BK], bar, a_smem.index(2 * s))
                    _tma_load(x_desc, [pid_m * 2 * HM + HM, kb * BK], bar, a_smem.index(2 * s + 1))
                    b = b_smem.index(s)
                    _tma_load(w_desc, [row_g + half * HN, kb * BK], bar, b.slice(0, HN))
                    _tma_load(w_desc, [row_g + N + half * HN, kb * BK], bar, b.slice(HN, HN))  # up rows: I on
                    it += 1

    @gluon.jit
    def _halves(gu):
        """[HM, 2 HN] MMA result -> (gate [HM, HN], up [HM, HN]): a relabelling of registers (in the
        wgmma layout a thread holds column c and column c + HN alike)."""
        HM: gl.constexpr = gu.type.shape[0]
        HN: gl.constexpr = gu.type.shape[1] // 2
        return gl.split(gl.permute(gl.reshape(gu, [HM, 2, HN]), [0, 2, 1]))

    @gluon.jit
    def _mma(a_smem, b_smem, it, wg, buf):
        """Start ring slot it's MMA of this warpgroup's x rows by the stage's gate and up rows into buf's
        registers (their values are not read: use_acc=False); returns the pending partial."""
        NS: gl.constexpr = b_smem.type.shape[0]
        s = it % NS
        return warpgroup_mma(a_smem.index(2 * s + wg), b_smem.index(s).permute((1, 0)), buf,
                             use_acc=False, is_async=True)

    @gluon.jit
    def _promote(acc_g, acc_u, part, s_g, s_u, PENDING: gl.constexpr):
        """Wait for a partial (PENDING later MMAs may still run), add its gate and up halves scaled;
        returns the partial (its registers take the next MMA but one) and the accumulators."""
        done = warpgroup_mma_wait(PENDING, deps=(part,))
        p_g, p_u = _halves(done)
        acc_g = acc_g + p_g * s_g[:, None]
        acc_u = acc_u + p_u * s_u[:, None]
        # as fp8_gemm_ws._retire: a wait that returns at once but takes the accumulators pins the
        # scaling before the next MMA into done's registers (else ptxas serialises every wgmma, C7515)
        acc_g, acc_u = warpgroup_mma_wait(PENDING, deps=(acc_g, acc_u))
        return done, acc_g, acc_u

    @gluon.jit
    def _pass(a_smem, b_smem, ready, empty, wg, it, b0, b1, xs_rows, ws_g, ws_u, num_k, stride_xsg, stride_wsk):
        """One column half of a tile: the K loop over ring slots it .. it + num_k - 1; returns the gate and
        up accumulators [HM, HN], the partial buffers and the next ring slot.

        Two partial buffers alternate (b0 for even K steps, b1 for odd), each MMA writing the registers
        its buffer held last (zeroed once per program, before any MMA), so no MMA register is ever
        copied (ptxas would serialise every wgmma, C7514 / C7515); a loop turn takes two steps. Step
        k's partial is scaled while step k + 1's MMA runs."""
        NS: gl.constexpr = b_smem.type.shape[0]
        acc_g, acc_u = _halves(gl.zeros_like(b0))
        mbarrier.wait(ready.index(it % NS), (it // NS) & 1)
        p0 = _mma(a_smem, b_smem, it, wg, b0)
        a_s = gl.load(xs_rows)
        s_g0 = a_s * gl.load(ws_g)
        s_u0 = a_s * gl.load(ws_u)
        for kb in range(1, num_k - 1, 2):  # steps kb (buffer 1) and kb + 1 (buffer 0)
            mbarrier.wait(ready.index((it + 1) % NS), ((it + 1) // NS) & 1)
            p1 = _mma(a_smem, b_smem, it + 1, wg, b1)
            a_s = gl.load(xs_rows + kb * stride_xsg)
            s_g1 = a_s * gl.load(ws_g + kb * stride_wsk)
            s_u1 = a_s * gl.load(ws_u + kb * stride_wsk)
            b0, acc_g, acc_u = _promote(acc_g, acc_u, p0, s_g0, s_u0, 1)
            mbarrier.arrive(empty.index(it % NS), count=1)
            mbarrier.wait(ready.index((it + 2) % NS), ((it + 2) // NS) & 1)
            p0 = _mma(a_smem, b_smem, it + 2, wg, b0)
            a_s = gl.load(xs_rows + (kb + 1) * stride_xsg)
            s_g0 = a_s * gl.load(ws_g + (kb + 1) * stride_wsk)
            s_u0 = a_s * gl.load(ws_u + (kb + 1) * stride_wsk)
            b1, acc_g, acc_u = _promote(acc_g, acc_u, p1, s_g1, s_u1, 1)
            mbarrier.arrive(empty.index((it + 1) % NS), count=1)
            it += 2
        if num_k % 2 == 0:  # one odd step left
            mbarrier.wait(ready.index((it + 1) % NS), ((it + 1) // NS) & 1)
            p1 = _mma(a_smem, b_smem, it + 1, wg, b1)
            a_s = gl.load(xs_rows + (num_k - 1) * stride_xsg)
            s_g1 = a_s * gl.load(ws_g + (num_k - 1) * stride_wsk)
            s_u1 = a_s * gl.load(ws_u + (num_k - 1) * stride_wsk)
            b0, acc_g, acc_u = _promote(acc_g, acc_u, p0, s_g0, s_u0, 1)
            mbarrier.arrive(empty.index(it % NS), count=1)
            b1, acc_g, acc_u = _promote(acc_g, acc_u, p1, s_g1, s_u1, 0)
            mbarrier.arrive(empty.index((it + 1) % NS), count=1)
            it += 2
        else:
            b0, acc_g, acc_u = _promote(acc_g, acc_u, p0, s_g0, s_u0, 0)
            mbarrier.arrive(empty.index(it % NS), count=1)
            it += 1
        return acc_g, acc_u, b0, b1, it

    @gluon.jit
    def _consumer(hq_ptr, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem, ready, empty, wg,
                  num_tiles, num_k, grid_m, grid_n, N, stride_hm, stride_hsm, stride_hsg, stride_xsm, stride_xsg,
                  stride_wse, stride_wsn, stride_wsk, acc_layout: gl.constexpr, GROUP: gl.constexpr):
        # Slots wg * 64 .. wg * 64 + 63 of each of this program's blocks, h columns pid_n * 128 .. + 127
        # in two passes of 64 (a 1x128 group: its scale needs both halves' amax). The first pass's h
        # waits in h_smem (each thread reads back its own elements) while the second runs.
        HM: gl.constexpr = a_smem.type.shape[1]
        HN: gl.constexpr = b_smem.type.shape[1] // 2
        b0 = gl.zeros([HM, 2 * HN], gl.float32, layout=acc_layout)
        b1 = gl.zeros([HM, 2 * HN], gl.float32, layout=acc_layout)
        h, _ = _halves(b0)  # the layout of a half
        rows_layout: gl.constexpr = gl.SliceLayout(1, h.type.layout)
        cols_layout: gl.constexpr = gl.SliceLayout(0, h.type.layout)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
            slots = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=rows_layout)
            xs_rows = xs_ptr + slots * stride_xsm  # every slot of a used block is gathered: no mask
            # the tile's 128 gate columns are weight block pid_n, its up columns I / 128 blocks further on
            ws_g = ws_ptr + gl.load(expert_of_block_ptr + pid_m) * stride_wse + pid_n * stride_wsn
            ws_u = ws_g + (N // 128) * stride_wsn
            amax = gl.zeros([HM], gl.float32, layout=rows_layout)
            for half in range(2):
                acc_g, acc_u, b0, b1, it = _pass(a_smem, b_smem, ready, empty, wg, it, b0, b1, xs_rows, ws_g, ws_u,
                                                 num_k, stride_xsg, stride_wsk)
                h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # silu(g) * u in fp32 (padding slots: 0)
                amax = gl.maximum(amax, gl.max(gl.abs(h), axis=1))
                if half == 0:
                    h_smem.store(h)
            # quantise_fp8_act_ref's arithmetic: IEEE divisions, clamp, round to nearest even
            scale = gl.div_rn(gl.maximum(amax, 1e-10), 448.0)
            cols = pid_n * 2 * HN + gl.arange(0, HN, layout=cols_layout)
            out = hq_ptr + slots.to(gl.int64)[:, None] * stride_hm + cols[None, :]
            q = gl.minimum(gl.maximum(gl.div_rn(h, scale[:, None]), -448.0), 448.0)
            gl.store(out + HN, q.to(hq_ptr.dtype.element_ty))
            q = gl.minimum(gl.maximum(gl.div_rn(h_smem.load(h.type.layout), scale[:, None]), -448.0), 448.0)
            gl.store(out, q.to(hq_ptr.dtype.element_ty))
            gl.store(hs_ptr + slots * stride_hsm + pid_n * stride_hsg, scale)

    @gluon.jit
    def _moe_up_ws_kernel(x_desc, w_desc, hq_ptr, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, num_post_pad_ptr, N, K,
                          stride_hm, stride_hsm, stride_hsg, stride_xsm, stride_xsg, stride_wse, stride_wsn,
                          stride_wsk, NS: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
        """Persistent grid (at most one program per SM) over the used blocks x I / 128 column tiles."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        HM: gl.constexpr = x_desc.block_type.shape[0]
        HN: gl.constexpr = w_desc.block_type.shape[0]
        grid_m = gl.cdiv(gl.load(num_post_pad_ptr), 2 * HM)  # used blocks, written by moe_align on the device
        grid_n = N // (2 * HN)
        num_tiles = grid_m * grid_n
        num_k = K // BK
        a_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * NS, HM, BK], x_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [NS, 2 * HN, BK], w_desc.layout)
        h_smem = gl.allocate_shared_memory(gl.float32, [2, HM, HN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumer warpgroups release a stage
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, 2 * HN, 32])
        # the argument tuples stay inline: a constexpr (a layout) survives only there
        gl.warp_specialize([
            (_consumer, (hq_ptr, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem.index(0), ready,
                         empty, 0, num_tiles, num_k, grid_m, grid_n, N, stride_hm, stride_hsm, stride_hsg, stride_xsm,
                         stride_xsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (_consumer, (hq_ptr, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem.index(1), ready,
                         empty, 1, num_tiles, num_k, grid_m, grid_n, N, stride_hm, stride_hsm, stride_hsg, stride_xsm,
                         stride_xsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (_producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, expert_of_block_ptr, num_tiles, num_k,
                         grid_m, grid_n, N, GROUP)),
        ], [4, 1], [CONSUMER_REGS, 24])
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))

    def box_layout():
        """The shared layout of every TMA box here, x's and w13's [64, 128] (128-byte swizzle)."""
        return gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.float8e4nv)


def unsupported_reason(x_q_TH: torch.Tensor) -> str | None:
    """None when this kernel can run on x's device (Gluon, a Hopper GPU), else why not."""
    return fgw.unsupported_reason(x_q_TH)


def serves(x_q_TH: torch.Tensor, w13_E2IH: torch.Tensor, block_m: int) -> bool:
    """Whether `moe_up_fp8_ws` takes this launch: FP8 x, 128-row blocks, H and I multiples of 128,
    a Hopper GPU with Gluon. gemm._moe_up runs the Triton kernel otherwise."""
    hid, two_i = w13_E2IH.shape[2], w13_E2IH.shape[1]
    return (x_q_TH.dtype == FP8_DTYPE and block_m == BLOCK_M and hid % BLOCK_K == 0 and two_i % (2 * BLOCK) == 0
            and unsupported_reason(x_q_TH) is None)


def _check(x_q_TH, x_scale_TG, w13_E2IH, w13_scale, al: MoeAlignment, top_k: int) -> None:
    fn = "moe_up_fp8_ws"
    if al.block_m != BLOCK_M:
        raise ValueError(f"{fn}: the alignment's block_m is {al.block_m}, expected {BLOCK_M} (one tile of slots "
                         f"is one aligned block; gemm._moe_up runs other block_m)")
    if x_q_TH.dtype != FP8_DTYPE or w13_E2IH.dtype != FP8_DTYPE:
        raise ValueError(f"{fn}: x_q and w13 must be {FP8_DTYPE}, got {x_q_TH.dtype}, {w13_E2IH.dtype}")
    if x_scale_TG.dtype != torch.float32 or w13_scale.dtype != torch.float32:
        raise ValueError(f"{fn}: scales must be float32, got {x_scale_TG.dtype}, {w13_scale.dtype}")
    t, hid = x_q_TH.shape
    e, two_i, w_hid = w13_E2IH.shape
    if hid % BLOCK or two_i % (2 * BLOCK) or w_hid != hid:
        raise ValueError(f"{fn}: x [T, H] = {tuple(x_q_TH.shape)} and w13 [E, 2I, H] = {tuple(w13_E2IH.shape)}: "
                         f"expected the same H, H and I multiples of 128")
    if tuple(x_scale_TG.shape) != (t, hid // BLOCK) or tuple(w13_scale.shape) != (e, two_i // BLOCK, hid // BLOCK):
        raise ValueError(f"{fn}: x scale {tuple(x_scale_TG.shape)} and w13 scale {tuple(w13_scale.shape)}: expected "
                         f"{(t, hid // BLOCK)} and {(e, two_i // BLOCK, hid // BLOCK)}")
    if t * top_k != al.num_pairs:
        raise ValueError(f"{fn}: {t} tokens x top_k {top_k} = {t * top_k} pairs, the alignment has {al.num_pairs}")


@typed
def moe_up_fp8_ws(
    x_q_TH: Float[Tensor, "T H"], x_scale_TG: Float[Tensor, "T Hb"], w13_E2IH: Float[Tensor, "E I2 H"],
    w13_scale: Float[Tensor, "E I2b Hb"], al: MoeAlignment, top_k: int,
) -> tuple[Float[Tensor, "M I"], Float[Tensor, "M Ib"]]:
    """(h_q_MI fp8, hs_MIb fp32 stored [Ib, M]) of silu(gate) * up per slot (the module docstring).
    ValueError for block_m != 128, shapes, dtypes, or a device this kernel cannot serve."""
    _check(x_q_TH, x_scale_TG, w13_E2IH, w13_scale, al, top_k)
    reason = unsupported_reason(x_q_TH)
    if reason is not None:
        raise ValueError(f"moe_up_fp8_ws: unsupported call: {reason}")
    m, dev = al.sorted_ids_M.numel(), x_q_TH.device
    num_experts, two_i, hid = w13_E2IH.shape
    inter = two_i // 2
    h_q_MI = torch.empty(m, inter, dtype=FP8_DTYPE, device=dev)
    hs_MIb = torch.empty(inter // BLOCK, m, dtype=torch.float32, device=dev).t()
    if m == 0:
        return h_q_MI, hs_MIb
    x_MH, xs_MHb = gather_slots(x_q_TH, x_scale_TG, al, top_k)
    w13_RH = tma_ready(w13_E2IH.reshape(num_experts * two_i, hid))  # rows e*2I + n: gate, e*2I + I + n: up
    layout = box_layout()
    x_desc = TensorDescriptor(x_MH, [m, hid], list(x_MH.stride()), [HALF_M, BLOCK_K], layout)
    w_desc = TensorDescriptor(w13_RH, list(w13_RH.shape), list(w13_RH.stride()), [HALF_N, BLOCK_K], layout)
    tiles = (m // BLOCK_M) * (inter // BLOCK_N)  # upper bound: the used blocks are known on the device only
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    _moe_up_ws_kernel[(max(1, min(tiles, sms)),)](
        x_desc, w_desc, h_q_MI, hs_MIb, xs_MHb, w13_scale, al.expert_of_block_NB, al.num_tokens_post_pad_1, inter,
        hid, h_q_MI.stride(0), *hs_MIb.stride(), *xs_MHb.stride(), *w13_scale.stride(),
        NS=STAGES, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return h_q_MI, hs_MIb
