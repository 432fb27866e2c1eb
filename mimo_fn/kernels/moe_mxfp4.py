"""Grouped expert GEMMs with MXFP4 expert weights and unquantised activations ("W4A16").

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token,
P = T*K (token, k) pairs, M padded slots of the aligned layout (see moe_align), N a GEMM's
output dim, R its reduction dim (H for the up GEMM, I for the down GEMM), R2 = R / 2 packed
bytes, G = R / 32 scale groups.

Format (mimo_fn.quant.MXFP4): w13 is logically [E, 2I, H] (gate rows 0:I, then up rows I:2I),
w2 [E, H, I]; each QTensor holds data uint8 [E, N, R2], element 2j in the low nibble of byte j
and 2j + 1 in the high one, and E8M0 scales uint8 [E, N, G], W = value(code) * 2^(s - 127).

The stages are those of moe_gemm's bf16 path, over the same moe_align layout:
up:   h[s] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T) per slot s (pair p = t*K + k of expert e),
      gate and up accumulators in one program, SiLU*up in fp32, h stored in x's dtype;
down: y[p] = w_p * (h[s] @ W2[e]^T) per pair row (no atomics);
sum:  out[t] = sum_k y[t*K + k] in fp32 (moe_gemm._moe_sum_topk).
(From DEQUANT_MIN_PAIRS pairs an expert `fused_moe_mxfp4` runs moe_gemm's bf16 kernels on a
dequantised copy of the weights instead: mxfp4_dequant; the same values, faster at prefill sizes.)
In the kernels here each K step loads a [BLOCK_N, BLOCK_K / 2] tile of packed bytes and its [BLOCK_N, BLOCK_K / 32]
scales with plain pointer loads and dequantises them in registers into x's dtype before the
dot (fp32 accumulation). An E2M1 value times a power of two is exact in bf16 and fp32, so the
weights the dot sees are exactly `dequantize(w, x.dtype)`: the kernel differs from
`moe_ref.fused_moe_mxfp4_ref` only by accumulation order (and the reference's bf16 rounding of
gate / up / SiLU, which the kernel does in fp32).

Dequantisation, two ways with the same result:
- portable (the interpreter, fp16 / fp32 x, CUDA with MIMO_FN_MXFP4_FAST_CVT=0): per code, fp32
  bits of the E2M1 value built with integer ops (magnitude code m: exponent field m >> 1,
  mantissa bit m & 1; m = 1 is 0.5, the format's only subnormal), times the fp32 group scale,
  cast to x's dtype;
- FAST_CVT (CUDA, bf16 x): inline PTX that turns 4 packed bytes (8 codes) into 8 bf16, two codes
  a 32-bit register (a byte permute, a mask, a multiply and a mask each), then two bf16x2 FMAs
  (by 2^126, which rebiases the exponent and lifts 0.5 out of the subnormal the bit placement
  leaves it in; then by the group scale). At decode sizes the GEMMs stream weights, and the
  dequantisation's instructions, not memory, set the speed: compiled for sm_90 the decode K
  loops take ~4.3 instructions a weight with it (SPLIT_DOT configs) and ~11 with the portable one.
"""

import os

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.kernels.moe_align import MoeAlignment, moe_align
from mimo_fn.kernels.moe_gemm_kernels import _tile_ids
from mimo_fn.kernels.moe_ref import check_mxfp4_weights, moe_shapes
from mimo_fn.quant import QTensor

# ------------------------------------------------------------------------------- dequantisation


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


