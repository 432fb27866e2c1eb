"""Benchmark the MoE expert layer on one GPU at prefill shapes (MiMo-V2-Flash: top-8 of 256
experts, hidden 4096, expert intermediate 2048).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, P = T*K pairs.

    FLOPs = 2 * T * K * (H * 2I + I * H)   (up GEMM + down GEMM over the real pairs; the
                                             padding of aligned blocks is not counted)

Methods, all timed with triton.testing.do_bench (median) in this one process:
  grouped_mm gemms   torch._grouped_mm bf16: the two grouped GEMMs + SiLU*up on rows already
                     sorted by expert (the library's GEMM speed, the baseline to beat)
  grouped_mm layer   the same plus what a layer needs around it: sort, gather, router weight,
                     un-sort and the sum over k
  triton bf16        mimo_fn.kernels.moe_gemm.fused_moe (whole layer: align, up, down, sum)
  triton fp8         fused_moe_fp8 (whole layer, activation quantisation included)
Routing: balanced (K distinct uniform experts per token) and skewed (distinct experts drawn
with Zipf popularity p_e ~ 1/(1+e)). Outputs are checked against fused_moe_ref at 4K tokens
before timing. Writes $OUT/bench_moe.json when OUT is set.

    python scripts/bench_moe.py [--tokens 4096 16384 65536] [--budget-s 240]
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from mimo_fn.kernels.moe_align import moe_align  # noqa: E402
from mimo_fn.kernels.moe_gemm import default_block_m, fused_moe, fused_moe_fp8, fused_moe_ref  # noqa: E402
from mimo_fn.quant import quantize_fp8_block  # noqa: E402

E, K, H, I = 256, 8, 4096, 2048


def routing(kind: str, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "balanced":
        ids_TK = torch.rand(t, E, device="cuda", generator=gen).argsort(dim=1)[:, :K]
    else:
        popularity_E = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32)
        ids_TK = torch.multinomial(popularity_E.expand(t, E).contiguous(), K, replacement=False, generator=gen)
    weights_TK = torch.rand(t, K, device="cuda", generator=gen) + 0.1
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


def grouped_mm_gemms(xs_PH, offs_E, w13t_EH2I, w2t_EIH):
    h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    return torch._grouped_mm(F.silu(h_P2I[:, :I]) * h_P2I[:, I:], w2t_EIH, offs=offs_E)


def rel_err(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--routings", nargs="+", default=["balanced", "skewed"])
    ap.add_argument("--block-m-sweep", action="store_true", help="also time block_m 64 and 128 (balanced)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this many seconds")
    args = ap.parse_args()
    t_start = time.time()
    out_dir = os.environ.get("OUT")
    gen = torch.Generator(device="cuda").manual_seed(0)
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
    }

    def save() -> None:
        if out_dir:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, "bench_moe.json").write_text(json.dumps(report, indent=2))

    print(f"{props.name}  torch {torch.__version__}  triton {triton.__version__}  {report['date']}")
    x_TH = torch.randn(max(args.tokens), H, device="cuda", generator=gen).bfloat16()
    w13_E2IH = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    w2_EHI = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    w13_q, w2_q = quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI)  # fp32 one matrix at a time
    w13t_EH2I, w2t_EIH = w13_E2IH.transpose(1, 2), w2_EHI.transpose(1, 2)  # views: what grouped_mm wants
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    print(f"torch._grouped_mm available: {has_grouped_mm}")

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
                methods["grouped_mm gemms"] = lambda: grouped_mm_gemms(xs_PH, offs_E, w13t_EH2I, w2t_EIH)
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
            methods["moe_align only"] = lambda: moe_align(ids_TK, E, block_m["bf16"])
            for name, fn in methods.items():
                fn()  # autotune / compile outside the timing
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                tflops = flops / (ms * 1e-3) / 1e12 if "align" not in name else None
                row = {"tokens": t, "routing": kind, "method": name, "ms": round(ms, 4),
                       "tflops": round(tflops, 1) if tflops else None, "block_m": used.get(name)}
                report["results"].append(row)
                print(f"T={t:6d} {kind:9s} {name:22s} {ms:9.3f} ms  " + (f"{tflops:7.1f} TFLOP/s" if tflops else ""))
                save()
            if has_grouped_mm:
                del xs_PH, offs_E
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
    # what the autotuner picked, per (kernel, key = N, K, BLOCK_M, size bucket, dtypes...)
    from mimo_fn.kernels.moe_gemm import _TUNED

    report["tuned"] = {}
    for kind, kernels in _TUNED.items():
        for name, kernel in zip(("up", "down"), kernels):
            for key, cfg in getattr(kernel, "cache", {}).items():
                label = f"{kind} {name} N={key[0]} K={key[1]} BM={key[2]} bucket={key[3]}"
                report["tuned"][label] = str(cfg)
                print(f"tuned {label}: {cfg}")
    print(f"total {time.time() - t_start:.0f} s")
    save()


if __name__ == "__main__":
    main()
