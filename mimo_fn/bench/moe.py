"""Benchmark the MoE expert layer on one GPU at prefill shapes (MiMo-V2-Flash: top-8 of 256
experts, hidden 4096, expert intermediate 2048).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, P = T*K pairs.

    FLOPs = 2 * T * K * (H * 2I + I * H)   (up GEMM + down GEMM over the real pairs; the
                                             padding of aligned blocks is not counted)

Methods, all timed with mimo_fn.bench.timing.time_ms (do_bench, median) in this one process, each after
--settle-s seconds of running back to back (see settle()); with --rounds N every method is
timed N times, the methods interleaved, and the median of the N is reported:
  grouped_mm gemms   torch._grouped_mm bf16: the two grouped GEMMs alone on rows already
                     sorted by expert (the library's GEMM speed, the baseline to beat)
  grouped_mm gemms+silu  the same with SiLU(gate) * up between them
  grouped_mm layer   the GEMMs and SiLU plus what a layer needs around them: sort, gather,
                     router weight, un-sort and the sum over k
  triton bf16        mimo_fn.kernels.moe.gemm.fused_moe (whole layer: align, up, down, sum)
  triton fp8         fused_moe_fp8(down_ws=False, up_ws=False) (whole layer, activation quantisation
                     included, both GEMMs in Triton)
  triton fp8 ws-down (--ws-down) fused_moe_fp8(down_ws=True, up_ws=False): the down GEMM in the
                     warp-specialised Gluon kernel (kernels/moe/down_ws.py; Hopper, 128-row blocks),
                     the default layer below up_ws.MIN_PAIRS_PER_EXPERT pairs per expert
  triton fp8 ws-up   (--ws-up) fused_moe_fp8(up_ws=True, down_ws=False): the up GEMM warp-specialised
                     (kernels/moe/up_ws.py, x quantised straight into slot order)
  triton fp8 ws-both (--ws-up) fused_moe_fp8(up_ws=True, down_ws=True): both GEMMs warp-specialised,
                     the default layer from up_ws.MIN_PAIRS_PER_EXPERT pairs per expert on
  fp8 cublas-up      (--cublas-up) fused_moe_fp8(down_ws=True) with the up GEMM as one cuBLASLt
                     block-scaled GEMM per expert (kernels/moe/up_cublas.py, options.moe_up_cublas
                     forced on); every other FP8 method runs with it forced off
  ... halves / whole (--half-tails-ab) the same with options.moe_half_tails True / False: an
                     expert's last block computes its first half only when its second half is
                     padding, at every size / every aligned block computed whole
Routing: balanced (K distinct uniform experts per token) and skewed (distinct experts drawn
with Zipf popularity p_e ~ 1/(1+e)). Outputs are checked against fused_moe_ref at 4K tokens
before timing.

More modes (--mode, any of bench / sweep / profile / numerics / cublas / promotion):
  sweep     each candidate launch config of the up and the down kernel timed alone (balanced
            routing, fixed config, TMA or pointer weights): what the autotune lists should hold
  profile   where one layer's time goes (balanced): each kernel's device time, the layer back
            to back, by do_bench (whose window also holds the host's launch work), host time;
            with --ws-down also the FP8 layer with the WS down GEMM (its down kernel's time beside
            the Triton one's); sweep's "fp8 down ws" times the WS down GEMM alone
  numerics  where the FP8 kernel's distance from its fp32 simulation comes from, per FP8 MMA
            accumulation mode (Triton's max_num_imprecise_acc): the up GEMM's error against
            float64 in units of sum_k |x_k w_k|, how many h codes land on the other side of an
            e4m3 rounding midpoint, and the whole layer's distance from fused_moe_fp8_ref
  cublas    the library's FP8 alternative: cuBLASLt's block-scaled GEMM (F.scaled_mm, 1x128 /
            128x128 scales) once per expert over 128-row aligned segments, each GEMM timed
            alone over all experts (random FP8 operands; expert 0 checked against a dequantised
            matmul first)
  promotion what the FP8 GEMMs' per-K-step scaling costs: each alone with it and without it
            (mimo_fn.bench.moe_promotion: the "chained" rows are speed only), balanced routing

    python -m mimo_fn.bench moe [--tokens 4096 16384 65536] [--budget-s 240]
                                [--mode bench sweep numerics profile cublas promotion]
Energy per layer under sustained load: python -m mimo_fn.bench moe-energy.
"""

