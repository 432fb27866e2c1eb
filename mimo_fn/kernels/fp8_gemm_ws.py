"""Warp-specialised FP8 block-scaled GEMM for Hopper (sm_90), written in Gluon.

Legend: T rows (tokens), K input features, N output features, G = K / 128 activation groups,
Nb / Kb = 128x128 weight blocks, S ring stages.

Same contract as `fp8_linear.fp8_linear` (its oracle is `fp8_linear_ref`): x_q [T, K] FP8 e4m3
with one fp32 scale per row and 128-column group [T, G], w [N, K] FP8 with one fp32 scale per
128x128 block [Nb, Kb]; y = dequant(x) @ dequant(w).T in out_dtype.

Why a second kernel: in fp8_linear (plain Triton) each 128-deep K step's wgmma must finish before
its fp32 partial is scaled by the rows' activation scales and the block's weight scale and added
up, so the tensor cores wait on the scaling (500-740 TFLOP/s against cuBLASLt's 950-1,220 on an
H100 / H200). Here a persistent program has three roles with no CTA-wide barrier between them:
- a producer warp streams each K step's x tile (two 64-row boxes) and w tile (128 x 128) through
  TMA into an S-stage ring (a `ready` mbarrier per stage, an `empty` one both consumers arrive on);
- two consumer warpgroups, 64 rows of the 128 x 128 output tile each: step k's wgmma is issued
  asynchronously into a second fp32 partial, then step k-1's partial is waited for (wait_group 1:
  step k stays in flight), scaled and added to the accumulator while step k runs on the tensor
  cores (DeepGEMM's per-block promotion, software-pipelined by one step).
The producer runs ahead across tiles, so the next tile's loads overlap this tile's epilogue.
That the overlap survives ptxas is checked on the CPU: ptxas serialises every wgmma of a kernel
(and says so, C7514 / C7515) when another instruction touches a pending MMA's registers, and the
compile test fails on that report (`_consumer` says how the code avoids it).

Determinism: no split-K and one K order (step 0, 1, ... G-1, each partial scaled then added) for
every row, and a row's arithmetic does not involve the other rows: a row's bits do not depend on T.
The bits are not fp8_linear's (a different instruction shape and promotion order).

Gluon has no CPU interpreter: tests/test_fp8_gemm_ws.py compiles it for sm_90 on any machine and
checks numerics on the GPU only. Deterministic mode's FP8 linears run here on Hopper
(`fp8_linear.ws_serves`); `python -m mimo_fn.bench deterministic --linears --dtypes fp8 --ws`
measures it against scaled_mm and fp8_linear's tiles.
"""

import torch
import triton

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.ws_common import (
    HAS_GLUON, TensorDescriptor, gl, gluon, mbarrier, producer, tile_coords, tma_ready, warpgroup_mma,
    warpgroup_mma_wait)
from mimo_fn.kernels.ws_common import unsupported_reason as _device_reason
from mimo_fn.quant import BLOCK, FP8_DTYPE

HALF_M = 64  # rows per consumer warpgroup: one wgmma M tile
BLOCK_M = 2 * HALF_M  # the output tile's rows: both consumers
BLOCK_N = 128  # one weight-scale block of columns: one w scale per K step
BLOCK_K = BLOCK  # one activation-scale group per K step
STAGES = 4  # ring depth: 4 x (128 + 128) x 128 fp8 = 128 KB of shared memory
GROUP_M = 8  # tiles walk 8 row blocks per column block, so a wave re-reads w tiles from L2
# Registers: 4 + 4 + 1 warps are padded to 12 (whole warpgroups, so each can hand registers back);
# 12 x 32 threads x 168 = 64,512 of the 65,536. The producer drops to 24 a thread, the second
# consumer takes CONSUMER_REGS, the first what is left (248). A consumer holds the accumulator and
# two partials, 3 x 64 fp32 a thread, plus addresses and scales; ptxas reports no spills.
MAX_REGS = 168
CONSUMER_REGS = 232


def unsupported_reason(x_q_TK: torch.Tensor) -> str | None:
    """None when this kernel can run on x_q_TK's device, else why not (shapes: fp8_gemm_ws raises)."""
    return _device_reason(x_q_TK)


