"""Warp-specialised bf16 / fp16 GEMM for Hopper (sm_90), written in Gluon: y = x @ w.T.

Legend: M rows (tokens), K input features, N output features, S ring stages.

The bf16 twin of `fp8_gemm_ws` (read that module first: the structure is the same). Deterministic
mode's dense linears otherwise run `fixed_gemm`, a plain Triton GEMM whose 128-row tiles reach
about three quarters of cuBLAS at 16K rows (docs/deterministic.md): its loads and MMAs share the
warps, so the tensor cores wait on the loads. Here a persistent program has three roles:
- a producer warp streams each K step's x tile (two 64-row boxes) and w tile (BLOCK_N x 64) through
  TMA into an S-stage ring (a `ready` mbarrier per stage, an `empty` one both consumers arrive on),
  running ahead across tiles, so the next tile's loads overlap this tile's epilogue;
- two consumer warpgroups, 64 rows of the 128 x BLOCK_N output tile each, chain one asynchronous
  wgmma per K step into a single fp32 accumulator, keep one in flight (wait_group 1) and free the
  ring slot of the step before it once that step is done.
No scales, so unlike fp8_gemm_ws there is no partial to promote: the chain never leaves the
tensor cores between steps.

Determinism: no split-K and one K order (step 0, 1, ... K/64 - 1, one m64nBNk16 chain) for every
row; a row's arithmetic involves no other row, and rows past M are TMA's zeros, never stored. So a
row's bits do not depend on M: one kernel, one tile, for every M (the caller's choice of this
kernel over fixed_gemm must not depend on M either; `layers/linear.py` takes it from the weight).
The bits are fixed_gemm's too on Hopper (one wgmma chain over K in steps of 16 per element,
m64n256k16 against m64n128k16): deterministic `linear` relies on it to hand few-row calls to
fixed_gemm, and tests/test_gemm_ws.py checks it on the GPU for every MiMo weight shape.

Gluon has no CPU interpreter: tests/test_gemm_ws.py compiles it for sm_90 on any machine (ptxas's
report: registers, no spills, wgmmas left asynchronous) and checks numerics on the GPU only.
"""

import torch
import triton

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.ws_common import (
    HAS_GLUON, TensorDescriptor, gl, gluon, mbarrier, producer, tile_coords, tma_ready, warpgroup_mma,
    warpgroup_mma_wait)
from mimo_fn.kernels.ws_common import unsupported_reason as _device_reason

DTYPES = (torch.bfloat16, torch.float16)  # operand dtypes: one wgmma kind (f32 += 16-bit x 16-bit)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HALF_M = 64  # rows per consumer warpgroup: one wgmma M tile
BLOCK_M = 2 * HALF_M  # the output tile's rows: both consumers
BLOCK_N = 256  # m64n256k16, the widest wgmma: 128 fp32 accumulator registers a thread, no spills
BLOCK_K = 64  # 64 x 2 bytes = a 128-byte row: TMA's and wgmma's 128-byte swizzle
STAGES = 4  # ring depth: 4 x (128 + 256) x 64 x 2 bytes = 192 KB of the 227 KB of shared memory
GROUP_M = 8  # tiles walk 8 row blocks per column block, so a wave re-reads w tiles from L2
# Registers: 4 + 4 + 1 warps are padded to 12 (whole warpgroups, so each can hand registers back);
# 12 x 32 threads x 168 = 64,512 of the 65,536. The producer drops to 24 a thread, the second
# consumer takes CONSUMER_REGS, the first what is left (248): a 128-register accumulator, its
# bf16 copy in the epilogue and addresses fit without spills (ptxas's report, in the test).
MAX_REGS = 168
CONSUMER_REGS = 232


def unsupported_reason(x_MK: torch.Tensor) -> str | None:
    """None when this kernel can run on x_MK's device, else why not (shapes: `supports`, gemm_ws raises)."""
    return _device_reason(x_MK)


def supports(w_NK: torch.Tensor) -> bool:
    """Whether a weight's shape and dtype fit this kernel (whole BLOCK_N columns, whole K steps)."""
    n, k = w_NK.shape
    return w_NK.dtype in DTYPES and k > 0 and k % BLOCK_K == 0 and n % BLOCK_N == 0


