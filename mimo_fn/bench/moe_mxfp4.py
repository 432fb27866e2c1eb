"""Benchmark the MoE expert layer with MXFP4 weights against the bf16 and FP8 layers on one GPU
(MiMo-V2-Flash: top-8 of 256 experts, hidden 4096, expert intermediate 2048).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, P = T*K pairs.

    FLOPs = 2 * T * K * (H * 2I + I * H)          (real pairs; padding of aligned blocks not counted)
    bytes = unique experts hit * one expert's weight bytes (+ scales)   (decode sizes)

Routing: balanced and deterministic, token t's k-th expert = (t*8 + k) % 256. Sizes: prefill
4096 and 16384 tokens, decode 1, 8 and 64 tokens. Methods, all in this one process:
  bf16         kernels.moe.gemm.fused_moe on bf16 weights
  fp8          kernels.moe.gemm.fused_moe_fp8 on quant.quantize_fp8_block weights (activations FP8 too)
  mxfp4        kernels.moe.dispatch.fused_moe_mxfp4 on quant.quantize_mxfp4 weights, dequantised in the GEMMs
               (PTX dequantisation; dequantize=False)
  mxfp4-dq     the same weights through fused_moe_mxfp4's dequantised-copy path (dequantize=True:
               a bf16 copy of w13, then of w2, each freed after its GEMM, and gemm.py's bf16
               kernels; the copies' time included); the layer picks it from
               kernels.moe.mxfp4.DEQUANT_MIN_PAIRS pairs per expert
  mxfp4-port   the same with options.mxfp4_fast_cvt off (the portable dequantisation), at its
               untuned default configs (a comparison of dequantisations, not a tuned result)
The bf16 weights are the MXFP4 weights dequantised (exact in bf16), and the FP8 weights are
those quantised, so `bf16` computes what `fused_moe_mxfp4_ref` defines: each size checks the
mxfp4 layer against it (relative max-abs error) before timing.
Timing: mimo_fn.bench.timing.time_ms, i.e. do_bench (median, L2 flushed between runs) at
prefill sizes; at decode sizes do_bench_cudagraph (median; one graph of back-to-back layers, so
host launch overhead is not timed; the weights the layers read, >= 100 MB, exceed the 50 MB L2). Decode bandwidth is
against the H200's 4.24 TB/s copy bandwidth. Autotuning (--tune): all kernels, only the MXFP4
ones (bf16 / FP8 and mxfp4-dq's bf16 kernels at their first, tuned-default configs: less
compile time), or none. With mxfp4-dq the copy alone (kernels.moe.mxfp4_dequant.dequant_mxfp4 of w13 and of
w2) is timed too, bytes = packed data + scales read + bf16 written.

    python -m mimo_fn.bench moe-mxfp4 [--tokens 4096 16384 1 8 64] [--tune all|mxfp4|none]
                                      [--methods bf16 fp8 mxfp4 mxfp4-dq mxfp4-port]
"""

import time

import torch

from mimo_fn import options
from mimo_fn.bench.moe_layer import DEV, E, H, I, K
from mimo_fn.bench.results import record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.moe import mxfp4
from mimo_fn.kernels.moe.dispatch import fused_moe_mxfp4
from mimo_fn.kernels.moe.gemm import fused_moe, fused_moe_fp8
from mimo_fn.kernels.moe.mxfp4_dequant import dequant_mxfp4
from mimo_fn.quant import MX_GROUP, MXFP4, QTensor, dequantize, quantize_fp8_block, quantize_mxfp4

NEEDS_CUDA = True

DECODE_MAX = 64  # sizes up to this are decode sizes: CUDA-graph timing and bandwidth
COPY_TBPS = 4.24  # H200 device-to-device copy bandwidth, TB/s


