"""Triton kernels of the grouped expert GEMM over align.py's block_m-aligned segments
(launch configs, autotuning and the entry points: gemm.py).

Legend: T tokens, H hidden, I expert intermediate size, K experts per token, P = T*K
(token, k) pairs, M padded slots of the aligned layout; FP8 formats as in gemm.py.

up:   h[s] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T) for slot s holding pair p = t*K + k of
      expert e; one program owns a [BLOCK_M, BLOCK_N] tile of h and keeps both the gate and
      the up accumulator, so SiLU*up is the epilogue and the [P, 2I] product never exists.
down: y[p] = w_p * (h[s] @ W2[e]^T), written to row p (not summed in place: no atomics).
sum:  out[t] = sum_k y[t*K + k] over valid k, in fp32: deterministic; with a residual (HAS_RES)
      out[t] = res[t] + that sum rounded, as torch adds them: the decoder layer's residual add.
FP8: x is quantised per token in 1x128 groups once; the up epilogue quantises h per slot in
1x128 groups (BLOCK_N = 128 for the up GEMM), and each K step of 128 scales its partial
product by (activation group scale x weight block scale) before accumulating. Hopper's FP8
MMA accumulates each partial at reduced precision (~2^-13 of sum |x w|; Triton's default
max_num_imprecise_acc never promotes inside one 128-deep dot), so a few h land on the other
side of an e4m3 rounding midpoint than fp32 arithmetic puts them: tests/test_moe_kernels.py
bounds each stage. Promoting every 32 (MAX_IMPRECISE=32) quarters that error and costs ~40%.
Weights (and h in the down GEMM) load through TMA descriptors where their strides allow
(W_DESC), else through pointers; the gathered x rows of the up GEMM are always pointer loads.
PERSISTENT launches run one program per SM over the tiles (`_moe_up_kernel`'s comment).
HALF_TAILS: a block whose second half is padding (an expert's last block, about half the
time) computes its first half only (`_up_block`); its padding rows of h stay unwritten.
"""

import triton
import triton.language as tl

from mimo_fn.kernels.cast import cast_rne


@triton.jit
def _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # GROUP_M consecutive M blocks (mostly one expert) sweep N together: the expert's weight
    # columns are read from HBM once per group and hit L2 for the rest.
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@triton.jit
def _moe_up_kernel(
    x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr,
    sorted_ids_ptr, expert_of_block_ptr, num_post_pad_ptr,
    num_pairs, num_slots, N, K, size_bucket,
    stride_xt, stride_xk, stride_xst, stride_xsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_hm, stride_hn, stride_hsm, stride_hsg,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    EVEN_K: tl.constexpr, SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr, QUANT_H: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr = None, FUSED_GU: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False, NUM_PROGS: tl.constexpr = 1, HALF_TAILS: tl.constexpr = True,
):
    # PERSISTENT: NUM_PROGS programs (one per SM) stride over the used tiles, the tile loop
    # flattened with the K loop so the pipeliner loads the next tile's first K steps during
    # this tile's epilogue. Else one program per tile over the upper bound of padded slots
    # (no host sync): programs past the used slots exit.
    num_post_pad = tl.load(num_post_pad_ptr)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_pid_m = tl.cdiv(num_post_pad, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
            pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
            _up_block(
                pid_m, pid_n,
                x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr,
                expert_of_block_ptr, num_pairs, N, K, stride_xt, stride_xk, stride_xst, stride_xsg,
                stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hn,
                stride_hsm, stride_hsg, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K,
                SCALAR_WS, W_DESC, QUANT_H, MAX_IMPRECISE, FUSED_GU, HALF_TAILS,
            )
    else:
        pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(num_slots, BLOCK_M), num_pid_n, GROUP_M)
        if pid_m * BLOCK_M < num_post_pad:
            _up_block(
                pid_m, pid_n,
                x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr,
                expert_of_block_ptr, num_pairs, N, K, stride_xt, stride_xk, stride_xst, stride_xsg,
                stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hn,
                stride_hsm, stride_hsg, TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K,
                SCALAR_WS, W_DESC, QUANT_H, MAX_IMPRECISE, FUSED_GU, HALF_TAILS,
            )