import statistics
import time

import torch
import triton

from mimo_fn.bench.moe_layer import (E, H, I, K, Weights, grouped_mm_gemms, grouped_mm_gemms_silu, grouped_mm_inputs,
                                     grouped_mm_layer, half_tails, make_weights, rel_err, routing, with_options)
from mimo_fn.bench.moe_probe import cublas_per_expert, numerics, profile
from mimo_fn.bench.moe_promotion import promotion
from mimo_fn.bench.moe_sweep import sweep
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import settle, time_ms
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.gemm import default_block_m, fused_moe, fused_moe_fp8
from mimo_fn.kernels.moe.ref import fused_moe_ref

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536], help="token counts T")
    ap.add_argument("--routings", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"],
                    help="routings (see above)")
    ap.add_argument("--block-m-sweep", action="store_true", help="bench: also time block_m 64 and 128 (balanced)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this many seconds")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="bench, cublas: run each method this long before timing it (timing.settle)")
    ap.add_argument("--mode", nargs="+", default=["bench"],
                    choices=["bench", "sweep", "numerics", "profile", "cublas", "promotion"],
                    help="what to run (see above)")
    ap.add_argument("--numerics-tokens", type=int, default=512, help="numerics: token count")
    ap.add_argument("--rounds", type=int, default=1,
                    help="bench: time every method this many times, interleaved; report the median")
    ap.add_argument("--half-tails-ab", action="store_true",
                    help="bench: also time both layers with HALF_TAILS forced on and off")
    ap.add_argument("--ws-down", action="store_true",
                    help="bench, profile: also the FP8 layer with the warp-specialised down GEMM (down_ws=True)")
    ap.add_argument("--ws-up", action="store_true",
                    help="bench, profile: also the FP8 layer with the warp-specialised up GEMM, and with both")
    ap.add_argument("--cublas-up", action="store_true",
                    help="bench, profile: also the FP8 layer with the up GEMM per expert in cuBLASLt (up_cublas)")
    ap.add_argument("--sweep-only", nargs="*", default=[], help="sweep: label substrings to sweep (none: all)")


