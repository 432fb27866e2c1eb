"""y = x @ w.T with one fixed tiling: a row's result never depends on how many rows share the call.

Legend: M rows (tokens), K input features, N output features.

Deterministic mode (EngineConfig.deterministic, forward(..., deterministic=True)) runs the router
here instead of cuBLAS, and the dense linears that `kernels.gemm_ws` does not take (a warp-
specialised GEMM for Hopper, for bf16 / fp16 weights with N % 256 == 0 and K % 64 == 0, from
LARGE_M rows on, whose bits are this kernel's: `layers.linear._fixed_linear`). cuBLAS picks its
algorithm, tile and split-K from the problem's M, so one token's row comes out in other bits when
the batch around it grows (on an H200: log-probs of one request differed by up to 0.016 in bf16
with 4 or 12 others in the call).
Here BLOCK_N, the K step and the MMA instruction are constants of the device kind, the K loop runs
in one order over all of K (no split), and rows past M load zeros: element (m, n) is the same
sequence of MMA steps over the same operands wherever row m sits and whatever M is. On CUDA the row
count of a tile follows M (`tiles_for`): 64 rows and one warpgroup for a decode step's few rows,
128 rows and two warpgroups from LARGE_M rows on (a fifth less time at 16K tokens). Each warpgroup
owns 64 rows in both and issues the same m64n128k16 wgmma steps in the same K order, so the two
tiles give the same bits (tests/test_deterministic.py checks it on the GPU).

`fixed_gemm_ref` is the plain-torch twin (one fp32 matmul), equal up to the order of fp32 sums.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne


@dataclasses.dataclass(frozen=True)
class FixedTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# CUDA: 64-row tiles waste little at decode sizes (a step's few rows); from LARGE_M rows on, 128-row
# tiles of two warpgroups (on an H100 at 16K rows: 487-521 TFLOP/s against 386-428, the slice's
# linears 48.7 ms against 62.0; docs/benchmarks.md). Both run one m64n128k16 MMA chain per 64 rows.
CUDA_TILES = FixedTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
CUDA_TILES_LARGE_M = FixedTiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
LARGE_M = 1024
INTERPRETER_TILES = FixedTiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def tiles_for(device: torch.device, m: int = 1) -> FixedTiles:
    """The tiles of an M-row call: only the tile's row count follows M, never the arithmetic of a row."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    return CUDA_TILES_LARGE_M if m >= LARGE_M else CUDA_TILES


@triton.jit
def _fixed_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): one output tile, the whole K loop."""
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles sweep N together (L2 reuse of w); the order of programs changes no sum
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:  # the K tail loads zeros: the same tail for every M
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRET:  # the interpreter's dot multiplies bf16 bit patterns as integers
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty, INTERPRET), mask=m_ok[:, None] & n_ok[None, :])


@typed
def fixed_gemm(x_MK: Float[Tensor, "M K"], w_NK: Float[Tensor, "N K"], out_dtype: torch.dtype | None = None,
               tiles: FixedTiles | None = None) -> Float[Tensor, "M N"]:
    """Triton: y [M, N] (contiguous, out_dtype; default x's) = x @ w.T, accumulated in fp32, for x and
    w of one dtype (bf16 / fp16 / fp32; fp32 with IEEE products). tiles: the device kind's constants
    unless given (tests)."""
    m, k = x_MK.shape
    n = w_NK.shape[0]
    if w_NK.shape[1] != k:
        raise ValueError(f"fixed_gemm: x has K={k} features, weight {tuple(w_NK.shape)} expects {w_NK.shape[1]}")
    if x_MK.dtype != w_NK.dtype or x_MK.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fixed_gemm: x and w must share one of bf16 / fp16 / fp32, got {x_MK.dtype}, {w_NK.dtype}")
    out_dtype = out_dtype or x_MK.dtype
    y_MN = torch.empty(m, n, dtype=out_dtype, device=x_MK.device)
    if m == 0 or n == 0:
        return y_MN
    if k == 0:
        return y_MN.zero_()
    t = tiles or tiles_for(x_MK.device, m)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _fixed_gemm_kernel[grid](
        x_MK, w_NK, y_MN, m, n, k, *x_MK.stride(), *w_NK.stride(), *y_MN.stride(),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8, EVEN_K=k % t.block_k == 0,
        IEEE=x_MK.dtype == torch.float32, INTERPRET=not x_MK.is_cuda, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return y_MN


@typed
def fixed_gemm_ref(x_MK: Float[Tensor, "M K"], w_NK: Float[Tensor, "N K"],
                   out_dtype: torch.dtype | None = None) -> Float[Tensor, "M N"]:
    """Plain-torch twin of `fixed_gemm`: one fp32 matmul."""
    return (x_MK.float() @ w_NK.float().T).to(out_dtype or x_MK.dtype)
