"""linear(x, w): y = x @ w.T for plain weights; QTensor weights dispatch on their format.

Legend: T tokens (the GEMM's M), K input features, N output features,
G = ceil(K / 128) activation groups per token, Nb / Kb = 128x128 weight blocks.

FP8_BLOCK weights run W8A8: activations are quantised per token in 1x128 groups (the
same format the packed all-gather ships) and the GEMM applies both scales. Backends:

* "scaled_mm_v2": torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 /
  BlockWise128x128 (torch >= 2.10). Hopper (sm90) with CUDA >= 12.9 only: cuBLASLt's
  DeepSeek-style block scaling arrived in 12.9, and torch refuses it on other archs.
* "scaled_mm_v1": torch._scaled_mm, which infers the same recipe from scale shapes and
  strides (older torch).
* "dequant": dequantise weights and activations to fp32 and matmul. CPU, pre-Hopper and
  Blackwell GPUs. It computes exactly what the tests' simulation computes.
* "triton": `mimo_fn.kernels.fp8_linear`, a kernel for a few rows (decode steps) that streams
  the weight in narrow tiles with split K, where cuBLASLt computes whole 128-row tiles. Picked
  by default instead of scaled_mm for at most SMALL_M_ROWS rows.

Deterministic mode (`deterministic=True`, on CUDA): every weight format runs a kernel with one
fixed tiling and no split over K, so a token's row has the same bits whatever else is in the
step: plain weights `mimo_fn.kernels.fixed_gemm` (not cuBLAS, whose algorithm follows M), or on
Hopper from 1,024 rows `mimo_fn.kernels.gemm_ws` (the same bits, faster) where the weight fits it
(every MiMo weight at TP 1, the LM head too; `_fixed_linear`); FP8 the "triton" backend's
deterministic path (not scaled_mm; on Hopper the warp-specialised `fp8_gemm_ws` at every row
count: `fp8_linear.ws_serves`); MXFP4 its dequantised copy as plain weights. Off CUDA the
reference paths run as always (one matmul per call).

MXFP4 weights (the RL release stores only its routed experts so, and those run in the MoE
kernels, not here) are dequantised into x's dtype and multiplied with F.linear: W4A16, the
same arithmetic as the MoE reference, exact up to the matmul's own rounding.

Layouts scaled_mm reads (cuBLASLt block-scaling rules): a = q [M, K] row-major, b = the
weight [N, K] viewed as column-major [K, N]; scale_a [M, G] "M-major" (a [G, M] buffer,
strides (1, M)); scale_b the weight scale as [L4, Nb] with strides (1, L4), L4 =
round_up(Kb, 4), i.e. the checkpoint's [Nb, Kb] scale padded to a multiple of 4 blocks
along K and transposed (pytorch#166752: without the L4 padding Kb % 4 != 0 gave silently
wrong results). torch._scaled_mm (v1) checks for strides (1, Kb) instead, so for v1 we
pad K to a multiple of 512, where Kb == L4.
Shape padding (all cheap except where noted):
* K to a multiple of 128 (no partial K block reaches cuBLAS): activations are quantised
  straight into a padded buffer; weights are padded per call (a copy of the weight, so
  store such weights pre-padded; no MiMo shape needs it).
* N to a multiple of 16 (cuBLASLt FP8 alignment; 128x128 blocks may be partial in N, as
  for a 192-row k_proj shard): a weight copy when needed.
* M to a multiple of 128. Measured on an H200 (torch 2.11, CUDA 13.0, 2026-11-30):
  M % 4 != 0 is rejected (CUBLAS_STATUS_NOT_SUPPORTED from the heuristic); M = 132,
  200, 260 computed correctly in a probe, yet a first test run with M = 130 padded to
  132 failed its accuracy check on both APIs (cause not isolated). With whole 128-row
  tiles, what torch's own tests use, every test passed. Free for `linear` (the
  quantiser writes the padded buffers; cuBLAS computes whole 128-row tiles anyway) and
  for `quantize_once`'s QActs, whose q / scale are the row-prefix views [:T] of such
  buffers, which `linear_fp8` widens back in place (`_whole_rows`); a copy of q for other
  pre-quantised input with M % 128 != 0 (a gathered packet).
"""

