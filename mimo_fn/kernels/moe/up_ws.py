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
tokens on an H200). Launches here, no host sync:
1. x into slot order (slots.py; TMA on Hopper copies boxes, not row lists): the layer's x quantised
   straight into it (`slots.quant_fp8_slots`, where x comes unquantised), or x's FP8 rows and scales
   copied (`slots.gather_slots`). Padding slots hold zero codes and scale 0 (finite h = 0).
2. the GEMM (ws_pair.py's producer and K loop): a tile is one aligned block of 128 slots (one
   expert) times 128 columns of h (one quantisation group). Per K step a producer warp TMA-loads
   the block's two 64-row x boxes and w13's gate rows e*2I + n.. and up rows e*2I + I + n..
   (128 x 128 each); two consumer warpgroups of 64 slots each run the gate's MMA into one partial,
   add it scaled (the rows' x scale times the gate's weight block scale), then the up's into the
   same registers: DeepGEMM's promotion scheme, each warpgroup's MMAs running while the other
   scales. Registers: the gate and up accumulators [64, 128] and the partial, 192 fp32 a thread.
   Epilogue: h = silu(g) * u in fp32, quantised with the row's amax over the tile's 128 columns
   (quantize_fp8_act_ref's arithmetic) into h_q and hs, stored through shared memory by TMA. h
   never goes through memory in bf16.

Determinism: no split-K, one K order for every row, rows independent (the MMAs, the scales, the
quantiser's groups): a pair's h row has the same bits whichever slot, block or token count it
comes with (tests/test_moe_up_ws.py checks on the GPU). The bits are not the Triton kernel's (another
MMA shape and promotion order), so deterministic mode never runs this.
Gluon has no interpreter: tests compile the GEMM for sm_90 on the CPU and run its numerics on a GPU.
"""

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels import fp8_gemm_ws as fgw
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.kernels.moe.slots import gather_slots, quant_fp8_slots
from mimo_fn.kernels.ws_common import tma_ready
from mimo_fn.quant import BLOCK, FP8_DTYPE

HAS_GLUON = fgw.HAS_GLUON
HALF_M = fgw.HALF_M  # slots a consumer warpgroup: one wgmma M tile
BLOCK_M = fgw.BLOCK_M  # 128 slots: one aligned block
BLOCK_N = BLOCK  # columns of h a tile: one 1x128 quantisation group (its gate and up rows: 2 x 128)
BLOCK_K = BLOCK  # one x scale group and one weight block column a K step
STAGES = 4  # a stage: x 128 x 128 + gate and up 2 x 128 x 128 fp8 = 48 KB; 4 stages: 192 of 227 KB
GROUP_M = fgw.GROUP_M
# fused_moe_fp8 takes this kernel by default from this many pairs per expert on (256 experts, top 8:
# 32K tokens); at half of it the layer with the Triton up GEMM measured faster (docs/benchmarks.md)
MIN_PAIRS_PER_EXPERT = 1024
# fp8_gemm_ws's register split: 12 warps x 32 x 168; the producer drops to 24 a thread, the second
# consumer takes 232, the first what is left. A consumer holds the gate and up accumulators and one
# partial, 192 fp32 a thread (ptxas: no spills).
MAX_REGS, CONSUMER_REGS = fgw.MAX_REGS, fgw.CONSUMER_REGS


if HAS_GLUON:
    from mimo_fn.kernels.moe.ws_pair import pair_k_loop, pair_producer, scale_ptrs, step_scales
    from mimo_fn.kernels.ws_common import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier,
                                           partition_barrier, tma_store, tma_store_wait)
    from mimo_fn.kernels.ws_common import tile_coords as _tile_coords

    @gluon.jit
    def _consumer(hq_desc, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem, ready, empty, wg,
                  num_tiles, num_k, grid_m, grid_n, N, stride_hsm, stride_hsg, stride_xsm, stride_xsg,
                  stride_wse, stride_wsn, stride_wsk, acc_layout: gl.constexpr, GROUP: gl.constexpr):
        # Slots wg * 64 .. wg * 64 + 63 of each of this program's blocks, h columns pid_n * 128 .. + 127:
        # one 1x128 quantisation group, so h is quantised straight from the registers, then leaves through
        # h_smem [HM, BN] and a TMA store (a pointer per element would take 64 more registers and spill).
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        it = 0
        step = gl.num_programs(0)
        xs_rows, ws_g = scale_ptrs(xs_ptr, ws_ptr, expert_of_block_ptr, gl.program_id(0), num_tiles,
                                   grid_m, grid_n, wg, stride_xsm, stride_wse, stride_wsn, HM, rows_layout, GROUP)
        ws_up = (N // 128) * stride_wsn  # a tile's up columns' weight blocks: I / 128 blocks after its gate's
        s_g, s_u = step_scales(xs_rows, ws_g, ws_g + ws_up, 0, stride_xsg, stride_wsk)
        for tile in range(gl.program_id(0), num_tiles, step):
            pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
            slots = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=rows_layout)
            xs_next, ws_next = scale_ptrs(xs_ptr, ws_ptr, expert_of_block_ptr, tile + step, num_tiles, grid_m,
                                          grid_n, wg, stride_xsm, stride_wse, stride_wsn, HM, rows_layout, GROUP)
            acc_g, acc_u, s_g, s_u, it = pair_k_loop(a_smem, b_smem, ready, empty, wg, it, xs_rows, ws_g, ws_g + ws_up,
                                                     s_g, s_u, xs_next, ws_next, ws_next + ws_up, num_k, stride_xsg,
                                                     stride_wsk, acc_layout)
            xs_rows, ws_g = xs_next, ws_next
            h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u  # silu(g) * u in fp32 (padding slots: 0)
            # quantise_fp8_act_ref's arithmetic: IEEE divisions, clamp, round to nearest even
            scale = gl.div_rn(gl.maximum(gl.max(gl.abs(h), axis=1), 1e-10), 448.0)
            q = gl.minimum(gl.maximum(gl.div_rn(h, scale[:, None]), -448.0), 448.0)
            tma_store_wait(0)  # the last tile's store has read h_smem
            partition_barrier()
            h_smem.store(q.to(h_smem.dtype))
            fence_async_shared()  # generic-proxy writes before the TMA's async-proxy read
            partition_barrier()
            tma_store(hq_desc, [pid_m * 2 * HM + wg * HM, pid_n * BN], h_smem)
            gl.store(hs_ptr + slots * stride_hsm + pid_n * stride_hsg, scale)
        tma_store_wait(0)

    @gluon.jit
    def _moe_up_ws_kernel(x_desc, w_desc, hq_desc, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, num_post_pad_ptr, N,
                          K, stride_hsm, stride_hsg, stride_xsm, stride_xsg, stride_wse, stride_wsn,
                          stride_wsk, NS: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
        """Persistent grid (at most one program per SM) over the used blocks x I / 128 column tiles."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        grid_m = gl.cdiv(gl.load(num_post_pad_ptr), 2 * HM)  # used blocks, written by moe_align on the device
        grid_n = N // BN
        num_tiles = grid_m * grid_n
        num_k = K // BK
        a_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * NS, HM, BK], x_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [2 * NS, BN, BK], w_desc.layout)
        h_smem = gl.allocate_shared_memory(hq_desc.dtype, [2, HM, BN], hq_desc.layout)  # a consumer's h tile each
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumer warpgroups release a stage
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BN, 32])
        # the argument tuples stay inline: a constexpr (a layout) survives only there
        gl.warp_specialize([
            (_consumer, (hq_desc, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem.index(0),
                         ready, empty, 0, num_tiles, num_k, grid_m, grid_n, N, stride_hsm, stride_hsg, stride_xsm,
                         stride_xsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (_consumer, (hq_desc, hs_ptr, xs_ptr, ws_ptr, expert_of_block_ptr, a_smem, b_smem, h_smem.index(1),
                         ready, empty, 1, num_tiles, num_k, grid_m, grid_n, N, stride_hsm, stride_hsg, stride_xsm,
                         stride_xsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (pair_producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, expert_of_block_ptr, num_tiles, num_k,
                             grid_m, grid_n, 2 * N, BN, N, GROUP)),  # w13 as [E * 2I, H]: gate rows, up rows I on
        ], [4, 1], [CONSUMER_REGS, 24])
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))

    def box_layouts():
        """The shared layouts of the TMA boxes: x's [64, 128] and w13's [128, 128] (128-byte swizzle)."""
        return (gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.float8e4nv),
                gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv))


