"""FP8 block-scaled linear for a few rows (decode steps): y = dequant(x_q) @ dequant(w).T.

Legend: T rows (tokens), K input features, N output features, G = ceil(K / 128) activation
groups, Nb / Kb = 128x128 weight blocks, S split-K slices.

At decode a linear has a handful of rows and streams its weight once: the work is the weight's
bytes. cuBLASLt's block-scaled GEMM (what `mimo_fn.layers.linear` runs otherwise) computes whole
128-row tiles and took ~19 us a call for MiMo's attention projections at 1 and 64 rows on one
H200, about a third of the copy bandwidth (docs/benchmarks.md). Here a program owns a
BLOCK_M x BLOCK_N tile of y and a slice of the K blocks: each 128-deep step multiplies one
fp8 tile pair, then scales the fp32 partial by the rows' activation scales and the columns'
weight-block scale and adds it up (the same per-block promotion as the FP8 MoE GEMMs). Narrow
tiles and split K give every SM programs even for a 512-row k_proj; the slices' fp32 partials
are summed in slice order by a second kernel, so the result does not depend on timing.

Deterministic mode (`deterministic=True`) runs no split and one K order for every row count. On a
Hopper GPU, weights whose N and K are multiples of 128 (all of MiMo's) go to the warp-specialised
`fp8_gemm_ws` at every T (`ws_serves`: the weight's shape and the device decide, never T). Other
weights, and other GPUs, run this kernel in 64-row tiles whose width follows T (`det_tiles`: 128
columns and one warpgroup below DET_LARGE_M rows, 256 columns and two warpgroups side by side from
there, each warpgroup the same 64 x 128 MMA chain). Either way a row's bits do not depend on how many
rows share the call (the split count and cuBLASLt's choices do: `mimo_fn.kernels.fixed_gemm` says why
that matters).

`fp8_linear_ref` is the plain-torch twin: the same product in fp32 with one matmul over all of
K, so the two differ only by the order of the fp32 sums.
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.kernels.fp8_gemm_ws import BLOCK_K as WS_BLOCK_K
from mimo_fn.kernels.fp8_gemm_ws import BLOCK_N as WS_BLOCK_N
from mimo_fn.kernels.fp8_gemm_ws import fp8_gemm_ws
from mimo_fn.kernels.fp8_gemm_ws import unsupported_reason as ws_unsupported
from mimo_fn.quant import BLOCK, FP8_BLOCK, FP8_DTYPE, QTensor, dequantize, dequantize_fp8_act

BLOCK_M, BLOCK_N = 16, 64  # 16 rows: Triton's smallest dot tile; 64 columns: twice the programs of 128
# deterministic mode on CUDA (BLOCK_M, BLOCK_N, warps, stages): a warpgroup's 64 x 128 in both
DET_TILES, DET_TILES_LARGE_M, DET_LARGE_M = (64, 128, 4, 3), (64, 256, 8, 3), 1024


def det_tiles(t: int) -> tuple[int, int, int, int]:
    """Deterministic mode's CUDA tile for a T-row call: only its width follows T."""
    return DET_TILES_LARGE_M if t >= DET_LARGE_M else DET_TILES


def ws_serves(x_q_TK: torch.Tensor, n: int, k: int) -> bool:
    """Whether deterministic mode runs this weight's calls in `fp8_gemm_ws`: a Hopper GPU and N, K
    multiples of 128. The weight's shape and the device decide, never T, so all of a weight's
    calls (a decode step's rows and a 16K chunk's) take the same kernel, and so the same bits."""
    return n % WS_BLOCK_N == 0 and k % WS_BLOCK_K == 0 and ws_unsupported(x_q_TK) is None