import os

import torch
import torch.nn.functional as F

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.quant import block_recipes as _block_recipes
from mimo_fn.quant import block_scaled_mm_available as _block_scaled_mm_available
from mimo_fn.quant import has_scaled_mm_v2 as _has_scaled_mm_v2
from mimo_fn.quant import (
    BLOCK, FP8_BLOCK, FP8_DTYPE, MXFP4, QActs, QTensor, check_mxfp4, dequantize, dequantize_fp8_act,
    quantize_fp8_act_ref,
)

Weight = torch.Tensor | QTensor
BACKENDS = ("scaled_mm_v2", "scaled_mm_v1", "dequant", "triton")
# Rows up to which the default on a scaled_mm GPU is the "triton" kernel: one H200, MiMo's
# attention and dense-MLP projections (docs/benchmarks.md, "FP8 linears at decode sizes")
SMALL_M_ROWS = 16

_M_ALIGN = 128  # see the module docstring: whole 128-row tiles only
_N_ALIGN = 16


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def default_backend(device: torch.device) -> str:
    """The FP8_BLOCK backend `linear` picks on `device` when none is named."""
    if not _block_scaled_mm_available(torch.device(device)):
        return "dequant"
    return "scaled_mm_v2" if _has_scaled_mm_v2() else "scaled_mm_v1"


def _resolve_backend(backend: str | None, device: torch.device, rows: int | None = None) -> str:
    """`backend`, or when None the device's default, the "triton" kernel for <= SMALL_M_ROWS rows."""
    if backend is None:
        backend = default_backend(device)
        return "triton" if backend != "dequant" and rows is not None and 0 < rows <= SMALL_M_ROWS else backend
    if backend not in BACKENDS:
        raise ValueError(f"linear: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("linear: backend 'triton' needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1)")
    if backend == "scaled_mm_v2" and not _has_scaled_mm_v2():
        raise ValueError("linear: backend 'scaled_mm_v2' needs torch.nn.functional.scaled_mm (torch >= 2.10)")
    return backend


def _deterministic_backend(backend: str | None, device: torch.device) -> str:
    """The FP8 backend of deterministic mode: the fixed-tiling "triton" kernel on CUDA, the
    reference ("dequant") elsewhere; any other backend named with it is a ValueError (on CUDA
    scaled_mm and the dequantised matmul run cuBLAS, whose tiling follows the row count)."""
    want = "triton" if device.type == "cuda" else "dequant"
    if backend not in (None, want):
        raise ValueError(f"linear: deterministic mode runs the {want!r} backend on {device.type}, got {backend!r}")
    return want