@triton.jit
def _load_scales(ptrs, n_ok, offs_g, k_left):
    # the next K step's scales ([BLOCK_N, BLOCK_K / 32] bytes, zeros past K). Too narrow per row
    # for the async-copy pipeline, so the kernels load them one K step ahead into registers,
    # where their latency hides under a step of dequantisation instead of stalling each step
    return tl.load(ptrs, mask=n_ok[:, None] & (offs_g < k_left // 32)[None, :], other=0)


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr, SWAP_AB: tl.constexpr):
    # a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T into fp32 acc [BLOCK_M, BLOCK_N], or with
    # SWAP_AB the transposed product into acc [BLOCK_N, BLOCK_M]: the dequantised weights are
    # the MMA's A operand (which the tensor cores can read from registers) and the rows its N
    if SWAP_AB:
        if IEEE:
            return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(a), acc)
    else:
        if IEEE:
            return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _mma_halves(a, a_even, a_odd, lo, hi, acc, IEEE: tl.constexpr, SWAP_AB: tl.constexpr,
                SPLIT_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    # SPLIT_DOT: x's even columns against lo and its odd ones against hi, two dots of BLOCK_K / 2.
    # The dequantised pairs then stay as the PTX produced them (two codes' lo values a register),
    # which is the K order of an mma.sync B fragment, instead of being re-paired by byte (a byte
    # permute per pair); the price is splitting x, which at BLOCK_M <= 32 is a few registers.
    if INTERPRET:  # the interpreter's dot multiplies bf16 bit patterns as integers
        lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    if SPLIT_DOT:
        acc = _mma(a_even, lo, acc, IEEE, SWAP_AB)
        return _mma(a_odd, hi, acc, IEEE, SWAP_AB)
    else:
        return _mma(a, tl.interleave(lo, hi), acc, IEEE, SWAP_AB)


@triton.jit
def _split_cols(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_DOT: tl.constexpr, INTERPRET: tl.constexpr):
    # (a, a_even, a_odd) for _mma_halves; the halves only with SPLIT_DOT
    if INTERPRET:
        a = a.to(tl.float32)
    if SPLIT_DOT:
        a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
        return a, a_even, a_odd
    else:
        return a, a, a


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _acc_rows(acc, SWAP_AB: tl.constexpr):
    # the accumulator as [BLOCK_M, BLOCK_N]
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


# ------------------------------------------------------------------------------- kernels
# The per-launch sizes are not specialised (divisible by 16 or not): one binary serves every T.


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "size_bucket"])
def _mxfp4_up_kernel(
    x_ptr, w_ptr, ws_ptr, h_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_pad_ptr,
    num_pairs, num_slots, N, K, size_bucket,
    stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    stride_hm, stride_hn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, FAST_CVT: tl.constexpr,
    INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr = False, SPLIT_DOT: tl.constexpr = False,
):
    # one program per [BLOCK_M, BLOCK_N] tile of h over the upper bound of padded slots (no host
    # sync): programs past the used slots exit
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(num_slots, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(num_post_pad_ptr):
        e = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs  # padding slots compute zeros: rows the down GEMM never stores
        tok = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk
        g_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_b[None, :] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn  # up rows follow the I gate rows
        gs_ptrs = ws_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sg
        us_ptrs = gs_ptrs + N * stride_sn
        acc_g = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        acc_u = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        sg_next = _load_scales(gs_ptrs, n_ok, offs_g, K)
        su_next = _load_scales(us_ptrs, n_ok, offs_g, K)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            sg, su = sg_next, su_next
            gs_ptrs += (BLOCK_K // 32) * stride_sg
            us_ptrs += (BLOCK_K // 32) * stride_sg
            sg_next = _load_scales(gs_ptrs, n_ok, offs_g, k_left - BLOCK_K)
            su_next = _load_scales(us_ptrs, n_ok, offs_g, k_left - BLOCK_K)
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                qg = tl.load(g_ptrs, mask=n_ok[:, None], other=0)
                qu = tl.load(u_ptrs, mask=n_ok[:, None], other=0)
            else:  # R is a multiple of 32, BLOCK_K of 64: the tail is whole bytes and groups
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
                b_ok = n_ok[:, None] & (offs_b < k_left // 2)[None, :]
                qg = tl.load(g_ptrs, mask=b_ok, other=0)  # code 0 is +0 under any scale but NaN's
                qu = tl.load(u_ptrs, mask=b_ok, other=0)
            a, a_even, a_odd = _split_cols(a, BLOCK_M, BLOCK_K, SPLIT_DOT, INTERPRET)
            lo, hi = _dequant(qg, sg, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, FAST_CVT)
            acc_g = _mma_halves(a, a_even, a_odd, lo, hi, acc_g, IEEE, SWAP_AB, SPLIT_DOT, INTERPRET)
            lo, hi = _dequant(qu, su, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, FAST_CVT)
            acc_u = _mma_halves(a, a_even, a_odd, lo, hi, acc_u, IEEE, SWAP_AB, SPLIT_DOT, INTERPRET)
            a_ptrs += BLOCK_K * stride_xk
            g_ptrs += (BLOCK_K // 2) * stride_wk
            u_ptrs += (BLOCK_K // 2) * stride_wk
        acc_g, acc_u = _acc_rows(acc_g, SWAP_AB), _acc_rows(acc_u, SWAP_AB)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
        tl.store(h_ptrs, cast_rne(h, h_ptr.dtype.element_ty, INTERPRET), mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_slots", "size_bucket"])
def _mxfp4_down_kernel(
    h_ptr, w_ptr, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_pad_ptr,
    num_pairs, num_slots, N, K, size_bucket,
    stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
    stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, FAST_CVT: tl.constexpr,
    INTERPRET: tl.constexpr, SWAP_AB: tl.constexpr = False, SPLIT_DOT: tl.constexpr = False,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(num_slots, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(num_post_pad_ptr):
        e = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_b = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_k[None, :] * stride_hk  # slot order
        b_ptrs = w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_b[None, :] * stride_wk
        s_ptrs = ws_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sg
        acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
        sb_next = _load_scales(s_ptrs, n_ok, offs_g, K)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            sb = sb_next
            s_ptrs += (BLOCK_K // 32) * stride_sg
            sb_next = _load_scales(s_ptrs, n_ok, offs_g, k_left - BLOCK_K)
            if EVEN_K:
                a = tl.load(a_ptrs)
                qb = tl.load(b_ptrs, mask=n_ok[:, None], other=0)
            else:
                a = tl.load(a_ptrs, mask=(offs_k < k_left)[None, :], other=0.0)
                qb = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_b < k_left // 2)[None, :], other=0)
            a, a_even, a_odd = _split_cols(a, BLOCK_M, BLOCK_K, SPLIT_DOT, INTERPRET)
            lo, hi = _dequant(qb, sb, BLOCK_N, BLOCK_K, h_ptr.dtype.element_ty, FAST_CVT)
            acc = _mma_halves(a, a_even, a_odd, lo, hi, acc, IEEE, SWAP_AB, SPLIT_DOT, INTERPRET)
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += (BLOCK_K // 2) * stride_wk
        acc = _acc_rows(acc, SWAP_AB)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        acc *= tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------- launch configs


def _cfg(bn: int, bk: int, warps: int, stages: int, group_m: int = 8, swap: bool = False,
         split: bool = False) -> triton.Config:
    meta = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "SWAP_AB": swap, "SPLIT_DOT": split}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# (up configs, down configs) per dot kind; the first of each is the untuned default. BLOCK_K is
# a multiple of 64: whole 32-groups, and a packed tile at least 32 bytes wide. Notes from
# compiling for sm_90 (triton 3.9; K-loop instructions per dequantised weight and thread, no
# spills) and one H200 (2026-12, triton 3.6, E=256 H=4096 I=2048, bench_moe_mxfp4.py):
# - weights as the B operand go registers -> shared memory -> wgmma, and Triton waits for each
#   wgmma before the next K step's dequantisation (dequantisation and MMA in series); as the A
#   operand (SWAP_AB) they stay in registers and the wgmma runs async under the next step's
#   dequantisation, at ~20% more instructions (the byte tile is read from shared memory in the
#   A-fragment layout). SWAP_AB with SPLIT_DOT loses the async wgmma, so no list pairs them.
# - SPLIT_DOT saves the byte permutes that re-pair dequantised values and, at BLOCK_M 16 (mma.sync),
#   the register moves of x's fragments: 5.7 -> 4.3 instructions a weight for the decode up GEMM.
# - the tuner's picks (two runs, all kernels tuned in the second): up GEMM SWAP_AB with 64-wide
#   tiles at 4K and 16K tokens (128-wide at 4K once), down GEMM 128-wide tiles, swapped or not
#   (within ~1%); at decode sizes SPLIT_DOT, 64 x 128 (up) and 128 x 128 (down) tiles. Layer
#   speed then: 385-389 / 405 TFLOP/s at 4K / 16K tokens (bf16 445-474 / 634-673, FP8 494-514 /
#   686); 44-48% of the copy bandwidth at 8 and 64 tokens, a few % behind FP8's time. The first
#   entries below are the configs the GPU tests ran by default.
_CONFIGS = {
    "bf16": (
        [_cfg(64, 64, 4, 4), _cfg(64, 64, 4, 4, split=True), _cfg(128, 64, 8, 3, split=True),
         _cfg(64, 64, 4, 4, swap=True), _cfg(128, 64, 8, 3, swap=True), _cfg(128, 64, 8, 4, swap=True)],
        [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 3, split=True), _cfg(256, 64, 8, 3, split=True),
         _cfg(128, 64, 8, 3, swap=True), _cfg(256, 64, 8, 3, swap=True)],
    ),
    # fp32 is a numerics path (IEEE products on FMA units); of the tiles tried at BLOCK_M 128 this
    # one spills least (the up GEMM some registers, the down GEMM none)
    "fp32": ([_cfg(32, 64, 8, 1)], [_cfg(32, 64, 8, 1)]),
}
# BLOCK_M <= SMALL_M (decode sizes: each GEMM streams its experts' weights once, and the
# dequantisation's instructions, not the MMA, set the speed): narrow N tiles and deep K steps
# keep enough programs and bytes in flight while the few rows hardly matter.
SMALL_M = 32
_SMALL_M_CONFIGS = {
    "bf16": (
        [_cfg(64, 128, 4, 4, split=True), _cfg(128, 128, 4, 4, split=True), _cfg(64, 256, 4, 3, split=True),
         _cfg(64, 128, 4, 4, swap=True)],
        [_cfg(128, 128, 4, 4, split=True), _cfg(64, 128, 4, 4, split=True), _cfg(128, 128, 8, 4, split=True),
         _cfg(64, 128, 4, 4, swap=True)],
    ),
}
# the interpreter (small tiles, so tests at small shapes walk several N tiles and K steps), with
# SPLIT_DOT where the CUDA lists use it
_INTERPRET_CFGS = {False: _cfg(64, 64, 4, 1), True: _cfg(64, 64, 4, 1, split=True)}
_TUNE_KEY = ["N", "K", "BLOCK_M", "size_bucket", "FAST_CVT"]
_HEURISTICS = {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0}
_up = triton.heuristics(_HEURISTICS)(_mxfp4_up_kernel)
_down = triton.heuristics(_HEURISTICS)(_mxfp4_down_kernel)


def _tuned(config_lists: dict) -> dict:
    return {kind: (triton.autotune(ups, key=_TUNE_KEY)(_up), triton.autotune(downs, key=_TUNE_KEY)(_down))
            for kind, (ups, downs) in config_lists.items()}


_TUNED, _TUNED_SMALL_M = _tuned(_CONFIGS), _tuned(_SMALL_M_CONFIGS)


def _kernel(kind: str, stage: int, on_cuda: bool, cfg: triton.Config | None, block_m: int):
    """(kernel, launch kwargs) for stage 0 (up) / 1 (down): `cfg` if given; the interpreter's
    config off CUDA; else autotuned unless MIMO_FN_MOE_AUTOTUNE=0 (then the list's first)."""
    if cfg is None and not on_cuda:
        cfg = _INTERPRET_CFGS[block_m <= SMALL_M]
    small = block_m <= SMALL_M and kind in _SMALL_M_CONFIGS
    if cfg is None and os.environ.get("MIMO_FN_MOE_AUTOTUNE", "1") != "0":
        return (_TUNED_SMALL_M if small else _TUNED)[kind][stage], {}
    cfg = cfg or (_SMALL_M_CONFIGS if small else _CONFIGS)[kind][stage][0]
    return (_up, _down)[stage], {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _grid(num_slots: int, block_m: int, n: int):
    return lambda meta: (triton.cdiv(num_slots, block_m) * triton.cdiv(n, meta["BLOCK_N"]),)


def _fast_cvt(dtype: torch.dtype, on_cuda: bool, fast: bool | None) -> bool:
    """The PTX dequantisation: bf16 on CUDA unless fast is False or MIMO_FN_MXFP4_FAST_CVT=0."""
    if fast is None:
        fast = os.environ.get("MIMO_FN_MXFP4_FAST_CVT", "1") != "0"
    return fast and on_cuda and dtype == torch.bfloat16


# ------------------------------------------------------------------------------- launchers


def _moe_up_mxfp4(x_TH: torch.Tensor, w13: QTensor, al: MoeAlignment, top_k: int,
                  cfg: triton.Config | None = None, fast: bool | None = None) -> torch.Tensor:
    """The up GEMM + SiLU*up over moe_align's slots: h_MI in x's dtype (padding rows zero)."""
    dev = x_TH.device
    num_slots, inter, hid = al.sorted_ids_M.numel(), w13.shape[1] // 2, x_TH.shape[1]
    h_MI = torch.empty(num_slots, inter, dtype=x_TH.dtype, device=dev)
    kind = "fp32" if x_TH.dtype == torch.float32 else "bf16"
    kernel, meta = _kernel(kind, 0, x_TH.is_cuda, cfg, al.block_m)
    kernel[_grid(num_slots, al.block_m, inter)](
        x_TH, w13.data, w13.scale, h_MI, al.sorted_ids_M, al.expert_of_block_NB, al.num_tokens_post_pad_1,
        al.num_pairs, num_slots, inter, hid, triton.next_power_of_2(al.num_pairs),  # tune per size octave
        *x_TH.stride(), *w13.data.stride(), *w13.scale.stride(), *h_MI.stride(),
        TOP_K=top_k, BLOCK_M=al.block_m, IEEE=kind == "fp32",
        FAST_CVT=_fast_cvt(x_TH.dtype, x_TH.is_cuda, fast), INTERPRET=not x_TH.is_cuda, **meta,
    )
    return h_MI


def _moe_down_mxfp4(h_MI: torch.Tensor, w2: QTensor, al: MoeAlignment, topk_weights_TK: torch.Tensor,
                    cfg: triton.Config | None = None, fast: bool | None = None) -> torch.Tensor:
    """The down GEMM times the router weight: y_PH, row p = t*K + k for every valid pair (rows
    of dropped pairs are not written), in h's dtype."""
    dev = h_MI.device
    num_slots, hid, inter = h_MI.shape[0], w2.shape[1], w2.shape[2]
    y_PH = torch.empty(al.num_pairs, hid, dtype=h_MI.dtype, device=dev)
    weights_P = topk_weights_TK.contiguous().view(-1)
    kind = "fp32" if h_MI.dtype == torch.float32 else "bf16"
    kernel, meta = _kernel(kind, 1, h_MI.is_cuda, cfg, al.block_m)
    kernel[_grid(num_slots, al.block_m, hid)](
        h_MI, w2.data, w2.scale, y_PH, weights_P, al.sorted_ids_M, al.expert_of_block_NB,
        al.num_tokens_post_pad_1, al.num_pairs, num_slots, hid, inter, triton.next_power_of_2(al.num_pairs),
        *h_MI.stride(), *w2.data.stride(), *w2.scale.stride(), *y_PH.stride(),
        BLOCK_M=al.block_m, IEEE=kind == "fp32",
        FAST_CVT=_fast_cvt(h_MI.dtype, h_MI.is_cuda, fast), INTERPRET=not h_MI.is_cuda, **meta,
    )
    return y_PH


def _check_operands(x_TH, w13, w2, topk_ids_TK, topk_weights_TK) -> None:
    check_mxfp4_weights("fused_moe_mxfp4", w13, w2)
    moe_shapes("fused_moe_mxfp4", x_TH, w13, w2, topk_ids_TK, topk_weights_TK)
    if x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe_mxfp4: x must be bf16, fp16 or fp32, got {x_TH.dtype}")
    if w13.data.stride(-1) != 1 or w2.data.stride(-1) != 1:
        raise ValueError("fused_moe_mxfp4: MXFP4 data must be contiguous along K (packed bytes in a row)")


# Pairs per expert from which fused_moe_mxfp4 dequantises the experts into a bf16 copy and runs
# moe_gemm's bf16 kernels (mxfp4_dequant). One H200 (2026-12-02, E=256 H=4096 I=2048, balanced
# routing, bench_moe_mxfp4.py, in-GEMM kernels tuned, bf16 at default configs), layer ms in-GEMM
# / copy path: 4K tokens (128 pairs an expert) 4.13 / 7.97, 8K 8.13 / 9.69, 16K (512) 15.80 /
# 14.55, 32K 31.65 / 24.26, 64K 62.68 / 43.53. The copies (w13 then w2) took 2.96 + 1.48 ms at
# 87% of the copy bandwidth; the crossover lies between 8K and 16K tokens.
DEQUANT_MIN_PAIRS = 512


def dequantize_first(pairs_per_expert: float, on_cuda: bool) -> bool:
    """Whether fused_moe_mxfp4 takes the dequantised-copy path: on CUDA from DEQUANT_MIN_PAIRS
    pairs an expert (MIMO_FN_MXFP4_DEQUANT=0 never, =1 at any size). The copy costs a pass over
    the experts' weights whatever the token count; the bf16 GEMMs save time in proportion to it."""
    env = os.environ.get("MIMO_FN_MXFP4_DEQUANT")
    if env in ("0", "1"):
        return env == "1"
    return on_cuda and pairs_per_expert >= DEQUANT_MIN_PAIRS


@typed
def fused_moe_mxfp4(
    x_TH: Float[Tensor, "T H"],
    w13: QTensor,
    w2: QTensor,
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    block_m: int | None = None,
    dequantize: bool | None = None,
    pairs_per_expert: float | None = None,
) -> Float[Tensor, "T H"]:
    """MoE experts on MXFP4 weights (w13 [E, 2I, H], w2 [E, H, I] logically), activations in x's
    dtype (bf16 / fp16 / fp32), output in x's dtype; H and I multiples of 32. Twin:
    `moe_ref.fused_moe_mxfp4_ref`. block_m: rows per aligned block (None: moe_gemm's heuristic,
    as for FP8 weights: also 16 / 32 rows at decode sizes, where the GEMMs stream weights).
    dequantize: run moe_gemm's dense kernels on a copy of the weights dequantised to x's dtype
    (one GEMM's worth at a time, freed after it) instead of dequantising in the GEMMs; None:
    `dequantize_first` decides by pairs per expert. Both compute the same function.
    pairs_per_expert: the valid pairs an expert gets, for these choices (None: T * K / E; see
    moe_gemm.moe_experts)."""
    # moe_gemm imports this module for its MXFP4 dispatch, so its helpers are imported here
    from mimo_fn.kernels.moe_gemm import _moe_down, _moe_sum_topk, _moe_up, _pairs, default_block_m
    from mimo_fn.kernels.mxfp4_dequant import dequant_mxfp4

    _check_operands(x_TH, w13, w2, topk_ids_TK, topk_weights_TK)
    t, hid = x_TH.shape
    num_experts, top_k = w13.shape[0], topk_ids_TK.shape[1]
    if t * top_k == 0:
        return torch.zeros(t, hid, dtype=x_TH.dtype, device=x_TH.device)
    per_expert = t * top_k / num_experts if pairs_per_expert is None else pairs_per_expert
    if dequantize is None:
        dequantize = dequantize_first(per_expert, x_TH.is_cuda)
    bm = block_m or default_block_m(_pairs(t * top_k, num_experts, pairs_per_expert), num_experts, fp8=not dequantize)
    al = moe_align(topk_ids_TK, num_experts, bm)
    if dequantize:  # each dense copy lives only through its GEMM
        h_MI, _ = _moe_up(x_TH, None, dequant_mxfp4(w13, x_TH.dtype), None, al, top_k, x_TH.dtype,
                          pairs_per_expert=pairs_per_expert)
        y_PH = _moe_down(h_MI, None, dequant_mxfp4(w2, x_TH.dtype), None, al, topk_weights_TK, x_TH.dtype,
                         pairs_per_expert=pairs_per_expert)
    else:
        h_MI = _moe_up_mxfp4(x_TH, w13, al, top_k)
        y_PH = _moe_down_mxfp4(h_MI, w2, al, topk_weights_TK)
    return _moe_sum_topk(y_PH, topk_ids_TK, num_experts, x_TH.dtype)