@triton.jit
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, T, N, K, blocks_per_split,
                       stride_xt, stride_xk, stride_xst, stride_xsg, stride_wn, stride_wk, stride_wsn, stride_wsk,
                       stride_os, stride_ot, stride_on,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N), S): rows, columns, K slice. out: [S, T, N] fp32
    partials, or y itself (its dtype) when S == 1."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    m_ok, n_ok = offs_m < T, offs_n < N
    num_kb = tl.cdiv(K, GROUP)
    kb_start = pid_s * blocks_per_split
    kb_end = tl.minimum(kb_start + blocks_per_split, num_kb)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * GROUP + offs_k
        k_ok = k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xt + k[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, GROUP] fp8
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :] * stride_wk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, GROUP] fp8
        part = tl.dot(a, tl.trans(b))  # [BLOCK_M, BLOCK_N] fp32, this 128-deep block only
        a_s = tl.load(xs_ptr + offs_m * stride_xst + kb * stride_xsg, mask=m_ok, other=0.0)
        w_s = tl.load(ws_ptr + (offs_n // GROUP) * stride_wsn + kb * stride_wsk, mask=n_ok, other=0.0)
        acc += part * a_s[:, None] * w_s[None, :]
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_ot + offs_n[None, :] * stride_on
    dt: tl.constexpr = out_ptr.dtype.element_ty
    if dt != tl.float32:
        acc = cast_rne(acc, dt, INTERPRET)
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, S, TN, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """y.flat[i] = sum over s in order of part[s].flat[i]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(part_ptr + s * TN + offs, mask=ok, other=0.0)
    dt: tl.constexpr = y_ptr.dtype.element_ty
    if dt != tl.float32:
        acc = cast_rne(acc, dt, INTERPRET)
    tl.store(y_ptr + offs, acc, mask=ok)


def num_splits(t: int, n: int, k: int, num_sms: int) -> int:
    """K slices so that the grid holds about two programs per SM, each at least one K block."""
    tiles = triton.cdiv(t, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    return max(1, min(triton.cdiv(k, BLOCK), triton.cdiv(2 * num_sms, tiles)))


@typed
def fp8_linear(
    x_q_TK: Float[Tensor, "T K"], x_scale_TG: Float[Tensor, "T G"], w_NK: Float[Tensor, "N K"],
    w_scale: Float[Tensor, "Nb Kb"], out_dtype: torch.dtype, splits: int | None = None,
    deterministic: bool = False, tiles: tuple[int, int, int, int] | None = None,
) -> Float[Tensor, "T N"]:
    """Triton: y [T, N] (contiguous, out_dtype) = dequant(x_q, x_scale) @ dequant(w, w_scale).T
    for 1x128 activation groups and 128x128 weight blocks; any strides. splits: K slices (None:
    `num_splits`). deterministic: no split, `det_tiles` on CUDA (the module docstring); tiles
    (BLOCK_M, BLOCK_N, warps, stages) overrides them (tests, benchmarks)."""
    t, k = x_q_TK.shape
    n = w_NK.shape[0]
    if x_q_TK.dtype != FP8_DTYPE or w_NK.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear: x_q and w must be {FP8_DTYPE}, got {x_q_TK.dtype}, {w_NK.dtype}")
    if w_NK.shape[1] != k or tuple(w_scale.shape) != (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)):
        raise ValueError(f"fp8_linear: weight {tuple(w_NK.shape)} with scale {tuple(w_scale.shape)} does not "
                         f"fit x's K={k} in 128x128 blocks")
    if max(n * w_NK.stride(0), t * x_q_TK.stride(0), k * w_NK.stride(1)) >= 2**31:
        raise ValueError(f"fp8_linear: x {tuple(x_q_TK.shape)} / weight {tuple(w_NK.shape)} span 2^31 elements or "
                         "more; the kernel's offsets are int32")
    y_TN = torch.empty(t, n, dtype=out_dtype, device=x_q_TK.device)
    if t == 0 or n == 0:
        return y_TN
    block_m, block_n, warps, stages = BLOCK_M, BLOCK_N, 4, 4
    if deterministic:
        if splits not in (None, 1):
            raise ValueError(f"fp8_linear: deterministic runs one K slice, got splits={splits}")
        if tiles is None and ws_serves(x_q_TK, n, k):
            return fp8_gemm_ws(x_q_TK, x_scale_TG, w_NK, w_scale, out_dtype)
        splits = 1
        if x_q_TK.is_cuda:
            block_m, block_n, warps, stages = det_tiles(t)
    if tiles is not None:
        block_m, block_n, warps, stages = tiles
    sms = torch.cuda.get_device_properties(x_q_TK.device).multi_processor_count if x_q_TK.is_cuda else 4
    splits = splits or num_splits(t, n, k, sms)
    per_split = triton.cdiv(triton.cdiv(k, BLOCK), splits)
    splits = triton.cdiv(triton.cdiv(k, BLOCK), per_split)  # no empty slice
    out = y_TN if splits == 1 else torch.empty(splits, t, n, dtype=torch.float32, device=y_TN.device)
    out_strides = (0, *y_TN.stride()) if splits == 1 else out.stride()
    interpret = not x_q_TK.is_cuda
    _fp8_linear_kernel[(triton.cdiv(t, block_m), triton.cdiv(n, block_n), splits)](
        x_q_TK, x_scale_TG, w_NK, w_scale, out, t, n, k, per_split,
        *x_q_TK.stride(), *x_scale_TG.stride(), *w_NK.stride(), *w_scale.stride(), *out_strides,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP=BLOCK, INTERPRET=interpret, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(t * n, block),)](out, y_TN, splits, t * n, BLOCK=block, INTERPRET=interpret,
                                                          num_warps=4)
    return y_TN


@typed
def fp8_linear_ref(
    x_q_TK: Float[Tensor, "T K"], x_scale_TG: Float[Tensor, "T G"], w_NK: Float[Tensor, "N K"],
    w_scale: Float[Tensor, "Nb Kb"], out_dtype: torch.dtype,
) -> Float[Tensor, "T N"]:
    """Plain torch twin of `fp8_linear`: both operands dequantised to fp32, one matmul."""
    x_TK = dequantize_fp8_act(x_q_TK, x_scale_TG, torch.float32)
    return (x_TK @ dequantize(QTensor(w_NK, w_scale, FP8_BLOCK), torch.float32).T).to(out_dtype)
