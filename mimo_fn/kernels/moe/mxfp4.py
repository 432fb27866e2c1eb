"""Grouped expert GEMMs with MXFP4 expert weights and unquantised activations ("W4A16").

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token,
P = T*K (token, k) pairs, M padded slots of the aligned layout (see align.py), N a GEMM's
output dim, R its reduction dim (H for the up GEMM, I for the down GEMM), R2 = R / 2 packed
bytes, G = R / 32 scale groups.

Format (mimo_fn.quant.MXFP4, decoded by mxfp4_codec.py): w13 is logically [E, 2I, H] (gate rows
0:I, then up rows I:2I), w2 [E, H, I]; each QTensor holds data uint8 [E, N, R2] and E8M0 scales
uint8 [E, N, G].

The stages are those of gemm.py's bf16 path, over the same align.py layout:
up:   h[s] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T) per slot s (pair p = t*K + k of expert e),
      gate and up accumulators in one program, SiLU*up in fp32, h stored in x's dtype;
down: y[p] = w_p * (h[s] @ W2[e]^T) per pair row (no atomics);
sum:  out[t] = sum_k y[t*K + k] in fp32 (gemm._moe_sum_topk).
In the kernels here each K step loads a [BLOCK_N, BLOCK_K / 2] tile of packed bytes and its
[BLOCK_N, BLOCK_K / 32] scales with plain pointer loads and dequantises them in registers into
x's dtype before the dot (fp32 accumulation), so the dot sees exactly `dequantize(w, x.dtype)`:
the kernel differs from `ref.fused_moe_mxfp4_ref` only by accumulation order (and the
reference's bf16 rounding of gate / up / SiLU, which the kernel does in fp32).

From DEQUANT_MIN_PAIRS pairs an expert the dispatch (dispatch.fused_moe_mxfp4) runs gemm.py's
bf16 kernels on a dequantised copy of the weights instead (mxfp4_dequant.py): the same values,
faster at prefill sizes; `dequantize_first` is that rule.
"""

import torch
import triton
import triton.language as tl

from mimo_fn import options
from mimo_fn.kernels.autotune_cache import Persisted
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.kernels.moe.gemm_kernels import _tile_ids
from mimo_fn.kernels.moe.mxfp4_codec import _dequant, _fast_cvt
from mimo_fn.kernels.moe.ref import check_mxfp4_weights, moe_shapes
from mimo_fn.quant import QTensor

# ------------------------------------------------------------------------------- MMA helpers


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
# compiling for sm_90 (K-loop instructions per dequantised weight and thread, no spills) and
# from tuning on an H200 at the model's dims (python -m mimo_fn.bench moe-mxfp4; results in docs/benchmarks.md):
# - weights as the B operand go registers -> shared memory -> wgmma, and Triton waits for each
#   wgmma before the next K step's dequantisation (dequantisation and MMA in series); as the A
#   operand (SWAP_AB) they stay in registers and the wgmma runs async under the next step's
#   dequantisation, at ~20% more instructions (the byte tile is read from shared memory in the
#   A-fragment layout). SWAP_AB with SPLIT_DOT loses the async wgmma, so no list pairs them.
# - SPLIT_DOT saves the byte permutes that re-pair dequantised values and, at BLOCK_M 16 (mma.sync),
#   the register moves of x's fragments: 5.7 -> 4.3 instructions a weight for the decode up GEMM.
# - the tuner picks the up GEMM SWAP_AB with 64- or 128-wide tiles at prefill sizes, the down GEMM
#   128-wide tiles (swapped or not about equal); at decode sizes SPLIT_DOT, 64 x 128 (up) and
#   128 x 128 (down) tiles. The first entries below are the configs the GPU tests ran by default.
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
    """Per kind, the (up, down) autotuners, their picks kept across processes (kernels.autotune_cache)."""
    return {kind: (Persisted(triton.autotune(ups, key=_TUNE_KEY)(_up)),
                   Persisted(triton.autotune(downs, key=_TUNE_KEY)(_down)))
            for kind, (ups, downs) in config_lists.items()}


_TUNED, _TUNED_SMALL_M = _tuned(_CONFIGS), _tuned(_SMALL_M_CONFIGS)


def _kernel(kind: str, stage: int, on_cuda: bool, cfg: triton.Config | None, block_m: int):
    """(kernel, launch kwargs) for stage 0 (up) / 1 (down): `cfg` if given; the interpreter's
    config off CUDA; else autotuned unless options.moe_autotune is off (then the list's first)."""
    if cfg is None and not on_cuda:
        cfg = _INTERPRET_CFGS[block_m <= SMALL_M]
    small = block_m <= SMALL_M and kind in _SMALL_M_CONFIGS
    if cfg is None and options.current().moe_autotune:
        return (_TUNED_SMALL_M if small else _TUNED)[kind][stage], {}
    cfg = cfg or (_SMALL_M_CONFIGS if small else _CONFIGS)[kind][stage][0]
    return (_up, _down)[stage], {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _grid(num_slots: int, block_m: int, n: int):
    return lambda meta: (triton.cdiv(num_slots, block_m) * triton.cdiv(n, meta["BLOCK_N"]),)


# ------------------------------------------------------------------------------- launchers


def _moe_up_mxfp4(x_TH: torch.Tensor, w13: QTensor, al: MoeAlignment, top_k: int,
                  cfg: triton.Config | None = None, fast: bool | None = None) -> torch.Tensor:
    """The up GEMM + SiLU*up over align.py's slots: h_MI in x's dtype (padding rows zero)."""
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


def check_operands(x_TH, w13, w2, topk_ids_TK, topk_weights_TK) -> None:
    """ValueError naming what is wrong with an MXFP4 MoE call's operands (the kernels' requirements)."""
    check_mxfp4_weights("fused_moe_mxfp4", w13, w2)
    moe_shapes("fused_moe_mxfp4", x_TH, w13, w2, topk_ids_TK, topk_weights_TK)
    if x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe_mxfp4: x must be bf16, fp16 or fp32, got {x_TH.dtype}")
    if w13.data.stride(-1) != 1 or w2.data.stride(-1) != 1:
        raise ValueError("fused_moe_mxfp4: MXFP4 data must be contiguous along K (packed bytes in a row)")


# Pairs per expert from which the dispatch dequantises the experts into a bf16 copy and runs
# gemm.py's bf16 kernels (mxfp4_dequant.py). On one H200 at E=256 H=4096 I=2048 with balanced
# routing (python -m mimo_fn.bench moe-mxfp4), the in-GEMM path was faster up to 8K tokens (256 pairs an expert),
# the copy path from 16K (512) on and by more the more tokens: the copies cost a fixed pass over
# the weights (w13 then w2, near the copy bandwidth) whatever the token count.
DEQUANT_MIN_PAIRS = 512


def dequantize_first(pairs_per_expert: float, on_cuda: bool) -> bool:
    """Whether MXFP4 experts take the dequantised-copy path: on CUDA from DEQUANT_MIN_PAIRS pairs
    an expert, unless options.mxfp4_dequant forces it (MIMO_FN_MXFP4_DEQUANT=1 at any size, =0
    never). The copy costs a pass over the experts' weights whatever the token count; the bf16
    GEMMs save time in proportion to it."""
    forced = options.current().mxfp4_dequant
    if forced is not None:
        return forced
    return on_cuda and pairs_per_expert >= DEQUANT_MIN_PAIRS
