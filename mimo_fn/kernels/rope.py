"""Partial RoPE in place: the rotary dims of each q/k head rotated where they lie, one kernel.

Legend: T tokens, N heads, D head dim, R rope dim (pairs (i, i + R/2), "rotate half").

`mimo_fn.layers.rope.apply_rope` is the reference (and the CPU path) with the same arithmetic
and rounding: each product is rounded to x's dtype before the sum, and the sum again, as torch's
elementwise ops do, so the two agree bit for bit. The reference builds the result with two
torch.cat over whole heads; this kernel reads and writes only the R rotary dims of x. On an
H200 that took the prefill benchmark's "other" time at 64K tokens (6 layers, bf16) from 114
to 70 ms (docs/benchmarks.md).
"""

import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (fp32) rounded to `dtype` and back: what a torch elementwise op in that dtype stores."""
    if dtype == tl.float32:
        return x
    return cast_rne(x, dtype, INTERPRET).to(tl.float32)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xn, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (T, heads / BLOCK_N): one token's BLOCK_N heads, both halves of the rotary dims."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_i = tl.arange(0, BLOCK_H)
    i_ok = offs_i < HALF
    ok = (offs_n < num_heads)[:, None] & i_ok[None, :]
    dt: tl.constexpr = x_ptr.dtype.element_ty
    lo_ptrs = x_ptr + t * stride_xt + offs_n[:, None] * stride_xn + offs_i[None, :]
    x1 = tl.load(lo_ptrs, mask=ok, other=0.0).to(tl.float32)  # dims [0, R/2)
    x2 = tl.load(lo_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)  # dims [R/2, R)
    c1 = tl.load(cos_ptr + t * stride_ct + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); negation is exact
    o1 = _round(x1 * c1, dt, INTERPRET) + _round(-(x2 * s1), dt, INTERPRET)
    o2 = _round(x2 * c2, dt, INTERPRET) + _round(x1 * s2, dt, INTERPRET)
    tl.store(lo_ptrs, cast_rne(o1, dt, INTERPRET), mask=ok)
    tl.store(lo_ptrs + HALF, cast_rne(o2, dt, INTERPRET), mask=ok)


@typed
def rope_(x_TND: Float[Tensor, "T N D"], cos_TR: Float[Tensor, "T R"], sin_TR: Float[Tensor, "T R"]
          ) -> Float[Tensor, "T N D"]:
    """Rotate the first R dims of every head of x in place; returns x. cos/sin in x's dtype."""
    rope_dim = cos_TR.shape[-1]
    if rope_dim % 2 or rope_dim > x_TND.shape[-1] or sin_TR.shape != cos_TR.shape:
        raise ValueError(f"rope_: cos_TR and sin_TR must share an even rope dim R <= D={x_TND.shape[-1]}; "
                         f"got {tuple(cos_TR.shape)} and {tuple(sin_TR.shape)}")
    if cos_TR.dtype != x_TND.dtype or sin_TR.dtype != x_TND.dtype:
        raise ValueError(f"rope_: cos/sin dtype {cos_TR.dtype}/{sin_TR.dtype} must equal x's {x_TND.dtype}")
    if x_TND.stride(-1) != 1 or cos_TR.stride(-1) != 1 or sin_TR.stride(-1) != 1:
        raise ValueError("rope_: x_TND, cos_TR and sin_TR must be contiguous in their last dim")
    num_tokens, num_heads, _ = x_TND.shape
    if num_tokens == 0 or num_heads == 0:
        return x_TND
    half = rope_dim // 2
    block_n = min(16, triton.next_power_of_2(num_heads))
    _rope_kernel[(num_tokens, triton.cdiv(num_heads, block_n))](
        x_TND, cos_TR, sin_TR, num_heads, x_TND.stride(0), x_TND.stride(1), cos_TR.stride(0), sin_TR.stride(0),
        HALF=half, BLOCK_H=triton.next_power_of_2(half), BLOCK_N=block_n, INTERPRET=not x_TND.is_cuda,
        num_warps=4, enable_fp_fusion=False,  # no FMA: torch multiplies and adds separately (fp32 too)
    )
    return x_TND

