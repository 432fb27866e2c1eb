"""`python -m mimo_fn.bench moe --mode promotion`: what the FP8 MoE GEMMs' per-K-step scaling
costs, for issue 46's FP8 MoE goal (1.5x the bf16 layer).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, M aligned slots.

Each K step of 128 of the FP8 up and down GEMMs (kernels/moe/gemm_kernels.py) scales its partial
product by (activation group scale x weight block scale) before adding it to the accumulator, so
the warpgroups wait for every step's MMAs. Timed here, each kernel alone at the model's dims on
aligned balanced routing (128-row blocks, TMA weights, whole tiles):
  scaled    the FP8 kernels as the layer runs them (FP8=True), at their default launch configs
            and at the others below
  chained   the same kernels on the same FP8 operands with FP8=False: one accumulator chained
            through the K loop and no scaling at all, so the tensor cores never wait for a step.
            Their output is not the product (the scales are left out): speed only. The gap to
            "scaled" bounds what hiding the scaling (warp specialisation, issue 46) can buy within
            the same tile shapes; wider tiles (fused gate / up N = 256 MMAs, 256-column down
            tiles) say what larger tiles add.
On a CPU (the interpreter, tiny dims) `promotion_rows` runs every variant once: a smoke test.
"""

import torch
import triton

from mimo_fn.bench.moe_layer import E, H, I, K, Weights, routing
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe import down_ws, slots, up_ws
from mimo_fn.kernels.moe import gemm as g
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.quant import FP8_DTYPE

BLOCK_M = 128
# (label, FP8 scaling, launch meta, warps, stages): the up GEMM's, then the down GEMM's
UP_VARIANTS = [
    ("scaled (default config)", True, dict(BLOCK_N=128, BLOCK_K=128), 16, 3),
    ("scaled, 8 warps, 4 stages", True, dict(BLOCK_N=128, BLOCK_K=128), 8, 4),
    ("chained", False, dict(BLOCK_N=128, BLOCK_K=128), 8, 3),
    ("chained, 16 warps", False, dict(BLOCK_N=128, BLOCK_K=128), 16, 3),
    ("chained, fused gate/up (N 256 MMAs)", False, dict(BLOCK_N=128, BLOCK_K=128, FUSED_GU=True), 8, 3),
    ("chained, fused gate/up, K 64, 4 stages", False, dict(BLOCK_N=128, BLOCK_K=64, FUSED_GU=True), 8, 4),
]
DOWN_VARIANTS = [
    ("scaled (Triton default config)", True, dict(BLOCK_N=128, BLOCK_K=128), 8, 3),
    ("chained", False, dict(BLOCK_N=128, BLOCK_K=128), 8, 4),
    ("chained, N 256", False, dict(BLOCK_N=256, BLOCK_K=128), 8, 3),
    ("chained, N 256, K 64, 4 stages", False, dict(BLOCK_N=256, BLOCK_K=64), 8, 4),
]