@triton.jit
def _up_block(
    pid_m, pid_n,
    x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr, expert_of_block_ptr,
    num_pairs, N, K,
    stride_xt, stride_xk, stride_xst, stride_xsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_hm, stride_hn, stride_hsm, stride_hsg,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
    SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr, QUANT_H: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr, FUSED_GU: tl.constexpr, HALF_TAILS: tl.constexpr,
):
    # An expert's pairs fill its segment first, then padding: when the second half of block
    # pid_m is all padding (an expert's last block, half the time), compute the first half only.
    # Both the up and the down GEMM decide this from the same sorted_ids, so the rows left
    # unwritten here are never read.
    if HALF_TAILS and tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs:
        _up_tile(
            pid_m, pid_n,
            x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr,
            expert_of_block_ptr, num_pairs, N, K, stride_xt, stride_xk, stride_xst, stride_xsg,
            stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hn,
            stride_hsm, stride_hsg, TOP_K, BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K,
            SCALAR_WS, W_DESC, QUANT_H, MAX_IMPRECISE, FUSED_GU,
        )
    else:
        _up_tile(
            pid_m, pid_n,
            x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr,
            expert_of_block_ptr, num_pairs, N, K, stride_xt, stride_xk, stride_xst, stride_xsg,
            stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hn,
            stride_hsm, stride_hsg, TOP_K, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K,
            SCALAR_WS, W_DESC, QUANT_H, MAX_IMPRECISE, FUSED_GU,
        )


