"""MXFP4 weights dequantised in bulk: one pass that writes a dense copy.

Legend: R rows (every matrix's rows, the leading dims flattened), C columns (the packed
dim, K of a GEMM), C2 = C / 2 packed bytes, G = C / 32 scale groups.

Why: at prefill sizes a grouped GEMM that dequantises its weight tiles in registers
(mxfp4.py) shares the SMs between the dequantisation and the MMAs, and ran at ~405 TFLOP/s
on one H200 where gemm.py's bf16 kernels ran 634-673. With many rows per expert, writing the
layer's experts out in bf16 once (a pass over 4.25 + 16 bits a weight) and running the bf16
kernels costs less; dispatch.fused_moe_mxfp4 picks that path by rows per expert (mxfp4.dequantize_first).

Each program dequantises a [BLOCK_R, BLOCK_C] tile with mxfp4_codec's `_dequant` (the same
PTX on CUDA in bf16, the portable integer path elsewhere), so the copy holds exactly the
values the in-GEMM dequantisation feeds the MMAs. Twin: `dequant_mxfp4_ref` (quant.dequantize).
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.moe.mxfp4_codec import _dequant, _fast_cvt
from mimo_fn.quant import MX_GROUP, MXFP4, QTensor, check_mxfp4, dequantize

BLOCK_R, BLOCK_C = 16, 512  # 256 packed bytes a row: whole 128-byte lines in, 1 KB (bf16) a row out


@triton.jit
def _dequant_mxfp4_kernel(
    q_ptr, s_ptr, out_ptr, R, C2, G,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FAST_CVT: tl.constexpr,
):
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs_b = tl.program_id(1) * (BLOCK_C // 2) + tl.arange(0, BLOCK_C // 2)
    offs_g = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    r_ok = offs_r < R
    q = tl.load(q_ptr + offs_r[:, None] * C2 + offs_b[None, :], mask=r_ok[:, None] & (offs_b < C2)[None, :], other=0)
    s = tl.load(s_ptr + offs_r[:, None] * G + offs_g[None, :], mask=r_ok[:, None] & (offs_g < G)[None, :], other=0)
    lo, hi = _dequant(q, s, BLOCK_R, BLOCK_C, out_ptr.dtype.element_ty, FAST_CVT)
    w = tl.interleave(lo, hi)  # element 2j is byte j's low nibble, 2j + 1 its high one
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(out_ptr + offs_r[:, None] * (2 * C2) + offs_c[None, :], w, mask=r_ok[:, None] & (offs_c < 2 * C2)[None, :])


def _check(q: QTensor, dtype: torch.dtype) -> None:
    if q.fmt != MXFP4:
        raise ValueError(f"dequant_mxfp4: format {q.fmt!r}; expected {MXFP4!r}")
    check_mxfp4("dequant_mxfp4", q)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dequant_mxfp4: dtype {dtype}; expected bf16, fp16 or fp32")


@typed
def dequant_mxfp4_ref(q: QTensor, dtype: torch.dtype = torch.bfloat16) -> Float[Tensor, "*E N K"]:
    """Plain torch: `quant.dequantize` behind the kernel's argument checks."""
    _check(q, dtype)
    return dequantize(q, dtype)


@typed
def dequant_mxfp4(q: QTensor, dtype: torch.dtype = torch.bfloat16, fast: bool | None = None) -> Float[Tensor, "*E N K"]:
    """The dense weights of an MXFP4 QTensor (logical shape, `dtype` bf16 / fp16 / fp32), as
    `dequant_mxfp4_ref` computes them. fast: the PTX dequantisation (None: mxfp4_codec's default)."""
    _check(q, dtype)
    data, scale = q.data.contiguous(), q.scale.contiguous()
    c2 = data.shape[-1]
    rows = data.numel() // c2 if c2 else 0
    out = torch.empty(*data.shape[:-1], 2 * c2, dtype=dtype, device=data.device)
    if out.numel():
        grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(2 * c2, BLOCK_C))
        _dequant_mxfp4_kernel[grid](data, scale, out, rows, c2, 2 * c2 // MX_GROUP, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                                    FAST_CVT=_fast_cvt(dtype, data.is_cuda, fast), num_warps=4)
    return out
