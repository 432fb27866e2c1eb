"""Prefill of the 6-layer MiMo-V2-Flash slice with MXFP4 experts (FP8 elsewhere), the two MXFP4
MoE paths against each other in one process: in-GEMM dequantisation (options.mxfp4_dequant
False, as MIMO_FN_MXFP4_DEQUANT=0) and the default (None, the size rule), which from
kernels.moe.mxfp4.DEQUANT_MIN_PAIRS pairs an expert runs the bf16 kernels on a dequantised copy.
Per (ISL, chunk): one sequence, a warm-up, the better of two timed runs, the last-token logits'
max-abs relative difference between the paths and each path's peak memory.

    python -m mimo_fn.bench mxfp4-paths [--cases 16384:16384 65536:16384 65536:32768 8192:8192]
"""

import torch

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.workload import flash_slice, timed_prefill
from mimo_fn.params import quantize_params

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--cases", nargs="+", default=["16384:16384", "65536:16384", "65536:32768", "8192:8192"],
                    help="ISL:chunk pairs")


def main(args, run) -> None:
    cases = []
    for case in args.cases:
        try:
            isl, chunk = map(int, case.split(":"))
        except ValueError:
            raise SystemExit(f"mxfp4-paths: --cases expects ISL:chunk pairs of ints, got {case!r}") from None
        cases.append((isl, chunk))
    cfg = flash_slice()
    params = quantize_params(cfg, mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda"), experts="mxfp4")
    torch.cuda.empty_cache()
    rows = []
    for isl, chunk in cases:
        res = {}
        for path, dequant in (("in-GEMM", False), ("default", None)):
            with options.override(mxfp4_dequant=dequant):
                timed_prefill(cfg, params, [min(isl, chunk)], chunk)  # warm-up: compile and tune this size
                torch.cuda.reset_peak_memory_stats()
                runs = [timed_prefill(cfg, params, [isl], chunk) for _ in range(2)]
            res[path] = (min(r[0] for r in runs), runs[-1][1][0].float(), torch.cuda.max_memory_allocated() / 2**30)
        a, b = res["in-GEMM"][1], res["default"][1]
        row = {"in_gemm_tok_s": isl / res["in-GEMM"][0], "default_tok_s": isl / res["default"][0],
               "speedup": res["in-GEMM"][0] / res["default"][0],
               "logits_rel_diff": float((a - b).abs().max() / a.abs().max()),
               "in_gemm_peak_gib": res["in-GEMM"][2], "default_peak_gib": res["default"][2]}
        record(run, row, isl=isl, chunk=chunk)
        rows.append({"isl": isl, "chunk": chunk, **row})
        print(rows[-1], flush=True)
    print_table(rows, [("isl", "isl", "d"), ("chunk", "chunk", "d"), ("in-GEMM tok/s", "in_gemm_tok_s", ",.0f"),
                       ("default tok/s", "default_tok_s", ",.0f"), ("speedup", "speedup", ".2f"),
                       ("logit rel", "logits_rel_diff", ".1e"), ("in-GEMM GiB", "in_gemm_peak_gib", ".1f"),
                       ("default GiB", "default_peak_gib", ".1f")])