def unsupported_reason(x_q_TH: torch.Tensor) -> str | None:
    """None when this kernel can run on x's device (Gluon, a Hopper GPU), else why not."""
    return fgw.unsupported_reason(x_q_TH)


def serves(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, block_m: int) -> bool:
    """Whether `moe_up_fp8_ws` takes this launch: FP8 weights, x FP8 or unquantised (bf16 / fp16 /
    fp32), 128-row blocks, H and I multiples of 128, a Hopper GPU with Gluon. gemm.py runs the
    Triton kernel otherwise."""
    hid, two_i = w13_E2IH.shape[2], w13_E2IH.shape[1]
    return (x_TH.dtype in (FP8_DTYPE, torch.bfloat16, torch.float16, torch.float32) and w13_E2IH.dtype == FP8_DTYPE
            and block_m == BLOCK_M and hid % BLOCK_K == 0 and two_i % (2 * BLOCK) == 0
            and unsupported_reason(x_TH) is None)


def _check(x_TH, x_scale_TG, w13_E2IH, w13_scale, al: MoeAlignment, top_k: int) -> None:
    fn = "moe_up_fp8_ws"
    if al.block_m != BLOCK_M:
        raise ValueError(f"{fn}: the alignment's block_m is {al.block_m}, expected {BLOCK_M} (one tile of slots "
                         f"is one aligned block; gemm._moe_up runs other block_m)")
    if w13_E2IH.dtype != FP8_DTYPE or (x_TH.dtype == FP8_DTYPE) != (x_scale_TG is not None):
        raise ValueError(f"{fn}: w13 must be {FP8_DTYPE} and x either {FP8_DTYPE} with its scales or unquantised "
                         f"without, got w13 {w13_E2IH.dtype}, x {x_TH.dtype}, scales "
                         f"{'given' if x_scale_TG is not None else 'None'}")
    if w13_scale.dtype != torch.float32 or x_scale_TG is not None and x_scale_TG.dtype != torch.float32:
        raise ValueError(f"{fn}: scales must be float32, got {getattr(x_scale_TG, 'dtype', None)}, {w13_scale.dtype}")
    t, hid = x_TH.shape
    e, two_i, w_hid = w13_E2IH.shape
    if hid % BLOCK or two_i % (2 * BLOCK) or w_hid != hid:
        raise ValueError(f"{fn}: x [T, H] = {tuple(x_TH.shape)} and w13 [E, 2I, H] = {tuple(w13_E2IH.shape)}: "
                         f"expected the same H, H and I multiples of 128")
    x_scale_shape = None if x_scale_TG is None else tuple(x_scale_TG.shape)
    if x_scale_shape not in (None, (t, hid // BLOCK)) or tuple(w13_scale.shape) != (e, two_i // BLOCK, hid // BLOCK):
        raise ValueError(f"{fn}: x scale {x_scale_shape} and w13 scale {tuple(w13_scale.shape)}: expected "
                         f"{(t, hid // BLOCK)} and {(e, two_i // BLOCK, hid // BLOCK)}")
    if t * top_k != al.num_pairs:
        raise ValueError(f"{fn}: {t} tokens x top_k {top_k} = {t * top_k} pairs, the alignment has {al.num_pairs}")


@typed
def moe_up_fp8_ws(
    x_TH: Float[Tensor, "T H"], x_scale_TG: Float[Tensor, "T Hb"] | None, w13_E2IH: Float[Tensor, "E I2 H"],
    w13_scale: Float[Tensor, "E I2b Hb"], al: MoeAlignment, top_k: int,
) -> tuple[Float[Tensor, "M I"], Float[Tensor, "M Ib"]]:
    """(h_q_MI fp8, hs_MIb fp32 stored [Ib, M]) of silu(gate) * up per slot (the module docstring).
    x_TH: FP8 with its 1x128 scales x_scale_TG (gathered into slot order), or the layer's unquantised
    x with x_scale_TG None (quantised straight into slot order: the same bits).
    ValueError for block_m != 128, shapes, dtypes, or a device this kernel cannot serve."""
    _check(x_TH, x_scale_TG, w13_E2IH, w13_scale, al, top_k)
    reason = unsupported_reason(x_TH)
    if reason is not None:
        raise ValueError(f"moe_up_fp8_ws: unsupported call: {reason}")
    m, dev = al.sorted_ids_M.numel(), x_TH.device
    num_experts, two_i, hid = w13_E2IH.shape
    inter = two_i // 2
    h_q_MI = torch.empty(m, inter, dtype=FP8_DTYPE, device=dev)
    hs_MIb = torch.empty(inter // BLOCK, m, dtype=torch.float32, device=dev).t()
    if m == 0:
        return h_q_MI, hs_MIb
    if x_scale_TG is None:
        x_MH, xs_MHb = quant_fp8_slots(x_TH, al, top_k)
    else:
        x_MH, xs_MHb = gather_slots(x_TH, x_scale_TG, al, top_k)
    w13_RH = tma_ready(w13_E2IH.reshape(num_experts * two_i, hid))  # rows e*2I + n: gate, e*2I + I + n: up
    x_layout, w_layout = box_layouts()
    x_desc = TensorDescriptor(x_MH, [m, hid], list(x_MH.stride()), [HALF_M, BLOCK_K], x_layout)
    hq_desc = TensorDescriptor(h_q_MI, [m, inter], list(h_q_MI.stride()), [HALF_M, BLOCK_N], x_layout)
    w_desc = TensorDescriptor(w13_RH, list(w13_RH.shape), list(w13_RH.stride()), [BLOCK_N, BLOCK_K], w_layout)
    tiles = (m // BLOCK_M) * (inter // BLOCK_N)  # upper bound: the used blocks are known on the device only
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    _moe_up_ws_kernel[(max(1, min(tiles, sms)),)](
        x_desc, w_desc, hq_desc, hs_MIb, xs_MHb, w13_scale, al.expert_of_block_NB, al.num_tokens_post_pad_1, inter,
        hid, *hs_MIb.stride(), *xs_MHb.stride(), *w13_scale.stride(),
        NS=STAGES, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return h_q_MI, hs_MIb