if HAS_GLUON:

    @gluon.jit
    def _consumer(y_ptr, a_smem, b_smem, ready, empty, wg, M, num_tiles, num_k, grid_m, grid_n,
                  acc_layout: gl.constexpr, GROUP: gl.constexpr):
        # One warpgroup: rows wg * 64 .. wg * 64 + 63 of each of this program's tiles. The
        # accumulator is zeroed once per program: each tile's first MMA ignores it (use_acc=False),
        # so no instruction but the chain's own MMAs touches its registers while one is pending
        # (ptxas would serialise every wgmma, C7514 / C7515).
        NS: gl.constexpr = b_smem.type.shape[0]
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        acc = gl.zeros([HM, BN], gl.float32, layout=acc_layout)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP)
            s = it % NS
            mbarrier.wait(ready.index(s), (it // NS) & 1)
            acc = warpgroup_mma(a_smem.index(2 * s + wg), b_smem.index(s).permute((1, 0)), acc,
                                use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # returns at once: the loop carries a tensor, not a token
            for kb in range(1, num_k):
                s = (it + 1) % NS
                mbarrier.wait(ready.index(s), ((it + 1) // NS) & 1)
                acc = warpgroup_mma(a_smem.index(2 * s + wg), b_smem.index(s).permute((1, 0)), acc, is_async=True)
                # step kb - 1 is done once at most one MMA (step kb) is pending: its slot may refill
                acc = warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index(it % NS), count=1)
                it += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(it % NS), count=1)
            it += 1
            # epilogue: straight from the MMA layout (2 adjacent columns a thread); rows past M are not stored
            rows = pid_m * 2 * HM + wg * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, acc_layout))
            cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
            # y is contiguous, so its row stride is N = grid_n * BN: written so, the compiler knows it a
            # multiple of 256 even where the launch did not specialise N, and stores column pairs in
            # 4 bytes. (Compiled with 2-byte stores, ptxas serialised every wgmma: C7514.)
            out = y_ptr + rows.to(gl.int64)[:, None] * (grid_n * BN) + cols[None, :]
            gl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rows < M)[:, None])

    @gluon.jit
    def _gemm_ws_kernel(x_desc, w_desc, y_ptr, M, N, K,
                        NS: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Persistent grid (at most one program per SM), each walking tiles pid, pid + grid, ..."""
        BK: gl.constexpr = x_desc.block_type.shape[1]
        HM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        grid_m = gl.cdiv(M, 2 * HM)
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
                                                            instr_shape=[16, BN, 16])
        # the argument tuples stay inline: a constexpr (a layout) survives only there
        gl.warp_specialize([
            (_consumer, (y_ptr, a_smem, b_smem, ready, empty, 0, M, num_tiles, num_k, grid_m, grid_n,
                         acc_layout, GROUP)),
            (_consumer, (y_ptr, a_smem, b_smem, ready, empty, 1, M, num_tiles, num_k, grid_m, grid_n,
                         acc_layout, GROUP)),
            (producer, (x_desc, w_desc, a_smem, b_smem, ready, empty, num_tiles, num_k, grid_m, grid_n, GROUP)),
        ], [4, 1], [CONSUMER_REGS, 24])
        for j in gl.static_range(NS):
            mbarrier.invalidate(ready.index(j))
            mbarrier.invalidate(empty.index(j))


def descriptor_layouts(dtype: torch.dtype = torch.bfloat16):
    """The shared layouts of x's [64, 64] and w's [BLOCK_N, 64] TMA boxes (128-byte swizzle)."""
    g = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], g),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], g))


@typed
def gemm_ws(x_MK: Float[Tensor, "M K"], w_NK: Float[Tensor, "N K"],
            out_dtype: torch.dtype | None = None) -> Float[Tensor, "M N"]:
    """y [M, N] (contiguous, out_dtype; default x's) = x @ w.T, accumulated in fp32, for bf16 or fp16
    x and w of one dtype; N a multiple of 256 and K of 64. ValueError for shapes, dtypes or a device
    this kernel cannot serve (`supports` and `unsupported_reason` tell beforehand)."""
    m, k = x_MK.shape
    n = w_NK.shape[0]
    out_dtype = out_dtype or x_MK.dtype
    if x_MK.dtype != w_NK.dtype or x_MK.dtype not in DTYPES:
        raise ValueError(f"gemm_ws: x and w must share bf16 or fp16, got {x_MK.dtype}, {w_NK.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"gemm_ws: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if w_NK.shape[1] != k:
        raise ValueError(f"gemm_ws: x has K={k} features, weight {tuple(w_NK.shape)} expects {w_NK.shape[1]}")
    if not supports(w_NK):
        raise ValueError(f"gemm_ws: weight [N, K] = {tuple(w_NK.shape)}: N must be a multiple of {BLOCK_N} and K "
                         f"a positive multiple of {BLOCK_K} (fixed_gemm serves other shapes)")
    reason = unsupported_reason(x_MK)
    if reason is not None:
        raise ValueError(f"gemm_ws: unsupported call: {reason}")
    y_MN = torch.empty(m, n, dtype=out_dtype, device=x_MK.device)
    if m == 0:
        return y_MN
    x_MK, w_NK = tma_ready(x_MK), tma_ready(w_NK)
    x_layout, w_layout = descriptor_layouts(x_MK.dtype)
    x_desc = TensorDescriptor(x_MK, [m, k], list(x_MK.stride()), [HALF_M, BLOCK_K], x_layout)
    w_desc = TensorDescriptor(w_NK, [n, k], list(w_NK.stride()), [BLOCK_N, BLOCK_K], w_layout)
    tiles = triton.cdiv(m, BLOCK_M) * (n // BLOCK_N)
    sms = torch.cuda.get_device_properties(x_MK.device).multi_processor_count
    _gemm_ws_kernel[(min(tiles, sms),)](
        x_desc, w_desc, y_MN, m, n, k,
        NS=STAGES, GROUP=GROUP_M, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return y_MN