def build_weights(chunk: int, gen: torch.Generator) -> dict:
    """MXFP4 w13 / w2 from 0.02 * randn, quantised on the GPU a few experts at a time; bf16 =
    the MXFP4 weights dequantised; FP8 = those block-quantised."""
    ws = {}
    for name, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
        data = torch.empty(E, n, k // 2, dtype=torch.uint8, device=DEV)
        scale = torch.empty(E, n, k // MX_GROUP, dtype=torch.uint8, device=DEV)
        dense = torch.empty(E, n, k, dtype=torch.bfloat16, device=DEV)
        for e0 in range(0, E, chunk):
            w = torch.randn(min(chunk, E - e0), n, k, device=DEV, generator=gen, dtype=torch.bfloat16) * 0.02
            q = quantize_mxfp4(w)
            del w
            data[e0:e0 + chunk], scale[e0:e0 + chunk] = q.data, q.scale
            dense[e0:e0 + chunk] = dequantize(q, torch.bfloat16)
            del q
        ws[name] = {"mxfp4": QTensor(data, scale, MXFP4), "bf16": dense}
        ws[name]["fp8"] = quantize_fp8_block(dense)
        torch.cuda.empty_cache()
    return ws


def expert_bytes(ws: dict, method: str) -> int:
    """Bytes of one expert's w13 + w2 as `method` stores them (data and scales)."""
    total = 0
    for name in ("w13", "w2"):
        w = ws[name]["fp8" if method == "fp8" else "mxfp4" if method.startswith("mxfp4") else "bf16"]
        parts = (w,) if isinstance(w, torch.Tensor) else (w.data, w.scale)
        total += sum(p[0].numel() * p.element_size() for p in parts)
    return total


def layer_fn(method: str, ws: dict, x_TH, ids_TK, weights_TK):
    if method == "bf16":
        return lambda: fused_moe(x_TH, ws["w13"]["bf16"], ws["w2"]["bf16"], ids_TK, weights_TK)
    if method == "fp8":
        w13, w2 = ws["w13"]["fp8"], ws["w2"]["fp8"]
        return lambda: fused_moe_fp8(x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)
    return lambda: fused_moe_mxfp4(x_TH, ws["w13"]["mxfp4"], ws["w2"]["mxfp4"], ids_TK, weights_TK,
                                   dequantize=method == "mxfp4-dq")


def method_options(method: str, tune: str) -> dict:
    """The switches a method runs under (fields of mimo_fn.options.Options, read at every
    launch): the dequantisation and whether it autotunes."""
    tuned = tune == "all" or (tune == "mxfp4" and method == "mxfp4")
    return {"mxfp4_fast_cvt": method != "mxfp4-port", "moe_autotune": tuned}


def time_method(fn, method: str, ws: dict, t: int, ref_TH, experts_hit: int, decode: bool) -> dict:
    t1 = time.time()
    err = rel_err(fn(), ref_TH)  # also the warm-up: compiles and autotunes
    ms = time_ms(fn, rep_ms=50, cuda_graph=True) if decode else time_ms(fn, warmup_ms=50, rep_ms=200)
    row = {"ms": ms, "tflops": 2 * (H * 2 * I + I * H) * t * K / ms / 1e9,
           "rel_err_vs_bf16_dequant": err, "experts_hit": experts_hit, "wall_s": time.time() - t1}
    if decode:
        row["weight_bytes"] = experts_hit * expert_bytes(ws, method)
        row["tbps"] = row["weight_bytes"] / ms / 1e9
        row["copy_bw_share"] = row["tbps"] / COPY_TBPS
    return row


def tuned_picks() -> list[str]:
    """The MXFP4 autotuners' choices: kernel, key (N, K, BLOCK_M, size bucket, FAST_CVT), config."""
    picks = []
    for lists_name, tuned in (("", mxfp4._TUNED), ("small-M ", mxfp4._TUNED_SMALL_M)):
        for kind, kernels in tuned.items():
            for stage, kernel in zip(("up", "down"), kernels):
                for key, cfg in kernel.cache.items():
                    picks.append(f"{lists_name}{kind} {stage} {key[:5]}: {cfg}")
    return picks


def rel_err(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max())


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 1, 8, 64],
                    help=f"token counts; up to {DECODE_MAX} are decode sizes")
    ap.add_argument("--methods", nargs="+", default=["bf16", "fp8", "mxfp4", "mxfp4-port"],
                    choices=["bf16", "fp8", "mxfp4", "mxfp4-dq", "mxfp4-port"], help="methods (see above)")
    ap.add_argument("--tune", default="all", choices=["all", "mxfp4", "none"], help="which kernels autotune")
    ap.add_argument("--chunk", type=int, default=16, help="experts quantised at a time")


