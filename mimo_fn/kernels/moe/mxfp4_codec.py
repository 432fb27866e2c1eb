"""MXFP4 weights decoded inside Triton kernels: packed E2M1 codes and E8M0 scales -> bf16 / fp16 / fp32.

Legend: N rows of a weight tile, K its columns (a GEMM's reduction dim); a tile holds K / 2
packed bytes and K / 32 scales a row.

Format (mimo_fn.quant.MXFP4): data uint8, element 2j in the low nibble of byte j and 2j + 1 in
the high one; E8M0 scales uint8, one per 32 elements of a row, W = value(code) * 2^(s - 127).
An E2M1 value times a power of two is exact in bf16 and fp32, so the values decoded here are
exactly `quant.dequantize(w, dtype)`.

Two ways with the same result:
- portable (the interpreter, fp16 / fp32, CUDA with MIMO_FN_MXFP4_FAST_CVT=0): per code, fp32
  bits of the E2M1 value built with integer ops (magnitude code m: exponent field m >> 1,
  mantissa bit m & 1; m = 1 is 0.5, the format's only subnormal), times the fp32 group scale,
  cast to the output dtype;
- FAST_CVT (CUDA, bf16): inline PTX that turns 4 packed bytes (8 codes) into 8 bf16, two codes
  a 32-bit register (a byte permute, a mask, a multiply and a mask each), then two bf16x2 FMAs
  (by 2^126, which rebiases the exponent and lifts 0.5 out of the subnormal the bit placement
  leaves it in; then by the group scale). Where the GEMMs stream weights (decode sizes) the
  dequantisation's instructions, not memory, set the speed: compiled for sm_90 the decode K
  loops take ~4.3 instructions a weight with it (SPLIT_DOT configs) and ~11 with the portable one.
Used by the in-GEMM kernels (mxfp4.py) and the bulk copy (mxfp4_dequant.py), so both feed the
MMAs the same values.
"""

import torch
import triton
import triton.language as tl

from mimo_fn import options


@triton.jit
def _e8m0_to_f32(s):
    """E8M0 scale bytes -> fp32 2^(s - 127); 0 is 2^-127 (an fp32 subnormal), 255 NaN (as in quant)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return tl.where(s == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> fp32 values. Magnitude code m >= 2 is 2^((m >> 1) - 1) *
    (1 + (m & 1) / 2): m << 22 puts m >> 1 in the exponent field and m & 1 in the top mantissa
    bit, and 126 << 23 rebiases the exponent; m = 1 (0.5) and m = 0 (0) are m * (126 << 23)."""
    m = c & 7
    bits = tl.where(m > 1, (m << 22) + 0x3F000000, (m & 1) * 0x3F000000)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_bf16(s):
    """E8M0 scale bytes -> bf16 2^(s - 127) by integer ops: the exponent field is s; 0 is 2^-127
    (subnormal 0x0040), 255 NaN (0x7FC0)."""
    s = s.to(tl.int32)
    bits = tl.maximum(s << 7, 0x40) | (((s + 1) & 0x100) >> 2)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _group_scales(s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_N, BLOCK_K / 32] -> one per packed byte [BLOCK_N, BLOCK_K / 2] (16 bytes a group)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _dequant_portable(q, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
    q = q.to(tl.int32)
    s_b = _group_scales(_e8m0_to_f32(s), BLOCK_N, BLOCK_K)
    return (_e2m1_to_f32(q & 15) * s_b).to(DTYPE), (_e2m1_to_f32(q >> 4) * s_b).to(DTYPE)


# Per 4 packed bytes $4 (byte i at bits 8i) and their bf16 scales $5 / $6 (of bytes 0, 1 / 2, 3,
# a pair each): $0 / $1 = the low-nibble values of bytes 0, 1 / 2, 3 and $2 / $3 the high-nibble
# ones, a bf16 per 16-bit half. prmt spreads bytes 0, 1 (p) and 2, 3 (q) into the two halves;
# one nibble is masked out of each half and multiplied by 2^6 + 2^12 (low nibble) or 2^2 + 2^8
# (high nibble): the two copies do not overlap, so the product places the magnitude bits at bf16
# bits 8:6 (exponent low bits, top mantissa bit) and the sign at bit 15, which the last mask
# keeps. That is the value times 2^-126, for 0.5 a subnormal: the bf16x2 FMA by 2^126 (0x7E80,
# adding -0) is exact and normalises it, then the FMA by the group scale.
_E2M1X8_ASM = tl.constexpr("""
{
.reg .b32 zero, p, q, t, bias, nz;
mov.b32 zero, 0;
mov.b32 bias, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 p, $4, zero, 0x4140;
prmt.b32 q, $4, zero, 0x4342;
and.b32 t, p, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, bias, nz;
fma.rn.bf16x2 $0, t, $5, nz;
and.b32 t, q, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, bias, nz;
fma.rn.bf16x2 $1, t, $6, nz;
and.b32 t, p, 0x00F000F0;
mul.lo.u32 t, t, 0x0104;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, bias, nz;
fma.rn.bf16x2 $2, t, $5, nz;
and.b32 t, q, 0x00F000F0;
mul.lo.u32 t, t, 0x0104;
and.b32 t, t, 0x81C081C0;
fma.rn.bf16x2 t, t, bias, nz;
fma.rn.bf16x2 $3, t, $6, nz;
}
""")


@triton.jit
def _dequant_fast_bf16(q, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # CUDA only (inline PTX). Every output element depends only on its own byte and scale, so the
    # result is right in whatever layout Triton gives the tensors.
    s_b = _group_scales(_e8m0_to_bf16(s), BLOCK_N, BLOCK_K)
    return tl.inline_asm_elementwise(
        _E2M1X8_ASM, "=r,=r,=r,=r,r,r,r", [q, s_b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
    )


@triton.jit
def _dequant(q, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, FAST_CVT: tl.constexpr):
    """Packed codes q uint8 [BLOCK_N, BLOCK_K / 2] and scales s uint8 [BLOCK_N, BLOCK_K / 32] ->
    (lo, hi) [BLOCK_N, BLOCK_K / 2] in DTYPE: the weights of the even and the odd columns."""
    if FAST_CVT:
        return _dequant_fast_bf16(q, s, BLOCK_N, BLOCK_K)
    else:
        return _dequant_portable(q, s, BLOCK_N, BLOCK_K, DTYPE)


def _fast_cvt(dtype: torch.dtype, on_cuda: bool, fast: bool | None) -> bool:
    """The PTX dequantisation: bf16 on CUDA unless fast is False or, with fast None,
    options.mxfp4_fast_cvt is off (MIMO_FN_MXFP4_FAST_CVT=0)."""
    if fast is None:
        fast = options.current().mxfp4_fast_cvt
    return fast and on_cuda and dtype == torch.bfloat16
