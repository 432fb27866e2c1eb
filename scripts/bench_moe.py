"""Benchmark the MoE expert layer on one GPU at prefill shapes (MiMo-V2-Flash: top-8 of 256
experts, hidden 4096, expert intermediate 2048).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, P = T*K pairs.

    FLOPs = 2 * T * K * (H * 2I + I * H)   (up GEMM + down GEMM over the real pairs; the
                                             padding of aligned blocks is not counted)

Methods, all timed with triton.testing.do_bench (median) in this one process, each after
--settle-s seconds of running back to back (see settle()); with --rounds N every method is
timed N times, the methods interleaved, and the median of the N is reported:
  grouped_mm gemms   torch._grouped_mm bf16: the two grouped GEMMs alone on rows already
                     sorted by expert (the library's GEMM speed, the baseline to beat)
  grouped_mm gemms+silu  the same with SiLU(gate) * up between them (what this row measured
                     before 2026-11-30 14:25 UTC)
  grouped_mm layer   the GEMMs and SiLU plus what a layer needs around them: sort, gather,
                     router weight, un-sort and the sum over k
  triton bf16        mimo_fn.kernels.moe_gemm.fused_moe (whole layer: align, up, down, sum)
  triton fp8         fused_moe_fp8 (whole layer, activation quantisation included)
  ... halves / whole (--half-tails-ab) the same with MIMO_FN_MOE_HALF_TAILS=1 / 0: an
                     expert's last block computes its first half only when its second half is
                     padding, at every size / every aligned block computed whole
Routing: balanced (K distinct uniform experts per token) and skewed (distinct experts drawn
with Zipf popularity p_e ~ 1/(1+e)). Outputs are checked against fused_moe_ref at 4K tokens
before timing. Writes $OUT/bench_moe.json when OUT is set.

Four more modes (--mode, any of bench / sweep / profile / numerics / cublas):
  sweep     each candidate launch config of the up and the down kernel timed alone (balanced
            routing, fixed config, TMA or pointer weights): what the autotune lists should hold
  profile   where one layer's time goes (balanced): each kernel's device time, the layer back
            to back, by do_bench (whose window also holds the host's launch work), host time
  numerics  where the FP8 kernel's distance from its fp32 simulation comes from, per FP8 MMA
            accumulation mode (Triton's max_num_imprecise_acc): the up GEMM's error against
            float64 in units of sum_k |x_k w_k|, how many h codes land on the other side of an
            e4m3 rounding midpoint, and the whole layer's distance from fused_moe_fp8_ref
  cublas    the library's FP8 alternative: cuBLASLt's block-scaled GEMM (F.scaled_mm, 1x128 /
            128x128 scales) once per expert over 128-row aligned segments, each GEMM timed
            alone over all experts (random FP8 operands; expert 0 checked against a dequantised
            matmul first)

    python scripts/bench_moe.py [--tokens 4096 16384 65536] [--budget-s 240]
                                [--mode bench sweep numerics profile cublas]
Energy per layer under sustained load: scripts/bench_moe_energy.py.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from mimo_fn.kernels import moe_gemm  # noqa: E402
from mimo_fn.kernels.fp8_quant import quant_fp8_act  # noqa: E402
from mimo_fn.kernels.moe_align import moe_align  # noqa: E402
from mimo_fn.kernels.moe_gemm import _cfg, default_block_m, fused_moe, fused_moe_fp8  # noqa: E402
from mimo_fn.kernels.moe_ref import fused_moe_fp8_ref, fused_moe_ref  # noqa: E402
from mimo_fn.layers import linear  # noqa: E402
from mimo_fn.quant import FP8_BLOCK, FP8_DTYPE, QTensor, dequantize, quantize_fp8_block  # noqa: E402

E, K, H, I = 256, 8, 4096, 2048
DEV = "cuda"


def routing(kind: str, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "balanced":
        ids_TK = torch.rand(t, E, device=DEV, generator=gen).argsort(dim=1)[:, :K]
    else:
        popularity_E = 1.0 / torch.arange(1, E + 1, device=DEV, dtype=torch.float32)
        ids_TK = torch.multinomial(popularity_E.expand(t, E).contiguous(), K, replacement=False, generator=gen)
    weights_TK = torch.rand(t, K, device=DEV, generator=gen) + 0.1
    return ids_TK, weights_TK


def grouped_mm_layer(x_TH, w13t_EH2I, w2t_EIH, ids_TK, weights_TK, gemms_only=None):
    """torch._grouped_mm MoE; w13t / w2t are the [E, K, N] (transposed) weight views it wants."""
    t = x_TH.shape[0]
    ids_P = ids_TK.reshape(-1)
    order_P = torch.argsort(ids_P, stable=True)
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_TH.device).scatter_add_(
        0, ids_P, torch.ones_like(ids_P, dtype=torch.int32)
    )  # bincount would sync on its max
    offs_E = counts_E.cumsum(0).to(torch.int32)
    xs_PH = x_TH[order_P // K]
    h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    a_PI = F.silu(h_P2I[:, :I]) * h_P2I[:, I:]
    y_PH = torch._grouped_mm(a_PI, w2t_EIH, offs=offs_E)
    y_PH = y_PH * weights_TK.reshape(-1)[order_P, None]
    unsorted_PH = torch.empty_like(y_PH)
    unsorted_PH[order_P] = y_PH
    return unsorted_PH.view(t, K, H).sum(dim=1), (xs_PH, offs_E)


def grouped_mm_gemms(xs_PH, a_PI, offs_E, w13t_EH2I, w2t_EIH):
    """The two grouped GEMMs alone: the down GEMM's input a_PI = SiLU(gate) * up is made once
    outside the timing."""
    torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    return torch._grouped_mm(a_PI, w2t_EIH, offs=offs_E)


def grouped_mm_gemms_silu(xs_PH, offs_E, w13t_EH2I, w2t_EIH):
    h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    return torch._grouped_mm(F.silu(h_P2I[:, :I]) * h_P2I[:, I:], w2t_EIH, offs=offs_E)


# sweep candidates, most telling first: (label, kind, stage 0 up / 1 down, block_m, config, tma)
def _sweep_candidates():
    c = []
    for tma in (False, True):
        c.append(("bf16 up 128x2x128x64 w8 s3", "bf16", 0, 128, _cfg(128, 64, 8, 3), tma))
        c.append(("bf16 down 128x256x64 w8 s3", "bf16", 1, 128, _cfg(256, 64, 8, 3), tma))
        c.append(("fp8 up 128x2x128x128 w4 s3", "fp8", 0, 128, _cfg(128, 128, 4, 3), tma))
        c.append(("fp8 down 128x128x128 w4 s3", "fp8", 1, 128, _cfg(128, 128, 4, 3), tma))
    tma = True
    c += [
        ("fp8 up w8 s3", "fp8", 0, 128, _cfg(128, 128, 8, 3), tma),
        ("fp8 up w16 s3", "fp8", 0, 128, _cfg(128, 128, 16, 3), tma),
        ("fp8 up w16 s4", "fp8", 0, 128, _cfg(128, 128, 16, 4), tma),
        ("fp8 down w8 s3", "fp8", 1, 128, _cfg(128, 128, 8, 3), tma),
        ("fp8 down w8 s4", "fp8", 1, 128, _cfg(128, 128, 8, 4), tma),
        ("fp8 down 128x256 w16 s3", "fp8", 1, 128, _cfg(256, 128, 16, 3), tma),
        ("bf16 up w8 s4", "bf16", 0, 128, _cfg(128, 64, 8, 4), tma),
        ("bf16 up w16 s4", "bf16", 0, 128, _cfg(128, 64, 16, 4), tma),
        ("bf16 down w8 s4", "bf16", 1, 128, _cfg(256, 64, 8, 4), tma),
        ("bf16 down w16 s4", "bf16", 1, 128, _cfg(256, 64, 16, 4), tma),
        ("fp8 up w16 s4 imp32", "fp8", 0, 128, _cfg(128, 128, 16, 4, MAX_IMPRECISE=32), tma),
        ("fp8 down w8 s4 imp32", "fp8", 1, 128, _cfg(128, 128, 8, 4, MAX_IMPRECISE=32), tma),
        ("fp8 up w16 s4 g32", "fp8", 0, 128, _cfg(128, 128, 16, 4, 32), tma),
        ("bf16 up w8 s4 g32", "bf16", 0, 128, _cfg(128, 64, 8, 4, 32), tma),
        ("fp8 up bm64 w4 s2", "fp8", 0, 64, _cfg(128, 128, 4, 2), tma),
        ("fp8 up bm64 w8 s4", "fp8", 0, 64, _cfg(128, 128, 8, 4), tma),
        ("fp8 down w4 s2", "fp8", 1, 128, _cfg(128, 128, 4, 2), tma),
        ("bf16 down w8 s4 g32", "bf16", 1, 128, _cfg(256, 64, 8, 4, 32), tma),
        ("bf16 up fused w8 s3", "bf16", 0, 128, _cfg(128, 64, 8, 3, FUSED_GU=True), tma),
        ("bf16 up fused w8 s4", "bf16", 0, 128, _cfg(128, 64, 8, 4, FUSED_GU=True), tma),
        ("bf16 up fused w8 s4 g16", "bf16", 0, 128, _cfg(128, 64, 8, 4, 16, FUSED_GU=True), tma),
        ("bf16 up fused bm64 w8 s4", "bf16", 0, 64, _cfg(128, 64, 8, 4, FUSED_GU=True), tma),
        ("fp8 down w16 s3", "fp8", 1, 128, _cfg(128, 128, 16, 3), tma),
        ("fp8 up bm64 w16 s3", "fp8", 0, 64, _cfg(128, 128, 16, 3), tma),
        ("fp8 up bm64 w8 s3", "fp8", 0, 64, _cfg(128, 128, 8, 3), tma),
        ("bf16 up fused k128 w8 s2", "bf16", 0, 128, _cfg(128, 128, 8, 2, FUSED_GU=True), tma),
        ("bf16 up fused w8 s3 g4", "bf16", 0, 128, _cfg(128, 64, 8, 3, 4, FUSED_GU=True), tma),
        ("bf16 up fused w8 s3 g16", "bf16", 0, 128, _cfg(128, 64, 8, 3, 16, FUSED_GU=True), tma),
        ("bf16 down k128 w8 s2", "bf16", 1, 128, _cfg(256, 128, 8, 2), tma),
        ("bf16 down w8 s3 g4", "bf16", 1, 128, _cfg(256, 64, 8, 3, 4), tma),
        ("bf16 down w8 s3 g16", "bf16", 1, 128, _cfg(256, 64, 8, 3, 16), tma),
    ]
    for pers in (False, True):  # one program per tile, then one per SM walking the tiles
        t, P = f"pers{int(pers)}", {"PERSISTENT": pers}
        c += [
            (f"bf16 up fused w8 s3 {t}", "bf16", 0, 128, _cfg(128, 64, 8, 3, FUSED_GU=True, **P), tma),
            (f"bf16 up fused w8 s4 {t}", "bf16", 0, 128, _cfg(128, 64, 8, 4, FUSED_GU=True, **P), tma),
            (f"bf16 up fused w8 s3 g16 {t}", "bf16", 0, 128, _cfg(128, 64, 8, 3, 16, FUSED_GU=True, **P), tma),
            (f"bf16 down w8 s4 g1 {t}", "bf16", 1, 128, _cfg(256, 64, 8, 4, 1, **P), tma),
            (f"bf16 down w8 s3 {t}", "bf16", 1, 128, _cfg(256, 64, 8, 3, **P), tma),
            (f"fp8 up w16 s3 g1 {t}", "fp8", 0, 128, _cfg(128, 128, 16, 3, 1, **P), tma),
            (f"fp8 down w8 s4 g1 {t}", "fp8", 1, 128, _cfg(128, 128, 8, 4, 1, **P), tma),
        ]
    return c


def sweep(x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, tokens, gen, report, t_start, budget_s, only) -> None:
    """Each candidate config of each kernel timed alone at each token count (balanced); only:
    substrings of the labels to run (all when empty)."""
    for t in tokens:
        ids_TK, weights_TK = routing("balanced", t, gen)
        x = x_TH[:t]
        xq_TH, xs_TG = quant_fp8_act(x)
        aligned = {bm: moe_align(ids_TK, E, bm) for bm in (64, 128)}
        inputs = {}  # (kind, block_m) -> h, hs from the default up config
        for label, kind, stage, bm, cfg, tma in _sweep_candidates():
            if only and not any(o in label for o in only):
                continue
            if time.time() - t_start > budget_s:
                print(f"budget reached: skipping sweep {label} at T={t}")
                continue
            al = aligned[bm]
            if kind == "fp8":
                up_args = (xq_TH, xs_TG, w13_q.data, w13_q.scale, al, K, FP8_DTYPE)
                w2, w2_s = w2_q.data, w2_q.scale
            else:
                up_args = (x, None, w13_E2IH, None, al, K, torch.bfloat16)
                w2, w2_s = w2_EHI, None
            if (kind, bm) not in inputs:
                inputs[kind, bm] = moe_gemm._moe_up(*up_args, cfg=_cfg(128, 128 if kind == "fp8" else 64, 8, 3))
            h_MI, hs_MIb = inputs[kind, bm]
            if stage == 0:
                fn = lambda: moe_gemm._moe_up(*up_args, cfg=cfg, tma=tma)  # noqa: E731
                flops = 2 * t * K * H * 2 * I
            else:
                fn = lambda: moe_gemm._moe_down(h_MI, hs_MIb, w2, w2_s, al, weights_TK, torch.bfloat16, cfg=cfg, tma=tma)  # noqa: E731
                flops = 2 * t * K * I * H
            try:
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
            except Exception as err:  # a config that does not compile or fit: record, go on
                print(f"T={t:6d} {label:34s} tma={int(tma)} FAILED {type(err).__name__}: {str(err)[:200]}")
                report["sweep"].append({"tokens": t, "label": label, "tma": tma, "error": str(err)[:500]})
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            report["sweep"].append({"tokens": t, "label": label, "tma": tma, "ms": round(ms, 4), "tflops": round(tflops, 1)})
            print(f"T={t:6d} {label:34s} tma={int(tma)} {ms:8.3f} ms {tflops:7.1f} TFLOP/s  (first call {compile_s:.1f} s)")
        del inputs
        torch.cuda.empty_cache()


def numerics(x_TH, w13_q, w2_q, t, gen, report) -> None:
    """FP8 kernel vs float64 and vs its fp32 simulation, per max_num_imprecise_acc (see --mode)."""
    ids_TK, weights_TK = routing("balanced", t, gen)
    x = x_TH[:t]
    xq_TH, xs_TG = quant_fp8_act(x)
    bm = 64
    al = moe_align(ids_TK, E, bm)
    n = int(al.num_tokens_post_pad_1)
    pair_M = al.sorted_ids_M[:n].long()
    expert_M = al.expert_of_block_NB.long().repeat_interleave(bm)[:n]
    slot_S = torch.nonzero(pair_M < al.num_pairs).view(-1)
    pair_S, expert_S = pair_M[slot_S], expert_M[slot_S]
    x64_SH = (xq_TH.double() * xs_TG.double().repeat_interleave(128, dim=1))[pair_S // K]
    gu_S2I = torch.zeros(len(slot_S), 2 * I, dtype=torch.float64, device=DEV)
    gu_abs_S2I = torch.zeros_like(gu_S2I)
    for e in expert_S.unique().tolist():
        r = expert_S == e
        w64 = w13_q.data[e].double() * w13_q.scale[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        gu_S2I[r] = x64_SH[r] @ w64.T
        gu_abs_S2I[r] = x64_SH[r].abs() @ w64.abs().T
    g, u = gu_S2I.split(I, dim=1)
    g_abs, u_abs = gu_abs_S2I.split(I, dim=1)
    sig = torch.sigmoid(g)
    h64_SI = g * sig * u
    # d h per unit of relative accumulation error (first order): the scale errors are measured in
    h_unit_SI = (sig * (1 + g * (1 - sig)) * u).abs() * g_abs + (g * sig).abs() * u_abs
    sim_TH = fused_moe_fp8_ref(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK).float()
    print(f"\nFP8 numerics at T={t} (E={E}, K={K}, H={H}, I={I}, block_m {bm}), per max_num_imprecise_acc:")
    rows = []
    for mi in (None, 64, 32):
        up_cfg = _cfg(128, 128, 8, 3, MAX_IMPRECISE=mi)  # what the tuner picks at block_m 64
        down_cfg = _cfg(128, 128, 4, 3, MAX_IMPRECISE=mi)
        h32_MI, _ = moe_gemm._moe_up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, K, torch.float32, cfg=up_cfg)
        hq_MI, hs_MIb = moe_gemm._moe_up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, K, FP8_DTYPE, cfg=up_cfg)
        y_PH = moe_gemm._moe_down(hq_MI, hs_MIb, w2_q.data, w2_q.scale, al, weights_TK, torch.bfloat16, cfg=down_cfg)
        out_TH = moe_gemm._moe_sum_topk(y_PH, ids_TK, E, torch.bfloat16)
        err_SI = (h32_MI.double()[slot_S] - h64_SI).abs()
        ratio = float((err_SI / h_unit_SI.clamp_min(1e-300)).max())  # error in units of sum|x||w|
        rel_h = float((err_SI / h64_SI.abs().clamp_min(1e-300)).median())
        hs_SI = hs_MIb.double()[slot_S].repeat_interleave(128, dim=1)
        exact_q = (h64_SI / hs_SI).clamp(-448, 448).float().to(FP8_DTYPE).float()
        flips = int((hq_MI[slot_S].float() != exact_q).sum())
        layer = float((out_TH.float() - sim_TH).abs().max() / sim_TH.abs().max())
        row = {"max_num_imprecise_acc": mi, "h_err_per_sum_abs_max": ratio, "h_rel_err_median": rel_h,
               "flips": flips, "num_h": h64_SI.numel(), "layer_vs_sim": layer}
        rows.append(row)
        print(f"  max_num_imprecise_acc={str(mi):4s}: max |h - h64| / sum|x||w| = {ratio:.3g} (2^{math.log2(max(ratio, 1e-300)):.1f}), "
              f"median rel {rel_h:.3g}; codes off the exact rounding {flips}/{h64_SI.numel()}; layer vs sim {layer:.3g}")
    report["numerics"] = {"tokens": t, "block_m": bm, "rows": rows}


def profile(x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, tokens, gen, report) -> None:
    """Where a whole layer's time goes (balanced routing): each kernel's device time (torch
    profiler, 5 layers back to back), the layer back to back, by do_bench, and the host time."""
    for t in tokens:
        ids_TK, weights_TK = routing("balanced", t, gen)
        x = x_TH[:t]
        flops = 2 * t * K * 3 * H * I
        layers = {"bf16": lambda: fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK),
                  "fp8": lambda: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK)}
        for name, fn in layers.items():
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            kernels = {e.key: e.device_time_total / 5e3 for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CUDA}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            end.record()
            torch.cuda.synchronize()
            loop_ms = start.elapsed_time(end) / 20
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host_ms = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            bench_ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row = {"tokens": t, "dtype": name, "kernels_ms": sum(kernels.values()), "loop_ms": loop_ms,
                   "do_bench_ms": bench_ms, "host_ms": host_ms, "split_ms": kernels}
            report.setdefault("profile", []).append(row)
            split = ", ".join(f"{k.split('(')[0][:28]} {v:.3f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:5])
            print(f"T={t:6d} {name}: kernels {row['kernels_ms']:.3f} ms ({flops / row['kernels_ms'] / 1e9:.0f} TFLOP/s), "
                  f"back to back {loop_ms:.3f}, do_bench {bench_ms:.3f} ({flops / bench_ms / 1e9:.0f}), host {host_ms:.3f}"
                  f"\n    {split}", flush=True)


def cublas_per_expert(w13_q, w2_q, tokens, routings, gen, report, settle_s) -> None:
    """Per-expert F.scaled_mm over aligned segments: the up GEMM [M_e, H] x [H, 2I] and the down
    GEMM [M_e, I] x [I, H] of every expert with rows, each stage timed alone (see the module doc).
    cuBLAS wants each activation-scale block M-major with strides (1, M_e): a strided slice of
    one [G, P] buffer is refused, so each expert gets its own block."""
    if not (linear._block_scaled_mm_available(torch.device(DEV)) and linear._has_scaled_mm_v2()):
        print("cublas: skipped (needs torch.nn.functional.scaled_mm and cuBLASLt block scaling, sm90)")
        return
    ra, rb = linear._block_recipes()
    w13_s, w2_s = w13_q.scale.float(), w2_q.scale.float()
    b13 = [(w13_q.data[e].t(), w13_s[e].t()) for e in range(E)]  # [H, 2I] column-major, scale [Hb, 2Ib]
    b2 = [(w2_q.data[e].t(), w2_s[e].t()) for e in range(E)]

    def operands(rows: list[int], k: int):
        """Per expert: (q [M_e, k] fp8, its M-major scale [M_e, k/128]), random; None for no rows."""
        return [(torch.randn(m, k, device=DEV, generator=gen).to(FP8_DTYPE),
                 (torch.rand(k // 128, m, device=DEV, generator=gen) + 0.5).t()) if m else None for m in rows]

    def per_expert(ops, weights):
        """One stage over all experts with rows: a list of [M_e, N] bf16 outputs."""
        return lambda: [F.scaled_mm(op[0], weights[e][0], op[1], ra, weights[e][1], rb, output_dtype=torch.bfloat16)
                        for e, op in enumerate(ops) if op is not None]

    q, s = operands([128], H)[0]
    w0 = dequantize(QTensor(w13_q.data[0], w13_q.scale[0], FP8_BLOCK), torch.float32)
    ref = (q.float() * s.repeat_interleave(128, 1)) @ w0.t()
    got = F.scaled_mm(q, b13[0][0], s, ra, b13[0][1], rb, output_dtype=torch.bfloat16)
    err = rel_err(got, ref)
    print(f"cublas: expert 0 up GEMM vs dequantised matmul: max-abs rel {err:.1e}")
    if err > 1e-2:
        raise SystemExit(f"cublas: per-expert scaled_mm check failed ({err:.1e} > 1e-2)")
    for t in tokens:
        for kind in routings:
            ids_TK, _ = routing(kind, t, gen)
            rows = [-(-c // 128) * 128 for c in torch.bincount(ids_TK.flatten(), minlength=E).tolist()]
            stages = {"up": (per_expert(operands(rows, H), b13), 2 * t * K * H * 2 * I),
                      "down": (per_expert(operands(rows, I), b2), 2 * t * K * I * H)}
            times = {}
            for name, (fn, flops) in stages.items():
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host_ms = (time.perf_counter() - t0) * 1e3  # launches only: no sync inside
                settle(fn, settle_s)
                times[name] = ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row = {"tokens": t, "routing": kind, "stage": name, "ms": round(ms, 4),
                       "tflops": round(flops / ms / 1e9, 1), "host_ms": round(host_ms, 2), "slots": sum(rows)}
                report.setdefault("cublas", []).append(row)
                print(f"T={t:6d} {kind:9s} cublas per-expert {name:5s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
                      f"  host {host_ms:.1f} ms for {sum(1 for r in rows if r)} launches")
            total = 2 * t * K * 3 * H * I
            print(f"T={t:6d} {kind:9s} cublas per-expert both  {sum(times.values()):8.3f} ms "
                  f"{total / sum(times.values()) / 1e9:7.1f} TFLOP/s (GEMMs only; no gather, SiLU, quant or sum)")
            del stages
            torch.cuda.empty_cache()


def settle(fn, seconds: float) -> None:
    """Run fn back to back for `seconds` before it is timed, so each method is timed in its own
    steady state. The H200 runs these layers at its ~690 W power cap, its SM clock moving between
    ~800 and 1980 MHz, and the clock dips after the workload changes. That is the likely cause of
    what settling removed on 2026-11-30: without it, our bf16 layer at 16K tokens timed straight
    after the grouped_mm layer measured 15.3-17.3 ms, and 13.1-13.3 ms in a second do_bench a
    moment later (docs/benchmarks.md)."""
    torch.cuda.synchronize()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()
        torch.cuda.synchronize()


def half_tails(fn, on: bool):
    """fn with MIMO_FN_MOE_HALF_TAILS=1 (on: an expert's last block computes its first half only
    when its second half is padding, at every size) or =0 (off: every aligned block whole)."""
    def run():
        before = os.environ.get("MIMO_FN_MOE_HALF_TAILS")
        os.environ["MIMO_FN_MOE_HALF_TAILS"] = "1" if on else "0"
        try:
            return fn()
        finally:  # the caller's setting back, whatever it was
            if before is None:
                del os.environ["MIMO_FN_MOE_HALF_TAILS"]
            else:
                os.environ["MIMO_FN_MOE_HALF_TAILS"] = before
    return run


def rel_err(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--routings", nargs="+", default=["balanced", "skewed"])
    ap.add_argument("--block-m-sweep", action="store_true", help="also time block_m 64 and 128 (balanced)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this many seconds")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="bench, cublas: run each method this long before timing it (see settle())")
    ap.add_argument("--mode", nargs="+", default=["bench"], choices=["bench", "sweep", "numerics", "profile", "cublas"])
    ap.add_argument("--numerics-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1,
                    help="bench: time every method this many times, interleaved; report the median")
    ap.add_argument("--half-tails-ab", action="store_true",
                    help="bench: also time both layers with HALF_TAILS forced on and off")
    ap.add_argument("--sweep-only", nargs="*", default=[], help="label substrings to sweep (default all)")
    args = ap.parse_args()
    t_start = time.time()
    out_dir = os.environ.get("OUT")
    gen = torch.Generator(device=DEV).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    report = {
        "device": props.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"E": E, "K": K, "H": H, "I": I},
        "flops_formula": "2*T*K*(H*2I + I*H)",
        "checks": {},
        "results": [],
        "sweep": [],
    }

    def save() -> None:
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, "bench_moe.json").write_text(json.dumps(report, indent=2))

    print(f"{props.name}  torch {torch.__version__}  triton {triton.__version__}  {report['date']}")
    x_TH = torch.randn(max(args.tokens), H, device=DEV, generator=gen).bfloat16()
    w13_E2IH = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) / H**0.5).bfloat16()
    w2_EHI = (torch.randn(E, H, I, device=DEV, generator=gen) / I**0.5).bfloat16()
    w13_q, w2_q = quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI)  # fp32 one matrix at a time
    w13t_EH2I, w2t_EIH = w13_E2IH.transpose(1, 2), w2_EHI.transpose(1, 2)  # views: what grouped_mm wants
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    print(f"torch._grouped_mm available: {has_grouped_mm}")
    if "numerics" in args.mode:
        numerics(x_TH, w13_q, w2_q, args.numerics_tokens, gen, report)
        save()
    if "sweep" in args.mode:
        sweep(x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, args.tokens, gen, report, t_start, args.budget_s, args.sweep_only)
        save()
    if "profile" in args.mode:
        profile(x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, args.tokens, gen, report)
        save()
    if "cublas" in args.mode:
        cublas_per_expert(w13_q, w2_q, args.tokens, args.routings, gen, report, args.settle_s)
        save()
    if "bench" in args.mode:
        bench(args, x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, w13t_EH2I, w2t_EIH, has_grouped_mm, gen, report, save, t_start)
    print(f"total {time.time() - t_start:.0f} s")
    save()


def bench(args, x_TH, w13_E2IH, w2_EHI, w13_q, w2_q, w13t_EH2I, w2t_EIH, has_grouped_mm, gen, report, save, t_start):
    # correctness at 4K tokens first (autotunes the Triton kernels for that size on the way)
    t_chk = min(4096, max(args.tokens))
    for kind in args.routings:
        ids_TK, weights_TK = routing(kind, t_chk, gen)
        x = x_TH[:t_chk]
        ref = fused_moe_ref(x, w13_E2IH, w2_EHI, ids_TK, weights_TK)
        checks = {
            "triton_bf16": rel_err(fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK), ref),
            "triton_fp8": rel_err(
                fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK), ref
            ),
        }
        if has_grouped_mm:
            checks["grouped_mm"] = rel_err(grouped_mm_layer(x, w13t_EH2I, w2t_EIH, ids_TK, weights_TK)[0], ref)
        report["checks"][f"{kind}_{t_chk}"] = checks
        errs = ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
        print(f"check vs fused_moe_ref (bf16) at T={t_chk} {kind}: {errs}")
        bad = {k: v for k, v in checks.items() if v > (0.1 if k == "triton_fp8" else 2e-2)}
        if bad:
            raise SystemExit(f"output check failed: {bad}")
        del ref
    save()

    for t in args.tokens:
        for kind in args.routings:
            if time.time() - t_start > args.budget_s:
                print(f"budget reached: skipping T={t} {kind}")
                continue
            ids_TK, weights_TK = routing(kind, t, gen)
            x = x_TH[:t]
            flops = 2 * t * K * (H * 2 * I + I * H)
            methods = {}
            if has_grouped_mm:
                _, (xs_PH, offs_E) = grouped_mm_layer(x, w13t_EH2I, w2t_EIH, ids_TK, weights_TK)
                h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
                a_PI = F.silu(h_P2I[:, :I]) * h_P2I[:, I:]
                del h_P2I
                methods["grouped_mm gemms"] = lambda: grouped_mm_gemms(xs_PH, a_PI, offs_E, w13t_EH2I, w2t_EIH)
                methods["grouped_mm gemms+silu"] = lambda: grouped_mm_gemms_silu(xs_PH, offs_E, w13t_EH2I, w2t_EIH)
                methods["grouped_mm layer"] = lambda: grouped_mm_layer(x, w13t_EH2I, w2t_EIH, ids_TK, weights_TK)
            block_m = {"bf16": default_block_m(t * K, E), "fp8": default_block_m(t * K, E, fp8=True)}
            sweep = [64, 128] if args.block_m_sweep and kind == "balanced" else [None]  # None: the default
            used = {}
            for b in sweep:
                tag = "" if b is None else f" bm{b}"
                methods[f"triton bf16{tag}"] = lambda b=b: fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK, block_m=b)
                methods[f"triton fp8{tag}"] = lambda b=b: fused_moe_fp8(
                    x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, block_m=b
                )
                used[f"triton bf16{tag}"], used[f"triton fp8{tag}"] = b or block_m["bf16"], b or block_m["fp8"]
            if args.half_tails_ab:  # the same layers with HALF_TAILS forced on ("halves") and off ("whole")
                for name in ("triton bf16", "triton fp8"):
                    methods[f"{name} halves"] = half_tails(methods[name], True)
                    methods[f"{name} whole"] = half_tails(methods[name], False)
            methods["moe_align only"] = lambda: moe_align(ids_TK, E, block_m["bf16"])
            for fn in methods.values():
                fn()  # autotune / compile outside the timing
            times = {name: [] for name in methods}
            for _ in range(args.rounds):  # rounds interleave the methods: a clock dip hits one sample
                for name, fn in methods.items():
                    settle(fn, args.settle_s)
                    times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median"))
            for name, samples in times.items():
                ms = statistics.median(samples)
                tflops = flops / (ms * 1e-3) / 1e12 if "align" not in name else None
                row = {"tokens": t, "routing": kind, "method": name, "ms": round(ms, 4),
                       "tflops": round(tflops, 1) if tflops else None, "block_m": used.get(name),
                       "ms_samples": [round(v, 4) for v in samples]}
                report["results"].append(row)
                spread = f" ({min(samples):.3f}-{max(samples):.3f})" if len(samples) > 1 else ""
                print(f"T={t:6d} {kind:9s} {name:22s} {ms:9.3f} ms{spread}  "
                      + (f"{tflops:7.1f} TFLOP/s" if tflops else ""))
            save()
            if has_grouped_mm:
                del xs_PH, offs_E, a_PI
            torch.cuda.empty_cache()

    # short table: TFLOP/s of the whole layer per method, and the two goal ratios
    print("\nTFLOP/s (median), FLOPs = 2*T*K*(H*2I + I*H)")
    names = []
    for r in report["results"]:
        if r["tflops"] is not None and r["method"] not in names:
            names.append(r["method"])
    print(f"{'tokens':>7} {'routing':9} " + " ".join(f"{n:>18}" for n in names))
    for t in args.tokens:
        for kind in args.routings:
            rows = {r["method"]: r for r in report["results"] if r["tokens"] == t and r["routing"] == kind}
            if rows:
                print(f"{t:7d} {kind:9} " + " ".join(
                    f"{rows[n]['tflops']:18.1f}" if n in rows else f"{'-':>18}" for n in names))
    print("\ngoal ratios (best timed block_m of each): ours bf16 / grouped_mm gemms, ours fp8 / ours bf16")
    for t in args.tokens:
        for kind in args.routings:
            rows = [r for r in report["results"] if r["tokens"] == t and r["routing"] == kind and r["tflops"]]
            best = {m: max((r["tflops"] for r in rows if r["method"] == m or r["method"].startswith(m + " bm")), default=None)
                    for m in ("grouped_mm gemms", "triton bf16", "triton fp8")}
            if best["triton bf16"] and best["triton fp8"]:
                vs_gmm = f"{best['triton bf16'] / best['grouped_mm gemms']:.3f}" if best["grouped_mm gemms"] else "-"
                ratio = best["triton fp8"] / best["triton bf16"]
                report.setdefault("ratios", []).append({"tokens": t, "routing": kind, "bf16_vs_grouped_mm": vs_gmm,
                                                        "fp8_vs_bf16": round(ratio, 3)})
                print(f"{t:7d} {kind:9} bf16/grouped_mm {vs_gmm}  fp8/bf16 {ratio:.3f}")
    # what the autotuner picked, per (kernel, key = N, K, BLOCK_M, size bucket, W_DESC, HALF_TAILS, dtypes...)
    from mimo_fn.kernels.moe_gemm import _TUNED

    report["tuned"] = {}
    for kind, kernels in _TUNED.items():
        for name, kernel in zip(("up", "down"), kernels):
            for key, cfg in getattr(kernel, "cache", {}).items():
                label = f"{kind} {name} N={key[0]} K={key[1]} BM={key[2]} bucket={key[3]} tma={key[4]} half={key[5]}"
                report["tuned"][label] = str(cfg)
                print(f"tuned {label}: {cfg}")


if __name__ == "__main__":
    main()