def main(args, run) -> None:
    t0 = time.time()
    gen = torch.Generator(device=DEV).manual_seed(0)
    ws = build_weights(args.chunk, gen)
    torch.cuda.synchronize()
    print(f"weights built in {time.time() - t0:.1f} s; bytes / expert: "
          + ", ".join(f"{m} {expert_bytes(ws, m) / 1e6:.1f} MB" for m in args.methods), flush=True)
    rows = []
    if "mxfp4-dq" in args.methods:
        for name in ("w13", "w2"):
            q = ws[name]["mxfp4"]
            ms = time_ms(lambda: dequant_mxfp4(q), warmup_ms=20, rep_ms=100)
            moved = q.data.numel() + q.scale.numel() + 2 * ws[name]["bf16"].numel()
            exact = bool(torch.equal(dequant_mxfp4(q), ws[name]["bf16"]))
            print(f"dequant_mxfp4 {name}: {ms:.3f} ms, {moved / ms / 1e9:.2f} TB/s "
                  f"({100 * moved / ms / 1e9 / COPY_TBPS:.0f}% of copy), equals the bf16 weights: {exact}", flush=True)
            record(run, {"ms": ms, "tbps": moved / ms / 1e9, "exact": exact}, section="dequant_copy", weights=name)
    for t in args.tokens:
        decode = t <= DECODE_MAX
        x_TH = torch.randn(t, H, device=DEV, generator=gen, dtype=torch.bfloat16)
        ids_TK = ((torch.arange(t, device=DEV)[:, None] * K + torch.arange(K, device=DEV)) % E).long()
        weights_TK = torch.rand(t, K, device=DEV, generator=gen) + 0.1
        experts_hit = int(torch.unique(ids_TK).numel())
        with options.override(**method_options("bf16", args.tune)):
            ref_TH = layer_fn("bf16", ws, x_TH, ids_TK, weights_TK)()  # fused_moe_mxfp4_ref's numerics
        for method in args.methods:
            fn = layer_fn(method, ws, x_TH, ids_TK, weights_TK)
            with options.override(**method_options(method, args.tune)):
                row = time_method(fn, method, ws, t, ref_TH, experts_hit, decode)
            record(run, row, section="layer", tokens=t, method=method)
            rows.append({"tokens": t, "method": method, **row})
            extra = f"  {row['tbps']:.2f} TB/s ({100 * row['copy_bw_share']:.0f}% of copy)" if decode else ""
            print(f"T={t:6d} {method:10s} {row['ms']:9.4f} ms {row['tflops']:7.1f} TFLOP/s{extra}  rel err vs "
                  f"bf16(dequant) {row['rel_err_vs_bf16_dequant']:.2e}  [{row['wall_s']:.0f} s]", flush=True)
        del x_TH, ref_TH
    picks = tuned_picks()
    for p in picks:
        print(f"autotuned {p}")
    record(run, {"mxfp4_autotuned": picks}, section="tuned")
    print(f"total {time.time() - t0:.0f} s")
    print(f"\n{'tokens':>6} {'method':>10} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>6} {'%copy':>6} {'rel err':>8}")
    for r in rows:
        bw = f"{r['tbps']:6.2f} {100 * r['copy_bw_share']:5.0f}%" if "tbps" in r else f"{'':6} {'':6}"
        print(f"{r['tokens']:6d} {r['method']:>10} {r['ms']:9.4f} {r['tflops']:8.1f} {bw} "
              f"{r['rel_err_vs_bf16_dequant']:8.1e}")
