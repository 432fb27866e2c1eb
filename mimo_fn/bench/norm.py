"""RMSNorm: the one-pass kernel (mimo_fn/kernels/rmsnorm.py) against the torch reference.

Legend: T tokens, H hidden (4096, the released dims), bf16.

    python -m mimo_fn.bench norm [--tokens 8192 65536]

Prints one row per size: both times (mimo_fn.bench.timing.time_ms: do_bench, median), the
kernel's bandwidth (read x, write y), the fraction of outputs that differ from the reference and
their largest relative difference (the fp32 sum of squares is added in another order; see the
kernel's docstring).
"""

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.rmsnorm import rms_norm_fused
from mimo_fn.layers.norm import rms_norm_ref

NEEDS_CUDA = True
HIDDEN = 4096


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536], help="token counts T")


def main(args, run) -> None:
    print(f"{run.device}  torch {torch.__version__}")
    rows = []
    for tokens in args.tokens:
        x_TH = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        w_H = torch.randn(HIDDEN, device="cuda").bfloat16()
        ref_TH, out_TH = rms_norm_ref(x_TH, w_H, 1e-6).float(), rms_norm_fused(x_TH, w_H, 1e-6).float()
        diff_TH = (out_TH - ref_TH).abs()
        max_rel = (diff_TH / ref_TH.abs().clamp_min(1e-30)).max().item()
        t_ref = time_ms(lambda: rms_norm_ref(x_TH, w_H, 1e-6))
        t_fused = time_ms(lambda: rms_norm_fused(x_TH, w_H, 1e-6))
        res = {"ref_ms": t_ref, "fused_ms": t_fused,
               "fused_gb_s": 2 * x_TH.numel() * x_TH.element_size() / t_fused / 1e6,
               "differing_share": (diff_TH > 0).float().mean().item(), "max_rel_diff": max_rel}
        record(run, res, tokens=tokens, hidden=HIDDEN)
        rows.append({"shape": f"{tokens} x {HIDDEN}", **res})
    print_table(rows, [("T x H (bf16)", "shape", ""), ("ref ms", "ref_ms", ".3f"), ("fused ms", "fused_ms", ".3f"),
                       ("fused GB/s", "fused_gb_s", ".0f"), ("differing", "differing_share", ".2e"),
                       ("max rel", "max_rel_diff", ".2e")])
