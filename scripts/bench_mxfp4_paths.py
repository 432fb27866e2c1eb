"""Prefill of the 6-layer MiMo-V2-Flash slice with MXFP4 experts (FP8 elsewhere), the two MXFP4
MoE paths against each other in one process: in-GEMM dequantisation (MIMO_FN_MXFP4_DEQUANT=0)
and the default, which from moe_mxfp4.DEQUANT_MIN_PAIRS pairs an expert runs the bf16 kernels on
a dequantised copy. Per (ISL, chunk): one sequence, a warm-up, the better of two timed runs, the
last-token logits' max-abs relative difference between the paths and each path's peak memory.

    python scripts/bench_mxfp4_paths.py [--cases 16384:16384 65536:16384 65536:32768 8192:8192]
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402
from bench_prefill import run_prefill, slice_config  # noqa: E402
from mimo_fn.params import quantize_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["16384:16384", "65536:16384", "65536:32768", "8192:8192"],
                    help="ISL:chunk pairs")
    args = ap.parse_args()
    cfg = slice_config()
    params = quantize_params(cfg, mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda"), experts="mxfp4")
    torch.cuda.empty_cache()
    rows = []
    for case in args.cases:
        isl, chunk = map(int, case.split(":"))
        res = {}
        for path, env in (("in-GEMM", "0"), ("default", None)):
            if env is None:
                os.environ.pop("MIMO_FN_MXFP4_DEQUANT", None)
            else:
                os.environ["MIMO_FN_MXFP4_DEQUANT"] = env
            run_prefill(cfg, params, [min(isl, chunk)], chunk)  # warm-up: compile and tune this size
            torch.cuda.reset_peak_memory_stats()
            runs = [run_prefill(cfg, params, [isl], chunk) for _ in range(2)]
            res[path] = (min(r[0] for r in runs), runs[-1][1][0].float(), torch.cuda.max_memory_allocated() / 2**30)
        os.environ.pop("MIMO_FN_MXFP4_DEQUANT", None)
        a, b = res["in-GEMM"][1], res["default"][1]
        rows.append((isl, chunk, res["in-GEMM"][0], res["default"][0], float((a - b).abs().max() / a.abs().max()),
                     res["in-GEMM"][2], res["default"][2]))
        print(rows[-1], flush=True)
    print(f"{'isl':>6} {'chunk':>6} {'in-GEMM tok/s':>14} {'default tok/s':>14} {'speedup':>8} {'logit rel':>9} "
          f"{'peak GiB':>12}")
    for isl, chunk, t0, t1, err, m0, m1 in rows:
        print(f"{isl:6d} {chunk:6d} {isl / t0:14,.0f} {isl / t1:14,.0f} {t0 / t1:8.2f} {err:9.1e} {m0:5.1f}/{m1:5.1f}")


if __name__ == "__main__":
    main()