if HAS_GLUON:

    @gluon.jit
    def _issue(a_smem, b_smem, ready, it, wg, buf, xs_rows, row_ok, ws_blk, kb, stride_xsg, stride_wsk):
        """Start K step kb (ring slot it) on the tensor cores into buf's registers (their values are not
        read: use_acc=False); returns the pending partial and the step's scales."""
        NS: gl.constexpr = b_smem.type.shape[0]
        s = it % NS
        mbarrier.wait(ready.index(s), (it // NS) & 1)
        part = warpgroup_mma(a_smem.index(2 * s + wg), b_smem.index(s).permute((1, 0)), buf,
                             use_acc=False, is_async=True)
        # the scales load while the MMA runs: one per row (its 128-column group), one for the w block
        a_s = gl.load(xs_rows + kb * stride_xsg, mask=row_ok, other=0.0)
        return part, a_s * gl.load(ws_blk + kb * stride_wsk)

    @gluon.jit
    def _retire(acc, part, scale, empty, it, NS: gl.constexpr, PENDING: gl.constexpr):
        """Wait for a partial (PENDING later MMAs may still run), free its ring slot, add it scaled;
        returns the partial (its registers take a later step's MMA) and the accumulator."""
        done = warpgroup_mma_wait(PENDING, deps=(part,))
        mbarrier.arrive(empty.index(it % NS), count=1)  # this warpgroup is done with that slot
        acc = acc + done * scale[:, None]
        # A wait that returns at once (PENDING or fewer MMAs are in flight here) but takes acc as an
        # operand: it pins the scaling before the next MMA, which reuses done's registers. Without
        # it LLVM sinks the FMAs past that MMA, must copy done aside, and ptxas then serialises
        # every wgmma (C7515).
        acc = warpgroup_mma_wait(PENDING, deps=(acc,))
        return done, acc

    @gluon.jit
    def _consumer(y_ptr, xs_ptr, ws_ptr, a_smem, b_smem, ready, empty, wg, T, num_tiles, num_k, grid_m, grid_n,
                  stride_yt, stride_xst, stride_xsg, stride_wsn, stride_wsk,
                  acc_layout: gl.constexpr, GROUP: gl.constexpr):
        # One warpgroup: rows wg * 64 .. wg * 64 + 63 of each of this program's tiles. Two partials
        # alternate, p0 for even steps and p1 for odd: one is scaled while the other's MMA runs.
        # ptxas serialises every wgmma of the kernel (C7514 / C7515) if any other instruction reads
        # or writes a pending MMA's registers, so nothing is copied or zeroed: each MMA writes the
        # registers of the partial its slot held last (b0 / b1, zeroed once per program, before
        # any MMA), and the loop takes two steps a turn so that p0 is never copied into p1.
        NS: gl.constexpr = b_smem.type.shape[0]
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        b0 = gl.zeros([HM, BN], gl.float32, layout=acc_layout)
        b1 = gl.zeros([HM, BN], gl.float32, layout=acc_layout)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP)
            rows = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
            row_ok = rows < T
            xs_rows = xs_ptr + rows * stride_xst
            ws_blk = ws_ptr + pid_n * stride_wsn  # BN == 128: one weight block of columns
            acc = gl.zeros([HM, BN], gl.float32, layout=acc_layout)
            p0, s0 = _issue(a_smem, b_smem, ready, it, wg, b0, xs_rows, row_ok, ws_blk, 0, stride_xsg, stride_wsk)
            for kb in range(1, num_k - 1, 2):  # steps kb (odd) and kb + 1 (even); p0 holds step kb - 1
                p1, s1 = _issue(a_smem, b_smem, ready, it + 1, wg, b1, xs_rows, row_ok, ws_blk, kb,
                                stride_xsg, stride_wsk)
                b0, acc = _retire(acc, p0, s0, empty, it, NS, 1)
                p0, s0 = _issue(a_smem, b_smem, ready, it + 2, wg, b0, xs_rows, row_ok, ws_blk, kb + 1,
                                stride_xsg, stride_wsk)
                b1, acc = _retire(acc, p1, s1, empty, it + 1, NS, 1)
                it += 2
            if num_k % 2 == 0:  # one odd step left
                p1, s1 = _issue(a_smem, b_smem, ready, it + 1, wg, b1, xs_rows, row_ok, ws_blk, num_k - 1,
                                stride_xsg, stride_wsk)
                b0, acc = _retire(acc, p0, s0, empty, it, NS, 1)
                b1, acc = _retire(acc, p1, s1, empty, it + 1, NS, 0)
                it += 2
            else:
                b0, acc = _retire(acc, p0, s0, empty, it, NS, 0)
                it += 1
            # epilogue: straight from the MMA layout (2 adjacent columns a thread); rows past T are not stored
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            out = y_ptr + rows.to(gl.int64)[:, None] * stride_yt + cols[None, :]
            gl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None])

    @gluon.jit
    def _fp8_gemm_ws_kernel(x_desc, w_desc, y_ptr, xs_ptr, ws_ptr, T, N, K,
                            stride_yt, stride_xst, stride_xsg, stride_wsn, stride_wsk,
                            NS: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                            num_warps: gl.constexpr):
        """Persistent grid (at most one program per SM), each walking tiles pid, pid + grid, ..."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        grid_m = gl.cdiv(T, 2 * HM)
        grid_n = N // BN
        num_tiles = grid_m * grid_n
        num_k = K // BK
        a_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * NS, HM, BK], x_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [NS, BN, BK], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(NS):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)  # both consumer warpgroups release a stage
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BN, 32])
        # the argument tuples stay inline: a constexpr (a layout) survives only there
        gl.warp_specialize([
            (_consumer, (y_ptr, xs_ptr, ws_ptr, a_smem, b_smem, ready, empty, 0, T, num_tiles, num_k, grid_m, grid_n,
                         stride_yt, stride_xst, stride_xsg, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (_consumer, (y_ptr, xs_ptr, ws_ptr, a_smem, b_smem, ready, empty, 1, T, num_tiles, num_k, grid_m, grid_n,
                         stride_yt, stride_xst, stride_xsg, stride_wsn, stride_wsk, acc_layout, GROUP)),
            (producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, num_tiles, num_k, grid_m, grid_n, GROUP)),
        ], [4, 1], [CONSUMER_REGS, 24])
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))


def descriptor_layouts():
    """The shared layouts of x's [64, 128] and w's [128, 128] TMA boxes (128-byte swizzle)."""
    return (gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.float8e4nv))


@typed
def fp8_gemm_ws(
    x_q_TK: Float[Tensor, "T K"], x_scale_TG: Float[Tensor, "T G"], w_NK: Float[Tensor, "N K"],
    w_scale: Float[Tensor, "Nb Kb"], out_dtype: torch.dtype,
) -> Float[Tensor, "T N"]:
    """y [T, N] (contiguous, out_dtype) = dequant(x_q, x_scale) @ dequant(w, w_scale).T, as fp8_linear;
    K and N multiples of 128. ValueError for shapes, dtypes or a device this kernel cannot serve."""
    if x_q_TK.dim() != 2 or w_NK.dim() != 2:
        raise ValueError(f"fp8_gemm_ws: x_q and w must be 2-D, got {tuple(x_q_TK.shape)}, {tuple(w_NK.shape)}")
    t, k = x_q_TK.shape
    n = w_NK.shape[0]
    if x_q_TK.dtype != FP8_DTYPE or w_NK.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_gemm_ws: x_q and w must be {FP8_DTYPE}, got {x_q_TK.dtype}, {w_NK.dtype}")
    if k % BLOCK_K or n % BLOCK_N:
        raise ValueError(f"fp8_gemm_ws: weight [N, K] = {tuple(w_NK.shape)}: N and K must be multiples of "
                         f"{BLOCK_N} (fp8_linear serves other shapes)")
    if w_NK.shape[1] != k or tuple(w_scale.shape) != (n // BLOCK, k // BLOCK) or tuple(x_scale_TG.shape) != (
            t, k // BLOCK):
        raise ValueError(f"fp8_gemm_ws: x {tuple(x_q_TK.shape)} with scale {tuple(x_scale_TG.shape)} and weight "
                         f"{tuple(w_NK.shape)} with scale {tuple(w_scale.shape)}: expected x [T, K], x scale "
                         f"[T, K/128], weight [N, K], weight scale [N/128, K/128]")
    if x_scale_TG.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm_ws: scales must be float32, got {x_scale_TG.dtype}, {w_scale.dtype}")
    reason = unsupported_reason(x_q_TK)
    if reason is not None:
        raise ValueError(f"fp8_gemm_ws: unsupported call: {reason}")
    y_TN = torch.empty(t, n, dtype=out_dtype, device=x_q_TK.device)
    if t == 0:
        return y_TN
    x_q_TK, w_NK = tma_ready(x_q_TK), tma_ready(w_NK)
    x_layout, w_layout = descriptor_layouts()
    x_desc = TensorDescriptor(x_q_TK, [t, k], list(x_q_TK.stride()), [HALF_M, BLOCK_K], x_layout)
    w_desc = TensorDescriptor(w_NK, [n, k], list(w_NK.stride()), [BLOCK_N, BLOCK_K], w_layout)
    tiles = triton.cdiv(t, BLOCK_M) * (n // BLOCK_N)
    sms = torch.cuda.get_device_properties(x_q_TK.device).multi_processor_count
    _fp8_gemm_ws_kernel[(min(tiles, sms),)](
        x_desc, w_desc, y_TN, x_scale_TG, w_scale, t, n, k,
        y_TN.stride(0), *x_scale_TG.stride(), *w_scale.stride(),
        NS=STAGES, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return y_TN
