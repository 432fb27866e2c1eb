"""The FP8 MoE down GEMM, warp-specialised for Hopper (sm_90) in Gluon: `moe_down_fp8_ws`.

Legend: T tokens, K experts per token, P = T*K (token, k) pairs, E experts, H hidden (the output
features), I expert intermediate (the reduction), M padded slots of align.py's layout (128-row
blocks), Hb / Ib = H / 128, I / 128 weight blocks, S ring stages.

Same contract as gemm.py's `_moe_down` for FP8: y[p] = w_p * (dequant(h[s]) @ dequant(W2[e]).T)
for the pair p = sorted_ids[s] of slot s, e = the expert of s's block; y_PH [P, H]; rows of padding
slots and of dropped pairs are not written.

Why: the Triton down kernel (gemm_kernels._down_tile) waits for each 128-deep K step's wgmma before
its fp32 partial is scaled and added, so the tensor cores idle on the scaling (741 TFLOP/s at 64K
tokens on an H200, cuBLASLt's block-scaled GEMM 950-1,220). up_ws.py's design over the aligned slots:
- a tile is one aligned block of 128 slots (one expert: align.py pads each expert's segment to
  whole blocks) times 256 output columns, two halves of 128 (one w2 block row each); the used
  block count is on the device (num_tokens_post_pad), so the persistent programs read it and
  walk tiles pid, pid + grid, ...; no host sync;
- ws_pair.py's producer and K loop: per K step a producer warp TMA-loads the h tile (two 64-row
  boxes of h, in slot order, [M, I]) and the two weight boxes (w2 viewed as [E*H, I], rows
  e*H + n*256 and 128 on); two consumer warpgroups of 64 rows each run the left half's MMA into one
  fp32 partial, add it scaled (h's row scales of the K group, the weight block's scale), then the
  right half's into the same registers. The epilogue multiplies each row by its pair's routing
  weight and scatters it to row p of y. 256-column tiles read each h tile from L2 half as often as
  128-column ones.

Determinism: no split-K, one K order for every row, rows independent: a pair's row has the same bits
whichever slot, block or token count it comes with (tests/test_moe_down_ws.py checks on the GPU).
The bits are not the Triton kernel's (another MMA shape and promotion order), so deterministic mode
never runs this kernel (gemm._moe_down).

Padding slots: whole blocks are computed, so a padding row reads whatever h and its scales hold
there (the up GEMM's HALF_TAILS leaves them unwritten); rows do not mix in an MMA, and its store is
masked.
Gluon has no interpreter: tests compile it for sm_90 on the CPU and run its numerics on a GPU only.
"""

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels import fp8_gemm_ws as fgw
from mimo_fn.kernels.ws_common import tma_ready
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.quant import BLOCK, FP8_DTYPE

HAS_GLUON = fgw.HAS_GLUON
BLOCK_M = fgw.BLOCK_M  # 128 slots: one aligned block, two 64-row consumer halves
HALF_N = BLOCK  # output columns a half tile: one w2 block row, one m64n128 MMA
BLOCK_N = 2 * HALF_N  # output columns a tile
BLOCK_K, GROUP_M = fgw.BLOCK_K, fgw.GROUP_M
STAGES = 4  # a stage: h 128 x 128 + w2 256 x 128 fp8 = 48 KB; 4 stages: 192 of 227 KB
# fp8_gemm_ws's register split: 12 warps x 32 x 168; the producer drops to 24, the consumers take
# 232 / what is left. A consumer holds two accumulators [64, 128] and one partial: 192 a thread.
MAX_REGS, CONSUMER_REGS = fgw.MAX_REGS, fgw.CONSUMER_REGS

