"""What the warp-specialised Hopper GEMMs (`fp8_gemm_ws`, `gemm_ws`) share: the Gluon imports, the
device check, the persistent tile walk and the TMA producer warp.

Legend: S ring stages, HM = 64 rows a consumer warpgroup, BN / BK the tile's columns / K step.

Both kernels run one program per SM over 128-row x BN output tiles. The producer (one warp)
streams each K step's x tile, as two HM-row boxes (one per consumer warpgroup), and its w tile
through TMA into an S-stage ring: a `ready` mbarrier per stage that the TMA bytes complete, and an
`empty` one that both consumers arrive on once their MMAs have read the stage. It runs ahead
across tiles, so the next tile's loads overlap this tile's epilogue. The consumers (the scaling of
the FP8 partials, the epilogue) are each kernel's own.
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

    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    tma_store_wait = tma.store_wait
    partition_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # the calling partition's warps
    _ver = re.match(r"(\d+)\.(\d+)", triton.__version__)
    HAS_GLUON = _ver is not None and (int(_ver[1]), int(_ver[2])) >= (3, 6)
except ImportError:  # pragma: no cover - older Triton: callers keep their Triton kernels
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "partition_barrier",
           "producer", "tile_coords", "tma_load", "tma_ready", "tma_store", "tma_store_wait", "unsupported_reason",
           "warpgroup_mma", "warpgroup_mma_wait"]


def unsupported_reason(x: torch.Tensor) -> str | None:
    """None when the warp-specialised kernels can run on x's device, else why not."""
    if not HAS_GLUON:
        return f"Triton {triton.__version__} (Gluon >= 3.6)"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "needs a Hopper GPU (sm_90)"
    return None


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself where TMA can read its rows (unit column stride, 16-byte rows and base), else a copy."""
    if t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


if HAS_GLUON:

    @gluon.jit
    def tile_coords(tile, grid_m, grid_n, GROUP: gl.constexpr):
        """(row block, column block) of a tile: GROUP row blocks per column block, then the next
        (a wave of programs re-reads its w tiles from L2)."""
        width = GROUP * grid_n
        first_m = (tile // width) * GROUP
        size_m = gl.minimum(grid_m - first_m, GROUP)
        return first_m + (tile % width) % size_m, (tile % width) // size_m

    @gluon.jit
    def producer(x_desc, w_desc, a_smem, b_smem, ready, empty, num_tiles, num_k, grid_m, grid_n,
                 GROUP: gl.constexpr):
        # a_smem [2 * S, HM, BK] (stage s: rows 0-63 then 64-127), b_smem [S, BN, BK].
        # Constexprs do not cross into a partition: shapes come from the types.
        NS: gl.constexpr = b_smem.type.shape[0]
        HM: gl.constexpr = a_smem.type.shape[1]
        BN: gl.constexpr = b_smem.type.shape[1]
        BK: gl.constexpr = b_smem.type.shape[2]
        BYTES: gl.constexpr = a_smem.dtype.primitive_bitwidth // 8  # an element: 1 (fp8) or 2 (bf16 / fp16)
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP)
            for kb in range(num_k):
                s = it % NS
                mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)  # phase 1 passes on a fresh barrier
                bar = ready.index(s)
                # rows past the end arrive as zeros and count toward the bytes all the same
                mbarrier.expect(bar, (2 * HM + BN) * BK * BYTES)
                tma_load(x_desc, [pid_m * 2 * HM, kb * BK], bar, a_smem.index(2 * s))
                tma_load(x_desc, [pid_m * 2 * HM + HM, kb * BK], bar, a_smem.index(2 * s + 1))
                tma_load(w_desc, [pid_n * BN, kb * BK], bar, b_smem.index(s))
                it += 1
