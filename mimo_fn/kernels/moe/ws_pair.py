"""What the warp-specialised FP8 MoE GEMMs (up_ws.py, down_ws.py) share: a producer that loads two
weight boxes a K step, and a consumer K loop that runs their two MMAs into one partial.

Legend: S ring stages, HM = 64 slots a consumer warpgroup, BN columns a weight box, BK the K step,
M padded slots (align.py's 128-row blocks, one expert each), E experts.

A tile is one aligned block of 2 x HM slots times the columns of two weight boxes: the up GEMM's
gate and up rows of 128 h columns (box 2 at I rows from box 1), the down GEMM's two 128-column
halves of a 256-column tile (box 2 at 128 rows). Each K step's stage holds the block's two x / h
boxes [HM, BK] (one per consumer warpgroup) and the two weight boxes [BN, BK].

Promotion (DeepGEMM's scheme): per K step each consumer warpgroup runs box 1's m64nBNk32 wgmma
chain into one fp32 partial, waits, adds it scaled (its rows' activation scale times box 1's
128 x 128 weight block scale), then the same for box 2 into the same partial registers. While one
warpgroup scales, the tensor cores run the other's MMAs. A wait with nothing pending that takes the
sum pins each scaling before the next MMA: without it ptxas overlaps the two with a second partial's
registers (64 a thread more than the 232 a consumer has) and spills.
"""

from mimo_fn.kernels.ws_common import HAS_GLUON

if HAS_GLUON:
    from mimo_fn.kernels.ws_common import gl, gluon, mbarrier, tile_coords, tma_load, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def scale_ptrs(a_ptr, ws_ptr, expert_of_block_ptr, tile, num_tiles, grid_m, grid_n, wg, stride_am, stride_wse,
                   stride_wsn_tile, HM: gl.constexpr, rows_layout: gl.constexpr, GROUP: gl.constexpr):
        """Tile `tile`'s scale pointers at K group 0 for warpgroup wg: (its rows' activation scales, box 1's
        weight block scale; stride_wsn_tile: the weight scales' stride from one column tile to the next).
        tile is clamped to a used one, or to tile 0 of expert 0 where none is used (a program with no tile
        loads these once): every load stays in bounds."""
        pid_m, pid_n = tile_coords(gl.maximum(gl.minimum(tile, num_tiles - 1), 0), grid_m, grid_n, GROUP)
        slots = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=rows_layout)
        return (a_ptr + slots * stride_am,
                ws_ptr + gl.maximum(gl.load(expert_of_block_ptr + pid_m), 0) * stride_wse + pid_n * stride_wsn_tile)

    @gluon.jit
    def pair_producer(a_desc, w_desc, a_smem, b_smem, ready, empty, expert_of_block_ptr, num_tiles, num_k, grid_m,
                      grid_n, expert_rows, tile_n, second, GROUP: gl.constexpr):
        # a_smem [2 * S, HM, BK]: stage s's slots 0-63, then 64-127; b_smem [2 * S, BN, BK]: stage s's first
        # weight box, then its second. The weights viewed as [E * expert_rows, K]: column tile n's first box
        # starts at row e * expert_rows + n * tile_n, its second `second` rows on.
        NS: gl.constexpr = b_smem.type.shape[0] // 2
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        BK: gl.constexpr = b_smem.type.shape[2]
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP)
            row = gl.load(expert_of_block_ptr + pid_m) * expert_rows + pid_n * tile_n
            for kb in range(num_k):
                s = it % NS
                mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)  # phase 1 passes on a fresh barrier
                bar = ready.index(s)
                mbarrier.expect(bar, (2 * HM + 2 * BN) * BK)  # fp8: one byte an element
                tma_load(a_desc, [pid_m * 2 * HM, kb * BK], bar, a_smem.index(2 * s))
                tma_load(a_desc, [pid_m * 2 * HM + HM, kb * BK], bar, a_smem.index(2 * s + 1))
                tma_load(w_desc, [row, kb * BK], bar, b_smem.index(2 * s))
                tma_load(w_desc, [row + second, kb * BK], bar, b_smem.index(2 * s + 1))
                it += 1

    @gluon.jit
    def step_scales(a_rows, ws_1, ws_2, kb, stride_ag, stride_wsk):
        """K step kb's (activation scale x box 1's weight block scale, x box 2's) per row. Every row is
        read: a padding slot's scale is in bounds, and its row is never stored."""
        a_s = gl.load(a_rows + kb * stride_ag)
        return a_s * gl.load(ws_1 + kb * stride_wsk), a_s * gl.load(ws_2 + kb * stride_wsk)

    @gluon.jit
    def pair_k_loop(a_smem, b_smem, ready, empty, wg, it, a_rows, ws_1, ws_2, s_1, s_2, a_next, ws_1_next,
                    ws_2_next, num_k, stride_ag, stride_wsk, acc_layout: gl.constexpr):
        """A tile's K loop over ring slots it .. it + num_k - 1 (the module docstring): (box 1's accumulator
        [HM, BN], box 2's, the next tile's first scales, the next ring slot). a_rows: this warpgroup's rows'
        activation scales at K group 0; ws_1 / ws_2: the two boxes' weight block scales at K group 0;
        (s_1, s_2): step 0's scales (`step_scales`); a_next, ws_1_next, ws_2_next: the same pointers for the
        program's next tile, whose first scales load under the last step's MMA, so that no tile but the
        first waits for a load before its first scaling."""
        NS: gl.constexpr = b_smem.type.shape[0] // 2
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        part = gl.zeros([HM, BN], gl.float32, layout=acc_layout)  # dead between tiles: no registers held
        acc_1 = gl.zeros_like(part)
        acc_2 = gl.zeros_like(part)
        for kb in range(num_k):
            s = it % NS
            mbarrier.wait(ready.index(s), (it // NS) & 1)
            a = a_smem.index(2 * s + wg)
            part = warpgroup_mma(a, b_smem.index(2 * s).permute((1, 0)), part, use_acc=False, is_async=True)
            # the next step's scales load under the MMA (after the last step: the next tile's first)
            if kb + 1 < num_k:
                n_1, n_2 = step_scales(a_rows, ws_1, ws_2, kb + 1, stride_ag, stride_wsk)
            else:
                n_1, n_2 = step_scales(a_next, ws_1_next, ws_2_next, 0, stride_ag, stride_wsk)
            part = warpgroup_mma_wait(0, deps=(part,))
            acc_1 = acc_1 + part * s_1[:, None]
            acc_1 = warpgroup_mma_wait(0, deps=(acc_1,))  # pins the scaling before the next MMA
            part = warpgroup_mma(a, b_smem.index(2 * s + 1).permute((1, 0)), part, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            mbarrier.arrive(empty.index(s), count=1)  # this warpgroup is done with stage s
            acc_2 = acc_2 + part * s_2[:, None]
            acc_2 = warpgroup_mma_wait(0, deps=(acc_2,))  # the same before the next step's first MMA
            s_1, s_2 = n_1, n_2
            it += 1
        return acc_1, acc_2, s_1, s_2, it