if HAS_GLUON:
    from mimo_fn.kernels.moe.ws_pair import pair_k_loop, pair_producer, scale_ptrs, step_scales
    from mimo_fn.kernels.ws_common import TensorDescriptor, gl, gluon, mbarrier
    from mimo_fn.kernels.ws_common import tile_coords as _tile_coords

    @gluon.jit
    def _consumer(y_ptr, hs_ptr, ws_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr, a_smem, b_smem,
                  ready, empty, wg, num_pairs, num_tiles, num_k, grid_m, grid_n,
                  stride_yp, stride_hsm, stride_hsg, stride_wse, stride_wsn, stride_wsk,
                  acc_layout: gl.constexpr, GROUP: gl.constexpr):
        # Slots wg * 64 .. wg * 64 + 63 of each of this program's blocks, output columns pid_n * 256 ..
        # + 255 as two halves of 128 (each its own w2 block row, so its own scale). Every slot's h scales
        # are read (ws_pair.step_scales): a padding row's are in bounds, and the row is never stored.
        HM: gl.constexpr = a_smem.type.shape[1]
        HN: gl.constexpr = b_smem.type.shape[1]
        rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        # the MMA layout gives a thread 4-byte pieces of 8 rows; this one 16 bytes of one row (8 columns)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // HN, HN // 8], [4, 1], [1, 0])
        out_rows: gl.constexpr = gl.SliceLayout(1, out_layout)
        out_cols = gl.arange(0, HN, layout=gl.SliceLayout(0, out_layout))
        it = 0
        step = gl.num_programs(0)
        hs_rows, ws_l = scale_ptrs(hs_ptr, ws_ptr, expert_of_block_ptr, gl.program_id(0), num_tiles,
                                   grid_m, grid_n, wg, stride_hsm, stride_wse, 2 * stride_wsn, HM, rows_layout, GROUP)
        s_l, s_r = step_scales(hs_rows, ws_l, ws_l + stride_wsn, 0, stride_hsg, stride_wsk)
        for tile in range(gl.program_id(0), num_tiles, step):
            pid_m, pid_n = _tile_coords(tile, grid_m, grid_n, GROUP)
            slots = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=rows_layout)
            pair = gl.load(sorted_ids_ptr + slots)  # P marks a padding slot
            row_ok = pair < num_pairs
            # the epilogue's routing weights and the next tile's scale pointers load under the K loop
            route = gl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(gl.float32)
            hs_next, ws_next = scale_ptrs(hs_ptr, ws_ptr, expert_of_block_ptr, tile + step, num_tiles, grid_m,
                                          grid_n, wg, stride_hsm, stride_wse, 2 * stride_wsn, HM, rows_layout, GROUP)
            acc_l, acc_r, s_l, s_r, it = pair_k_loop(a_smem, b_smem, ready, empty, wg, it, hs_rows, ws_l,
                                                     ws_l + stride_wsn, s_l, s_r, hs_next, ws_next,
                                                     ws_next + stride_wsn, num_k, stride_hsg, stride_wsk, acc_layout)
            hs_rows, ws_l = hs_next, ws_next
            # epilogue: the routing weight in the MMA layout, then each half to row `pair` of y through
            # out_layout (a shared-memory round trip), where a warp stores 512 contiguous bytes an instruction
            pair_o = gl.load(sorted_ids_ptr + pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=out_rows))
            out = y_ptr + pair_o.to(gl.int64)[:, None] * stride_yp + (pid_n * 2 * HN + out_cols)[None, :]
            ok = (pair_o < num_pairs)[:, None]
            gl.store(out, gl.convert_layout((acc_l * route[:, None]).to(y_ptr.dtype.element_ty), out_layout), mask=ok)
            gl.store(out + HN, gl.convert_layout((acc_r * route[:, None]).to(y_ptr.dtype.element_ty), out_layout),
                     mask=ok)

    @gluon.jit
    def _moe_down_ws_kernel(h_desc, w_desc, y_ptr, hs_ptr, ws_ptr, topk_w_ptr, sorted_ids_ptr,
                            expert_of_block_ptr, num_post_pad_ptr, num_pairs, N, K,
                            stride_yp, stride_hsm, stride_hsg, stride_wse, stride_wsn, stride_wsk,
                            NS: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
        """Persistent grid (at most one program per SM) over the used blocks x N / 256 column tiles."""
        BK: gl.constexpr = h_desc.block_type.shape[1]
        HM: gl.constexpr = h_desc.block_type.shape[0]
        HN: gl.constexpr = w_desc.block_type.shape[0]
        grid_m = gl.cdiv(gl.load(num_post_pad_ptr), 2 * HM)  # used blocks, written by moe_align on the device
        grid_n = N // (2 * HN)
        num_tiles = grid_m * grid_n
        num_k = K // BK
        a_smem = gl.allocate_shared_memory(h_desc.dtype, [2 * NS, HM, BK], h_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [2 * NS, HN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumer warpgroups release a stage
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HN, 32])
        # the argument tuples stay inline: a constexpr (a layout) survives only there
        gl.warp_specialize([
            (_consumer, (y_ptr, hs_ptr, ws_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr, a_smem, b_smem,
                         ready, empty, 0, num_pairs, num_tiles, num_k, grid_m, grid_n, stride_yp, stride_hsm,
                         stride_hsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (_consumer, (y_ptr, hs_ptr, ws_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr, a_smem, b_smem,
                         ready, empty, 1, num_pairs, num_tiles, num_k, grid_m, grid_n, stride_yp, stride_hsm,
                         stride_hsg, stride_wse, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (pair_producer, (h_desc, w_desc, a_smem, b_smem, ready, empty, expert_of_block_ptr, num_tiles, num_k,
                             grid_m, grid_n, N, 2 * HN, HN, GROUP)),  # w2 as [E * H, I]: the tile's halves
        ], [4, 1], [CONSUMER_REGS, 24])
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))


def unsupported_reason(h_q_MI: torch.Tensor) -> str | None:
    """None when this kernel can run on h's device (Gluon, a Hopper GPU), else why not."""
    return fgw.unsupported_reason(h_q_MI)


def serves(h_q_MI: torch.Tensor, w2_EHI: torch.Tensor, block_m: int) -> bool:
    """Whether `moe_down_fp8_ws` takes this launch: FP8 h, 128-row blocks, H a multiple of 256 and I
    of 128, a Hopper GPU with Gluon. gemm._moe_down runs the Triton kernel otherwise."""
    hid, inter = w2_EHI.shape[1], w2_EHI.shape[2]
    return (h_q_MI.dtype == FP8_DTYPE and block_m == BLOCK_M and hid % BLOCK_N == 0 and inter % BLOCK_K == 0
            and unsupported_reason(h_q_MI) is None)


def _check(h_q_MI, h_scale_MIb, w2_EHI, w2_scale, al: MoeAlignment, topk_weights_TK) -> None:
    fn = "moe_down_fp8_ws"
    if al.block_m != BLOCK_M:
        raise ValueError(f"{fn}: the alignment's block_m is {al.block_m}, expected {BLOCK_M} (one tile of slots "
                         f"is one aligned block; gemm._moe_down runs other block_m)")
    if h_q_MI.dtype != FP8_DTYPE or w2_EHI.dtype != FP8_DTYPE:
        raise ValueError(f"{fn}: h_q and w2 must be {FP8_DTYPE}, got {h_q_MI.dtype}, {w2_EHI.dtype}")
    if h_scale_MIb.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        raise ValueError(f"{fn}: scales must be float32, got {h_scale_MIb.dtype}, {w2_scale.dtype}")
    m, inter = h_q_MI.shape
    e, hid, w_inter = w2_EHI.shape
    if hid % BLOCK_N or inter % BLOCK_K or w_inter != inter:
        raise ValueError(f"{fn}: h [M, I] = {tuple(h_q_MI.shape)} and w2 [E, H, I] = {tuple(w2_EHI.shape)}: "
                         f"expected the same I, H a multiple of {BLOCK_N} and I of {BLOCK_K}")
    if m != al.sorted_ids_M.numel():
        raise ValueError(f"{fn}: h has {m} rows, expected one per slot of the alignment ({al.sorted_ids_M.numel()})")
    if tuple(h_scale_MIb.shape) != (m, inter // BLOCK) or tuple(w2_scale.shape) != (e, hid // BLOCK, inter // BLOCK):
        raise ValueError(f"{fn}: h scale {tuple(h_scale_MIb.shape)} and w2 scale {tuple(w2_scale.shape)}: expected "
                         f"{(m, inter // BLOCK)} and {(e, hid // BLOCK, inter // BLOCK)}")
    if topk_weights_TK.numel() != al.num_pairs:
        raise ValueError(f"{fn}: topk_weights has {topk_weights_TK.numel()} entries, expected one per pair "
                         f"({al.num_pairs})")


@typed
def moe_down_fp8_ws(
    h_q_MI: Float[Tensor, "M I"], h_scale_MIb: Float[Tensor, "M Ib"], w2_EHI: Float[Tensor, "E H I"],
    w2_scale: Float[Tensor, "E Hb Ib"], al: MoeAlignment, topk_weights_TK: Float[Tensor, "T K"],
    out_dtype: torch.dtype,
) -> Float[Tensor, "P H"]:
    """y_PH (out_dtype) = routing weight x dequant(h) @ dequant(w2[e]).T per pair (the module docstring).
    ValueError for block_m != 128, shapes, dtypes, or a device this kernel cannot serve."""
    _check(h_q_MI, h_scale_MIb, w2_EHI, w2_scale, al, topk_weights_TK)
    reason = unsupported_reason(h_q_MI)
    if reason is not None:
        raise ValueError(f"moe_down_fp8_ws: unsupported call: {reason}")
    m, inter = h_q_MI.shape
    num_experts, hid = w2_EHI.shape[:2]
    y_PH = torch.empty(al.num_pairs, hid, dtype=out_dtype, device=h_q_MI.device)
    if al.num_pairs == 0:
        return y_PH
    h_q_MI = tma_ready(h_q_MI)
    w2_RI = tma_ready(w2_EHI.reshape(num_experts * hid, inter))  # rows e*H + n: expert e's row n
    h_layout, w_layout = fgw.descriptor_layouts()  # boxes [64, 128] and [128, 128]
    h_desc = TensorDescriptor(h_q_MI, [m, inter], list(h_q_MI.stride()), [fgw.HALF_M, BLOCK_K], h_layout)
    w_desc = TensorDescriptor(w2_RI, list(w2_RI.shape), list(w2_RI.stride()), [HALF_N, BLOCK_K], w_layout)
    weights_P = topk_weights_TK.reshape(-1)
    tiles = (m // BLOCK_M) * (hid // BLOCK_N)  # upper bound: the used blocks are known on the device only
    sms = torch.cuda.get_device_properties(h_q_MI.device).multi_processor_count
    _moe_down_ws_kernel[(max(1, min(tiles, sms)),)](
        h_desc, w_desc, y_PH, h_scale_MIb, w2_scale, weights_P, al.sorted_ids_M, al.expert_of_block_NB,
        al.num_tokens_post_pad_1, al.num_pairs, hid, inter,
        y_PH.stride(0), *h_scale_MIb.stride(), *w2_scale.stride(),
        NS=STAGES, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return y_PH