def _padded_k(k: int, backend: str) -> int:
    kp = _round_up(k, BLOCK)
    if backend == "scaled_mm_v1" and (kp // BLOCK) % 4 != 0:
        kp = _round_up(k, 4 * BLOCK)  # v1 cannot take an L4-padded weight scale: pad the data instead
    return kp


def _pad_fp8(q: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad an fp8 matrix (byte 0 is +0.0); F.pad has no fp8 kernels, so pad the bytes."""
    if tuple(q.shape) == (rows, cols):
        return q
    pad = (0, cols - q.shape[1], 0, rows - q.shape[0])
    return F.pad(q.view(torch.uint8), pad).view(FP8_DTYPE)


def _row_strided_ok(q_TK: torch.Tensor, rows: int, cols: int) -> bool:
    """Whether scaled_mm can read q as it is: already [rows, cols], K-contiguous, with a leading
    dimension of whole 16 bytes (cuBLASLt's lda rule for fp8). A gathered packet's q (row stride
    R = H + 4G) qualifies, so the q / k / v GEMMs read it in place instead of each copying it."""
    return (tuple(q_TK.shape) == (rows, cols) and q_TK.stride(1) == 1 and q_TK.stride(0) >= cols
            and q_TK.stride(0) % 16 == 0 and q_TK.data_ptr() % 16 == 0)


def _has_room(x: torch.Tensor, numel: int) -> bool:
    """Whether x's storage holds `numel` elements from x's offset on (an as_strided view reads them)."""
    return (x.storage_offset() + numel) * x.element_size() <= x.untyped_storage().nbytes()


def _whole_rows(q_TK: torch.Tensor, scale_TG: torch.Tensor, tp: int, kp: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [Tp, Kp], scale [Tp, Gp] M-major), the padded buffers that the row-prefix views q [T, Kp]
    (row stride Kp) and scale [T, Gp] (strides (1, Tp)) were cut from, widened with as_strided: no
    copy. None where they are not such views or their storage lacks the room for Tp rows. That is
    `quantize_once`'s QActs on a scaled_mm backend, whose rows past T the quantiser wrote (q = 0,
    scale = 1e-10 / 448). Any other bytes there would be as harmless: output row i reads only row i
    of q and scale, so they land in rows that `_crop` drops. Only rows are widened: columns past K
    would enter every row's sum, and the storage cannot tell the quantiser's zero columns from a
    neighbour's bytes (a packet's scales follow its q)."""
    t, gp = q_TK.shape[0], kp // BLOCK
    assert t <= tp, (t, tp)
    if tuple(q_TK.shape) != (t, kp) or tuple(scale_TG.shape) != (t, gp):
        return None
    if q_TK.stride() != (kp, 1) or scale_TG.stride() != (1, tp):
        return None
    if not (_has_room(q_TK, tp * kp) and _has_room(scale_TG, gp * tp)):
        return None
    q_MK = q_TK.as_strided((tp, kp), (kp, 1))
    return (q_MK, scale_TG.as_strided((tp, gp), (1, tp))) if _row_strided_ok(q_MK, tp, kp) else None


def _scaled_mm_operands(q_TK: torch.Tensor, scale_TG: torch.Tensor, backend: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [Tp, Kp], scale [Tp, Gp] M-major) for scaled_mm from pre-quantised q [T, K] / scale [T, G]:
    the whole buffers of `quantize_once`'s views, q itself where scaled_mm reads it as it is, else
    padded copies."""
    t, k = q_TK.shape
    tp, kp = _round_up(t, _M_ALIGN), _padded_k(k, backend)
    whole = _whole_rows(q_TK, scale_TG, tp, kp)
    if whole is not None:
        return whole
    q_MK = q_TK if _row_strided_ok(q_TK, tp, kp) else _pad_fp8(q_TK, tp, kp).contiguous()
    gp = kp // BLOCK
    if tuple(scale_TG.shape) == (tp, gp) and scale_TG.stride() == (1, tp):
        return q_MK, scale_TG
    # padded rows / groups multiply zero data: any finite scale will do
    scale_GM = torch.ones(gp, tp, dtype=torch.float32, device=scale_TG.device)
    scale_GM[: scale_TG.shape[1], :t] = scale_TG.t()
    return q_MK, scale_GM.t()


def _check_weight(x_k: int, w: QTensor) -> None:
    if w.fmt != FP8_BLOCK:
        raise ValueError(f"linear: unsupported QTensor format {w.fmt!r} (expected {FP8_BLOCK!r})")
    if w.data.dim() != 2:
        raise ValueError(f"linear: weight must be [N, K], got shape {tuple(w.data.shape)}")
    if w.data.shape[1] != x_k:
        raise ValueError(f"linear: x has K={x_k} features, weight {tuple(w.data.shape)} expects {w.data.shape[1]}")


def _weight_operands(w: QTensor, kp: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(b [Kp, Np] column-major fp8, scale_b in the layout of `backend`) for the weight."""
    n, k = w.data.shape
    np_ = _round_up(n, _N_ALIGN)
    nb, kb = w.scale.shape
    w_NK = _pad_fp8(w.data, np_, kp).contiguous()  # a copy only for unaligned N or K
    kb_pad = kp // BLOCK
    if backend == "scaled_mm_v2":
        kb_pad = _round_up(kb_pad, 4)  # cuBLASLt's L4: scale rows padded to 4 blocks along K
    nb_pad = -(-np_ // BLOCK)
    scale = w.scale.float()
    if (nb_pad, kb_pad) != (nb, kb) or not scale.is_contiguous():
        # padded blocks hold zero data, so their scale is irrelevant; 1.0 keeps it finite
        padded = torch.ones(nb_pad, kb_pad, dtype=torch.float32, device=scale.device)
        padded[:nb, :kb] = scale
        scale = padded
    return w_NK.t(), scale.t()  # [Kp, Np] column-major; scale [Kb', Nb'] with strides (1, Kb')


def _scaled_mm(
    q_MK: torch.Tensor, scale_MG: torch.Tensor, w: QTensor, out_dtype: torch.dtype, backend: str
) -> torch.Tensor:
    """Block-scaled FP8 GEMM on padded operands: q [Mp, Kp], scale M-major [Mp, Kp/128]."""
    b_KN, scale_b = _weight_operands(w, q_MK.shape[1], backend)
    if backend == "scaled_mm_v2":
        recipe_a, recipe_b = _block_recipes()
        return F.scaled_mm(q_MK, b_KN, scale_MG, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    return torch._scaled_mm(q_MK, b_KN, scale_a=scale_MG, scale_b=scale_b, out_dtype=out_dtype)


def _crop(y_MN: torch.Tensor, t: int, n: int) -> torch.Tensor:
    """Drop padded rows (a view) and padded columns (a copy, so callers may .view() the result)."""
    y_TN = y_MN[:t]
    return y_TN if y_TN.shape[1] == n else y_TN[:, :n].contiguous()


def _dequant_matmul(q_TK, scale_TG, w: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
    x_TK = dequantize_fp8_act(q_TK, scale_TG, torch.float32)
    return F.linear(x_TK, dequantize(w, torch.float32)).to(out_dtype)


def _fixed_linear(x_TK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """F.linear through a fixed-tiling kernel (deterministic mode on CUDA): on Hopper the
    warp-specialised gemm_ws for the weights it takes (bf16 / fp16, N % 256 == 0, K % 64 == 0) from
    fixed_gemm's LARGE_M rows on, else fixed_gemm. Below LARGE_M (decode and verify steps) gemm_ws's
    128 x 256 tiles would leave most SMs idle (N / 256 programs). Handing a call over by its row
    count keeps a row's bits only because the two kernels round alike on Hopper: each output element
    is one wgmma chain over K in steps of 16, in the same order (m64n256k16 against m64n128k16), which
    tests/test_gemm_ws.py checks on the GPU for every MiMo weight shape."""
    from mimo_fn.kernels import gemm_ws  # Triton: imported only where it runs
    from mimo_fn.kernels.fixed_gemm import LARGE_M, fixed_gemm

    *lead, k = x_TK.shape
    x_MK = x_TK.reshape(-1, k)
    ws = x_MK.shape[0] >= LARGE_M and x_MK.dtype == w_NK.dtype and gemm_ws.supports(w_NK) and \
        gemm_ws.unsupported_reason(x_MK) is None
    y_MN = gemm_ws.gemm_ws(x_MK, w_NK) if ws else fixed_gemm(x_MK, w_NK)
    return y_MN.reshape(*lead, w_NK.shape[0])


@typed
def linear_fp8(
    x_q_TK: Float[Tensor, "T K"],
    x_scale_TG: Float[Tensor, "T G"],
    w: QTensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    deterministic: bool = False,
) -> Float[Tensor, "T N"]:
    """y = dequant(x_q, x_scale) @ dequant(w).T for activations quantised already (e.g. gathered).

    x_q [T, K] fp8 and x_scale [T, G] fp32 as `quantize_fp8_act_ref` defines them. The
    scale may have any strides. No copy on the scaled_mm path for `quantize_once`'s QActs (row
    views of the padded buffers, widened back: `_whole_rows`), nor for an M-major scale (strides
    (1, T)) with T % 128 == 0, K % 128 == 0 and an x_q with unit column stride and 16-byte rows
    (contiguous, or a gathered packet's row-strided view). deterministic: the module docstring.
    """
    t, k = x_q_TK.shape
    _check_weight(k, w)
    if x_q_TK.dtype != FP8_DTYPE or x_scale_TG.dtype != torch.float32:
        raise ValueError(f"linear_fp8: need {FP8_DTYPE} q and float32 scale, got {x_q_TK.dtype}, {x_scale_TG.dtype}")
    if x_scale_TG.shape[1] != -(-k // BLOCK):
        raise ValueError(f"linear_fp8: x_scale has {x_scale_TG.shape[1]} groups, K={k} needs {-(-k // BLOCK)}")
    backend = _deterministic_backend(backend, x_q_TK.device) if deterministic else \
        _resolve_backend(backend, x_q_TK.device, t)
    n = w.data.shape[0]
    if backend == "dequant" or t == 0:  # scaled_mm's stride checks reject empty M-major scales
        return _dequant_matmul(x_q_TK, x_scale_TG, w, out_dtype)
    if backend == "triton":
        from mimo_fn.kernels.fp8_linear import fp8_linear  # Triton: imported only where it runs

        return fp8_linear(x_q_TK, x_scale_TG, w.data, w.scale, out_dtype, deterministic=deterministic)
    q_MK, scale_MG = _scaled_mm_operands(x_q_TK, x_scale_TG, backend)
    return _crop(_scaled_mm(q_MK, scale_MG, w, out_dtype, backend), t, n)


def quant_rows(x_TK: torch.Tensor, weights: tuple[Weight, ...], deterministic: bool = False,
               backend: str | None = None) -> int | None:
    """How many rows `quantize_once` quantises x [T, K] into for `weights`: T on the "triton" backend
    (few rows), T rounded up to whole 128-row tiles on scaled_mm. None where it hands x on as it is: a
    weight that is not FP8 with x's K, the "dequant" backend, no rows, and scaled_mm with K off its
    padded K (no MiMo shape: `_whole_rows` widens rows only)."""
    if x_TK.dim() != 2 or x_TK.shape[0] == 0 or not all(
            isinstance(w, QTensor) and w.fmt == FP8_BLOCK and w.data.dim() == 2 and w.data.shape[1] == x_TK.shape[1]
            for w in weights):
        return None  # `linear` reports a weight that does not fit x
    t, k = x_TK.shape
    backend = _deterministic_backend(backend, x_TK.device) if deterministic else \
        _resolve_backend(backend, x_TK.device, t)
    if backend == "dequant" or (backend != "triton" and _padded_k(k, backend) != k):
        return None
    return t if backend == "triton" else _round_up(t, _M_ALIGN)


@typed
def quantize_once(x_TK: Float[Tensor, "T K"] | QActs, weights: tuple[Weight, ...],
                  deterministic: bool = False, backend: str | None = None) -> Float[Tensor, "T K"] | QActs:
    """x quantised once as QActs for `linear` against every weight of `weights` (q, k, v; gate, up),
    which then share one quantiser launch instead of one each, with the same bits, where `quant_rows`
    says linear would quantise x. On the "triton" backend (few rows) the quantiser's unpadded output;
    on scaled_mm the padded, M-major buffers `linear` would quantise into, as the row-prefix views
    q [T, K] / scale [T, G], which `linear_fp8` widens back without a copy (`_whole_rows`). Otherwise x
    as it is. backend / deterministic: pass the linears' own (the backend is resolved alike for x's rows)."""
    if isinstance(x_TK, QActs):
        return x_TK
    rows = quant_rows(x_TK, weights, deterministic, backend)
    if rows is None:
        return x_TK
    from mimo_fn.kernels.fp8_quant import quant_fp8_act  # Triton: imported only where it runs

    # linear's own quantisation (the same kernel on the same rows: the same bits), kept whole
    q_MK, scale_MG = quant_fp8_act(x_TK, rows, x_TK.shape[1])
    return QActs(q_MK[:x_TK.shape[0]], scale_MG[:x_TK.shape[0]], x_TK.dtype)


@typed
def linear(x_TK: Float[Tensor, "*T K"] | QActs, w: Weight, backend: str | None = None, *,
           deterministic: bool = False) -> Float[Tensor, "*T N"]:
    """y = x @ w.T, in x's dtype. Plain weights: F.linear. FP8_BLOCK: W8A8 via `backend`.
    MXFP4: the weight dequantised into x's dtype, then F.linear. Pre-quantised activations
    (QActs) go straight into the FP8 GEMM, and are dequantised for any other weight.
    deterministic: on CUDA, kernels whose tiling no row count changes (the module docstring)."""
    if isinstance(x_TK, QActs):
        if isinstance(w, QTensor) and w.fmt == FP8_BLOCK:
            return linear_fp8(x_TK.q, x_TK.scale, w, x_TK.dtype, backend, deterministic)
        x_TK = dequantize_fp8_act(x_TK.q, x_TK.scale, x_TK.dtype)
    if isinstance(w, torch.Tensor):
        return _fixed_linear(x_TK, w) if deterministic and x_TK.is_cuda else F.linear(x_TK, w)
    if w.fmt == MXFP4:
        # Enough: no released weight that `linear` sees is MXFP4 (the RL release's routed experts
        # run in moe_experts), so this is no hot path; dequantising is exact in bf16 / fp32 (an
        # E2M1 value times a power of two), so only the GEMM itself rounds, as it would in bf16.
        check_mxfp4("linear", w)
        if w.data.dim() != 2 or w.shape[1] != x_TK.shape[-1]:
            raise ValueError(f"linear: x has K={x_TK.shape[-1]} features, MXFP4 weight must be [N, K], "
                             f"got {list(w.shape)}")
        w_NK = dequantize(w, x_TK.dtype)
        return _fixed_linear(x_TK, w_NK) if deterministic and x_TK.is_cuda else F.linear(x_TK, w_NK)
    *lead, k = x_TK.shape
    _check_weight(k, w)
    x_MK = x_TK.reshape(-1, k)
    backend = _deterministic_backend(backend, x_TK.device) if deterministic else \
        _resolve_backend(backend, x_TK.device, x_MK.shape[0])
    if backend == "dequant" or x_MK.shape[0] == 0:  # scaled_mm's stride checks reject empty M-major scales
        y_MN = _dequant_matmul(*quantize_fp8_act_ref(x_MK), w, x_TK.dtype)
    elif backend == "triton":
        from mimo_fn.kernels.fp8_linear import fp8_linear  # Triton: imported only where it runs
        from mimo_fn.kernels.fp8_quant import quant_fp8_act

        y_MN = fp8_linear(*quant_fp8_act(x_MK), w.data, w.scale, x_TK.dtype, deterministic=deterministic)
    else:
        from mimo_fn.kernels.fp8_quant import quant_fp8_act  # Triton: imported only where it runs

        t = x_MK.shape[0]
        # quantise straight into the padded, M-major layout scaled_mm reads: no extra pass
        q_MK, scale_MG = quant_fp8_act(x_MK, _round_up(t, _M_ALIGN), _padded_k(k, backend))
        y_MN = _crop(_scaled_mm(q_MK, scale_MG, w, x_TK.dtype, backend), t, w.data.shape[0])
    return y_MN.reshape(*lead, w.data.shape[0])
