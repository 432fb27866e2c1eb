"""fp32 -> bf16 / float8_e4m3fn casts that round to nearest even on the GPU and in Triton's interpreter.

The GPU's cvt rounds to nearest even. Triton's CPU interpreter (triton 3.9) does not: it
truncates, and for e4m3 it drops the carry into the exponent when rounding crosses a power
of two (124.06 -> 64, not 128). There `cast_rne` first rounds onto the target grid in fp32
(integer arithmetic on the bit pattern; subnormal e4m3 through an add of 2^14, whose ulp is
the e4m3 spacing 2^-9 below 2^-6), so the interpreter's cast only moves exact values. Kernels
pass INTERPRET = not on CUDA; the GPU path is the plain cast.
"""

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (fp32) as `dtype` rounded to nearest even; for float8e4nv |x| <= 448 (callers clamp)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        if dtype == tl.bfloat16:
            x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        elif dtype == tl.float8e4nv:
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
            sub = (tl.abs(x) + 16384.0) - 16384.0
            x = tl.where(tl.abs(x) < 0.015625, tl.where(bits < 0, -sub, sub), normal)  # the sign bit: -0 stays -0
    return x.to(dtype)