@triton.jit
def _up_tile(
    pid_m, pid_n,
    x_ptr, xs_ptr, w_ptr, w_desc, w3_desc, ws_ptr, h_ptr, hs_ptr, sorted_ids_ptr, expert_of_block_ptr,
    num_pairs, N, K,
    stride_xt, stride_xk, stride_xst, stride_xsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_hm, stride_hn, stride_hsm, stride_hsg,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
    SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr, QUANT_H: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr, FUSED_GU: tl.constexpr,
):
    # one [TILE_M, BLOCK_N] output tile: the first TILE_M rows of block pid_m
    e32 = tl.load(expert_of_block_ptr + pid_m)
    e = e32.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    # padding slots read token 0 (FP8) or zeros (dense): rows the down GEMM never stores. Zeros
    # cost no reads, and multiplying zeros takes the tensor cores less energy than data, which
    # sets the speed at the H200's power cap: the bf16 layer at 16K tokens (11% padding rows)
    # ran 3.4-3.6% faster. FP8 ran 0.6-1.4% slower with the row mask (docs/benchmarks.md, MoE).
    row_ok = pair < num_pairs
    tok = tl.where(row_ok, pair // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # the gathered x rows stay pointer loads: TMA on Hopper copies boxes, not row lists
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk
    if W_DESC:  # w_desc views w13 as [E * 2N, K]: gate rows e*2N + n, up rows N further on
        row_g = e32 * 2 * N + pid_n * BLOCK_N
    else:
        g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        u_ptrs = g_ptrs + N * stride_wn  # up rows follow the I gate rows
    if FP8:
        xs_ptrs = xs_ptr + tok * stride_xst
        if SCALAR_WS:  # the N tile lies inside one 128-row weight block: one scale per K step
            gs_ptrs = ws_ptr + e * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
            us_ptrs = ws_ptr + e * stride_wse + ((N + pid_n * BLOCK_N) // 128) * stride_wsn
        else:
            gs_ptrs = ws_ptr + e * stride_wse + (offs_n // 128) * stride_wsn
            us_ptrs = ws_ptr + e * stride_wse + ((N + offs_n) // 128) * stride_wsn
    acc_g = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    acc_gu = tl.zeros((TILE_M, 2 * BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K and FP8:
            a = tl.load(a_ptrs)
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if FUSED_GU:  # dense only: one N = 2 * BLOCK_N MMA reads the A tile once, not twice
            # w3_desc views w13 as [E * 2, N, K]: one box holds the gate rows and the up rows
            b = w3_desc.load([e32 * 2, pid_n * BLOCK_N, kb * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K).T
            if INTERPRET:
                a, b = a.to(tl.float32), b.to(tl.float32)
            if IEEE:
                acc_gu = tl.dot(a, b, acc_gu, input_precision="ieee")
            else:
                acc_gu = tl.dot(a, b, acc_gu)
        else:
            if W_DESC:  # TMA zero-fills the K tail; columns past N (gate tile) read up rows: masked below
                bg = w_desc.load([row_g, kb * BLOCK_K]).T
                bu = w_desc.load([row_g + N, kb * BLOCK_K]).T
            elif EVEN_K:
                bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if INTERPRET:  # interpreter only: its dot multiplies bf16 bit patterns as integers
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            if FP8:  # BLOCK_K == 128: step kb is activation group kb and weight block column kb
                a_s = tl.load(xs_ptrs + kb * stride_xsg)
                if SCALAR_WS:  # [BLOCK_M, 1]: one FMA per accumulator element
                    s_g = (a_s * tl.load(gs_ptrs + kb * stride_wsk))[:, None]
                    s_u = (a_s * tl.load(us_ptrs + kb * stride_wsk))[:, None]
                else:
                    s_g = a_s[:, None] * tl.load(gs_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)[None, :]
                    s_u = a_s[:, None] * tl.load(us_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)[None, :]
                # the scales change every K step, so each partial product is scaled on its own
                acc_g += tl.dot(a, bg, max_num_imprecise_acc=MAX_IMPRECISE) * s_g
                acc_u += tl.dot(a, bu, max_num_imprecise_acc=MAX_IMPRECISE) * s_u
            elif IEEE:
                acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
            if not W_DESC:
                g_ptrs += BLOCK_K * stride_wk
                u_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_xk
    if FUSED_GU:  # columns [0, BN) are gate, [BN, 2BN) up: a register relabelling in the MMA layout
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc_gu, (TILE_M, 2, BLOCK_N)), (0, 2, 1)))
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    rows = offs_m.to(tl.int64)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :] * stride_hn
    if QUANT_H:  # BLOCK_N == 128: this tile is exactly one 1x128 group of each row
        h = tl.where(n_ok[None, :], h, 0.0)  # columns past N stay out of the group's amax
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10), 448.0)
        q = tl.clamp(tl.div_rn(h, scale[:, None]), -448.0, 448.0)
        tl.store(h_ptrs, cast_rne(q, h_ptr.dtype.element_ty, INTERPRET), mask=n_ok[None, :])
        tl.store(hs_ptr + rows * stride_hsm + pid_n * stride_hsg, scale)
    else:
        tl.store(h_ptrs, cast_rne(h, h_ptr.dtype.element_ty, INTERPRET), mask=n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr,
    sorted_ids_ptr, expert_of_block_ptr, num_post_pad_ptr,
    num_pairs, num_slots, N, K, size_bucket,
    stride_hm, stride_hk, stride_hsm, stride_hsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    EVEN_K: tl.constexpr, SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr = None,
    PERSISTENT: tl.constexpr = False, NUM_PROGS: tl.constexpr = 1, HALF_TAILS: tl.constexpr = True,
):
    # PERSISTENT: NUM_PROGS programs (one per SM) stride over the used tiles, the tile loop
    # flattened with the K loop so the pipeliner loads the next tile's first K steps during
    # this tile's epilogue. Else one program per tile over the upper bound of padded slots
    # (no host sync): programs past the used slots exit.
    num_post_pad = tl.load(num_post_pad_ptr)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_pid_m = tl.cdiv(num_post_pad, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
            pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
            _down_block(
                pid_m, pid_n,
                h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr,
                expert_of_block_ptr, num_pairs, N, K, stride_hm, stride_hk, stride_hsm, stride_hsg,
                stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_yp, stride_yn,
                BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K, SCALAR_WS, W_DESC, MAX_IMPRECISE,
                HALF_TAILS,
            )
    else:
        pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(num_slots, BLOCK_M), num_pid_n, GROUP_M)
        if pid_m * BLOCK_M < num_post_pad:
            _down_block(
                pid_m, pid_n,
                h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr,
                expert_of_block_ptr, num_pairs, N, K, stride_hm, stride_hk, stride_hsm, stride_hsg,
                stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_yp, stride_yn,
                BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K, SCALAR_WS, W_DESC, MAX_IMPRECISE,
                HALF_TAILS,
            )


@triton.jit
def _down_block(
    pid_m, pid_n,
    h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr,
    num_pairs, N, K,
    stride_hm, stride_hk, stride_hsm, stride_hsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
    SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr, MAX_IMPRECISE: tl.constexpr, HALF_TAILS: tl.constexpr,
):
    # the first half of block pid_m only when its second half is padding (`_up_block`)
    if HALF_TAILS and tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_pairs:
        _down_tile(
            pid_m, pid_n,
            h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr,
            expert_of_block_ptr, num_pairs, N, K, stride_hm, stride_hk, stride_hsm, stride_hsg,
            stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_yp, stride_yn,
            BLOCK_M, BLOCK_M // 2, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K, SCALAR_WS, W_DESC, MAX_IMPRECISE,
        )
    else:
        _down_tile(
            pid_m, pid_n,
            h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr,
            expert_of_block_ptr, num_pairs, N, K, stride_hm, stride_hk, stride_hsm, stride_hsg,
            stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_yp, stride_yn,
            BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, FP8, IEEE, INTERPRET, EVEN_K, SCALAR_WS, W_DESC, MAX_IMPRECISE,
        )


@triton.jit
def _down_tile(
    pid_m, pid_n,
    h_ptr, h_desc, hs_ptr, w_ptr, w_desc, ws_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, expert_of_block_ptr,
    num_pairs, N, K,
    stride_hm, stride_hk, stride_hsm, stride_hsg,
    stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
    stride_yp, stride_yn,
    BLOCK_M: tl.constexpr, TILE_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, EVEN_K: tl.constexpr,
    SCALAR_WS: tl.constexpr, W_DESC: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
):
    # one [TILE_M, BLOCK_N] output tile: the first TILE_M rows of block pid_m
    H_DESC: tl.constexpr = W_DESC and TILE_M == BLOCK_M  # h_desc's box is a whole block
    e32 = tl.load(expert_of_block_ptr + pid_m)
    e = e32.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, TILE_M)
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if not H_DESC:
        a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :] * stride_hk  # h is in slot order
    if W_DESC:  # w_desc views w2 as [E * N, K]
        row_w = e32 * N + pid_n * BLOCK_N
    else:
        b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if FP8:
        as_ptrs = hs_ptr + rows * stride_hsm
        if SCALAR_WS:
            bs_ptrs = ws_ptr + e * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
        else:
            bs_ptrs = ws_ptr + e * stride_wse + (offs_n // 128) * stride_wsn
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if H_DESC:  # one box per tile, h in slot order; K tails zero-filled by TMA
            a = h_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if W_DESC:  # K tails zero-filled; rows past N (next expert's) are never stored
            b = w_desc.load([row_w, kb * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if INTERPRET:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if FP8:
            a_s = tl.load(as_ptrs + kb * stride_hsg)
            if SCALAR_WS:
                s = (a_s * tl.load(bs_ptrs + kb * stride_wsk))[:, None]
            else:
                s = a_s[:, None] * tl.load(bs_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)[None, :]
            acc += tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE) * s
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if not H_DESC:
            a_ptrs += BLOCK_K * stride_hk
        if not W_DESC:
            b_ptrs += BLOCK_K * stride_wk
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    acc *= tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_topk_kernel(
    y_ptr, ids_ptr, out_ptr, res_ptr, N, num_experts, stride_yp, stride_ot, stride_it, stride_rt, stride_rn,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RES: tl.constexpr, INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Masked loads rather than a branch per k: the K row loads are independent and all in flight
    # at once. Rows of dropped pairs were never written; they add +0.0, the identity here since acc
    # starts at +0.0 and so is never -0.0.
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + k)
        n_lim = tl.where((e >= 0) & (e < num_experts), N, 0)
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_yp + offs_n, mask=offs_n < n_lim, other=0.0).to(tl.float32)
    out = cast_rne(acc, out_ptr.dtype.element_ty, INTERPRET)
    if HAS_RES:  # torch's residual + out: the rounded sum, widened, plus the residual, rounded once more
        res = tl.load(res_ptr + t * stride_rt + offs_n * stride_rn, mask=n_ok, other=0.0).to(tl.float32)
        out = cast_rne(out.to(tl.float32) + res, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + t * stride_ot + offs_n, out, mask=n_ok)