def main(args, run) -> None:
    t_start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{run.device}  torch {torch.__version__}  triton {triton.__version__}  {run.date}")
    w = make_weights(max(args.tokens), gen)
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    print(f"torch._grouped_mm available: {has_grouped_mm}")
    swept = []
    if "numerics" in args.mode:
        numerics(w, args.numerics_tokens, gen, run)
    if "sweep" in args.mode:
        swept = sweep(w, args.tokens, gen, run, t_start, args.budget_s, args.sweep_only)
    if "profile" in args.mode:
        profile(w, args.tokens, gen, run, args.ws_down, args.ws_up, args.cublas_up)
    if "cublas" in args.mode:
        cublas_per_expert(w, args.tokens, args.routings, gen, run, args.settle_s)
    if "promotion" in args.mode:
        promotion(w, args.tokens, gen, run)
    if "bench" in args.mode:
        bench(args, w, has_grouped_mm, gen, run, t_start)
    elif swept:
        print_table(swept, [("tokens", "tokens", "d"), ("config", "label", ""), ("tma", "tma", "d"),
                            ("ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".1f")], "sweep")
    print(f"total {time.time() - t_start:.0f} s")


def bench(args, w: Weights, has_grouped_mm: bool, gen, run, t_start) -> None:
    """The methods of the module docstring at each size and routing, and the goal ratios."""
    x_TH, w13_E2IH, w2_EHI, w13_q, w2_q = w.x_TH, w.w13_E2IH, w.w2_EHI, w.w13_q, w.w2_q
    w13t_EH2I, w2t_EIH = w.w13t_EH2I, w.w2t_EIH
    results = []
    # correctness at 4K tokens first (autotunes the Triton kernels for that size on the way)
    t_chk = min(4096, max(args.tokens))
    for kind in args.routings:
        ids_TK, weights_TK = routing(kind, t_chk, gen)
        x = x_TH[:t_chk]
        ref = fused_moe_ref(x, w13_E2IH, w2_EHI, ids_TK, weights_TK)
        checks = {
            "triton_bf16": rel_err(fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK), ref),
            "triton_fp8": rel_err(
                fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, down_ws=False,
                              up_ws=False), ref
            ),
        }
        if args.ws_down:
            checks["triton_fp8_ws_down"] = rel_err(fused_moe_fp8(
                x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, down_ws=True, up_ws=False), ref)
        for name, kw in (("ws_up", dict(up_ws=True, down_ws=False)), ("ws_both", dict(up_ws=True, down_ws=True))):
            if args.ws_up:
                checks[f"triton_fp8_{name}"] = rel_err(fused_moe_fp8(
                    x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, **kw), ref)
        if has_grouped_mm:
            checks["grouped_mm"] = rel_err(grouped_mm_layer(x, w13t_EH2I, w2t_EIH, ids_TK, weights_TK)[0], ref)
        record(run, checks, mode="check", tokens=t_chk, routing=kind)
        errs = ", ".join(f"{k} {v:.2e}" for k, v in checks.items())
        print(f"check vs fused_moe_ref (bf16) at T={t_chk} {kind}: {errs}")
        bad = {k: v for k, v in checks.items() if v > (0.1 if k.startswith("triton_fp8") else 2e-2)}
        if bad:
            raise SystemExit(f"output check failed: {bad}")
        del ref

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
                xs_PH, a_PI, offs_E = grouped_mm_inputs(w, x, ids_TK, weights_TK)
                methods["grouped_mm gemms"] = lambda: grouped_mm_gemms(xs_PH, a_PI, offs_E, w13t_EH2I, w2t_EIH)
                methods["grouped_mm gemms+silu"] = lambda: grouped_mm_gemms_silu(xs_PH, offs_E, w13t_EH2I, w2t_EIH)
                methods["grouped_mm layer"] = lambda: grouped_mm_layer(x, w13t_EH2I, w2t_EIH, ids_TK, weights_TK)
            block_m = {"bf16": default_block_m(t * K, E), "fp8": default_block_m(t * K, E, fp8=True)}
            block_ms = [64, 128] if args.block_m_sweep and kind == "balanced" else [None]  # None: the default
            used = {}
            for b in block_ms:
                tag = "" if b is None else f" bm{b}"
                methods[f"triton bf16{tag}"] = lambda b=b: fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK, block_m=b)
                methods[f"triton fp8{tag}"] = lambda b=b: fused_moe_fp8(
                    x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, block_m=b, down_ws=False,
                    up_ws=False,
                )
                used[f"triton bf16{tag}"], used[f"triton fp8{tag}"] = b or block_m["bf16"], b or block_m["fp8"]
            if args.ws_down:  # the WS kernel serves 128-row blocks only: where the default is 64, so is the Triton path
                methods["triton fp8 ws-down"] = lambda: fused_moe_fp8(
                    x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, down_ws=True, up_ws=False)
                used["triton fp8 ws-down"] = block_m["fp8"]
            if args.ws_up:  # likewise 128-row blocks only
                for name, kw in (("ws-up", dict(up_ws=True, down_ws=False)), ("ws-both", dict(up_ws=True, down_ws=True))):
                    methods[f"triton fp8 {name}"] = lambda kw=kw: fused_moe_fp8(
                        x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, **kw)
                    used[f"triton fp8 {name}"] = block_m["fp8"]
            for name in [n for n in methods if n.startswith("triton fp8")]:  # the Triton (or WS) up GEMM
                methods[name] = with_options(methods[name], moe_up_cublas=False)
            if args.cublas_up:
                methods["fp8 cublas-up"] = with_options(lambda: fused_moe_fp8(
                    x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, down_ws=True),
                    moe_up_cublas=True)
                used["fp8 cublas-up"] = block_m["fp8"]
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
                    times[name].append(time_ms(fn))
            for name, samples in times.items():
                ms = statistics.median(samples)
                tflops = flops / (ms * 1e-3) / 1e12 if "align" not in name else None
                row = {"ms": round(ms, 4), "tflops": round(tflops, 1) if tflops else None,
                       "ms_samples": [round(v, 4) for v in samples]}
                record(run, row, mode="bench", tokens=t, routing=kind, method=name, block_m=used.get(name))
                results.append({"tokens": t, "routing": kind, "method": name, **row})
                spread = f" ({min(samples):.3f}-{max(samples):.3f})" if len(samples) > 1 else ""
                print(f"T={t:6d} {kind:9s} {name:22s} {ms:9.3f} ms{spread}  "
                      + (f"{tflops:7.1f} TFLOP/s" if tflops else ""))
            if has_grouped_mm:
                del xs_PH, offs_E, a_PI
            torch.cuda.empty_cache()

    # what the autotuner picked, per (kernel, key = N, K, BLOCK_M, size bucket, W_DESC, HALF_TAILS, dtypes...)
    from mimo_fn.kernels.moe.gemm import _TUNED

    tuned = {}
    for kind, kernels in _TUNED.items():
        for name, kernel in zip(("up", "down"), kernels):
            for key, cfg in getattr(kernel, "cache", {}).items():
                label = f"{kind} {name} N={key[0]} K={key[1]} BM={key[2]} bucket={key[3]} tma={key[4]} half={key[5]}"
                tuned[label] = str(cfg)
                print(f"tuned {label}: {cfg}")
    record(run, tuned, mode="tuned")

    # short table: TFLOP/s of the whole layer per method, and the two goal ratios
    print("\nTFLOP/s (median), FLOPs = 2*T*K*(H*2I + I*H)")
    names = []
    for r in results:
        if r["tflops"] is not None and r["method"] not in names:
            names.append(r["method"])
    print(f"{'tokens':>7} {'routing':9} " + " ".join(f"{n:>18}" for n in names))
    for t in args.tokens:
        for kind in args.routings:
            rows = {r["method"]: r for r in results if r["tokens"] == t and r["routing"] == kind}
            if rows:
                print(f"{t:7d} {kind:9} " + " ".join(
                    f"{rows[n]['tflops']:18.1f}" if n in rows else f"{'-':>18}" for n in names))
    print("\ngoal ratios (best timed block_m of each): ours bf16 / grouped_mm gemms, ours fp8 / ours bf16")
    for t in args.tokens:
        for kind in args.routings:
            rows = [r for r in results if r["tokens"] == t and r["routing"] == kind and r["tflops"]]
            best = {m: max((r["tflops"] for r in rows if r["method"] == m or r["method"].startswith(m + " bm")), default=None)
                    for m in ("grouped_mm gemms", "triton bf16", "triton fp8", "triton fp8 ws-down", "triton fp8 ws-up",
                              "triton fp8 ws-both", "fp8 cublas-up")}
            if best["triton bf16"] and best["triton fp8"]:
                vs_gmm = f"{best['triton bf16'] / best['grouped_mm gemms']:.3f}" if best["grouped_mm gemms"] else "-"
                ratio = best["triton fp8"] / best["triton bf16"]
                ws = {n: best[m] and round(best[m] / best["triton bf16"], 3)
                      for n, m in (("ws-down", "triton fp8 ws-down"), ("ws-up", "triton fp8 ws-up"),
                                   ("ws-both", "triton fp8 ws-both"), ("cublas-up", "fp8 cublas-up"))}
                record(run, {"bf16_vs_grouped_mm": vs_gmm, "fp8_vs_bf16": round(ratio, 3),
                             **{f"fp8_{n.replace('-', '_')}_vs_bf16": v for n, v in ws.items()}},
                       mode="ratios", tokens=t, routing=kind)
                print(f"{t:7d} {kind:9} bf16/grouped_mm {vs_gmm}  fp8/bf16 {ratio:.3f}"
                      + "".join(f"  fp8 {n}/bf16 {v:.3f}" for n, v in ws.items() if v))