def _up(x_TH, xs_TG, w13, w13_s, al, top_k: int, scaled: bool, meta: dict, warps: int, stages: int):
    """One launch of the up kernel (h FP8 with its 1x128 scales, as the layer's) at a forced config."""
    num_slots, inter, hid = al.sorted_ids_M.numel(), w13.shape[1] // 2, x_TH.shape[1]
    h_MI = torch.empty(num_slots, inter, dtype=FP8_DTYPE, device=x_TH.device)
    hs_MIb = torch.empty(inter // 128, num_slots, dtype=torch.float32, device=x_TH.device).t()
    w_desc = g._tma_2d(w13, None)
    w3_desc = g._tma_gate_up(w13, w_desc)
    meta = {"GROUP_M": 8, "FUSED_GU": False, **meta}
    g._desc_boxes({"w_desc": w_desc, "w3_desc": w3_desc, **meta})
    progs = g._num_progs(x_TH.device)
    g._up[g._grid(num_slots, al.block_m, inter, progs)](
        x_TH, xs_TG, w13, w_desc, w3_desc, w13_s, h_MI, hs_MIb, al.sorted_ids_M, al.expert_of_block_NB,
        al.num_tokens_post_pad_1, al.num_pairs, num_slots, inter, hid, triton.next_power_of_2(al.num_pairs),
        *x_TH.stride(), *xs_TG.stride(), *w13.stride(), *w13_s.stride(), *h_MI.stride(), *hs_MIb.stride(),
        TOP_K=top_k, BLOCK_M=al.block_m, FP8=scaled, IEEE=False, INTERPRET=not x_TH.is_cuda, W_DESC=w_desc is not None,
        QUANT_H=True, NUM_PROGS=progs, HALF_TAILS=False, num_warps=warps, num_stages=stages, **meta,
    )
    return h_MI, hs_MIb


def _down(h_MI, hs_MIb, w2, w2_s, al, weights_TK, scaled: bool, meta: dict, warps: int, stages: int):
    """One launch of the down kernel (bf16 rows per pair) at a forced config."""
    num_slots, hid = h_MI.shape[0], w2.shape[1]
    y_PH = torch.empty(al.num_pairs, hid, dtype=torch.bfloat16, device=h_MI.device)
    w_desc, h_desc = g._tma_2d(w2, None), g._tma_2d(h_MI, None)
    if w_desc is None or h_desc is None:
        w_desc = h_desc = None
    meta = {"GROUP_M": 8, **meta}
    g._desc_boxes({"w_desc": w_desc, "h_desc": h_desc, "BLOCK_M": al.block_m, **meta})
    progs = g._num_progs(h_MI.device)
    g._down[g._grid(num_slots, al.block_m, hid, progs)](
        h_MI, h_desc, hs_MIb, w2, w_desc, w2_s, y_PH, weights_TK.contiguous().view(-1), al.sorted_ids_M,
        al.expert_of_block_NB, al.num_tokens_post_pad_1, al.num_pairs, num_slots, hid, w2.shape[2],
        triton.next_power_of_2(al.num_pairs), *h_MI.stride(), *hs_MIb.stride(), *w2.stride(), *w2_s.stride(),
        *y_PH.stride(), BLOCK_M=al.block_m, FP8=scaled, IEEE=False, INTERPRET=not h_MI.is_cuda,
        W_DESC=w_desc is not None, NUM_PROGS=progs, HALF_TAILS=False, num_warps=warps, num_stages=stages, **meta,
    )
    return y_PH


def promotion_rows(x_TH, w13_q, w2_q, ids_TK, weights_TK, timer=None) -> list[dict]:
    """Every variant of both GEMMs on these operands: rows of {gemm, variant, ms, tflops}; timer(fn)
    gives ms (None: run each once, ms 0: the CPU smoke run). Plus the warp-specialised GEMMs where
    they serve (Hopper): up_ws with x gathered or quantised into slot order (included; each also
    alone, "x" rows) and down_ws."""
    t, hid = x_TH.shape
    inter = w13_q.data.shape[1] // 2
    k = ids_TK.shape[1]
    xq_TH, xs_TG = quant_fp8_act(x_TH)
    al = moe_align(ids_TK, w13_q.data.shape[0], BLOCK_M)
    flops = {"up": 2 * t * k * hid * 2 * inter, "down": 2 * t * k * inter * hid, "x": 0}
    h_MI, hs_MIb = _up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, k, *UP_VARIANTS[0][1:])
    calls = [("up", label, lambda s=s, m=m, nw=nw, ns=ns: _up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, k, s, m, nw,
                                                              ns))
             for label, s, m, nw, ns in UP_VARIANTS]
    calls += [("down", label, lambda s=s, m=m, nw=nw, ns=ns: _down(h_MI, hs_MIb, w2_q.data, w2_q.scale, al,
                                                                   weights_TK, s, m, nw, ns))
              for label, s, m, nw, ns in DOWN_VARIANTS]
    if up_ws.serves(xq_TH, w13_q.data, BLOCK_M):
        calls.append(("up", "scaled, warp-specialised (up_ws on FP8 x: the gather and the GEMM)",
                      lambda: up_ws.moe_up_fp8_ws(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, k)))
        calls.append(("up", "the same, x quantised into slot order (up_ws on the layer's x)",
                      lambda: up_ws.moe_up_fp8_ws(x_TH, None, w13_q.data, w13_q.scale, al, k)))
        calls.append(("x", "x quantised, then gathered into slot order (the first row's x)",
                      lambda: slots.gather_slots(*quant_fp8_act(x_TH), al, k)))
        calls.append(("x", "x quantised into slot order (the second row's x)",
                      lambda: slots.quant_fp8_slots(x_TH, al, k)))
    if down_ws.serves(h_MI, w2_q.data, BLOCK_M):
        calls.append(("down", "scaled, warp-specialised (down_ws, the default)", lambda: down_ws.moe_down_fp8_ws(
            h_MI, hs_MIb, w2_q.data, w2_q.scale, al, weights_TK, torch.bfloat16)))
    rows = []
    for gemm, label, fn in calls:
        if timer is None:
            fn()
            ms = 0.0
        else:
            ms = timer(fn)
        rows.append({"gemm": gemm, "variant": label, "ms": ms, "tflops": flops[gemm] / ms / 1e9 if ms else 0.0})
    return rows


def promotion(w: Weights, tokens, gen, run) -> None:
    """--mode promotion at each token count (balanced routing), a table and JSON rows."""
    rows = []
    for t in tokens:
        ids_TK, weights_TK = routing("balanced", t, gen)
        for row in promotion_rows(w.x_TH[:t], w.w13_q, w.w2_q, ids_TK, weights_TK, timer=time_ms):
            rows.append({"tokens": t, **row})
            record(run, row, mode="promotion", tokens=t, routing="balanced", E=E, H=H, I=I, K=K)
    print_table(rows, [("tokens", "tokens", "d"), ("GEMM", "gemm", ""), ("variant", "variant", ""),
                       ("ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".1f")],
                "FP8 MoE GEMMs with the per-K-step scaling (scaled) and without it (chained: speed only)")
