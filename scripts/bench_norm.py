"""RMSNorm: the one-pass kernel (mimo_fn/kernels/rmsnorm.py) against the torch reference.

Legend: T tokens, H hidden (4096, the released dims), bf16.

    python3 scripts/bench_norm.py

Prints one row per size: both times (`do_bench` medians), the kernel's bandwidth (read x,
write y), the fraction of outputs that differ from the reference and their largest relative
difference (the fp32 sum of squares is added in another order; see the kernel's docstring).
"""

import torch
from triton.testing import do_bench

from mimo_fn.kernels.rmsnorm import rms_norm_fused
from mimo_fn.layers.norm import rms_norm_ref

HIDDEN = 4096

if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for tokens in (8192, 65536):
        x_TH = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
        w_H = torch.randn(HIDDEN, device="cuda").bfloat16()
        ref_TH, out_TH = rms_norm_ref(x_TH, w_H, 1e-6).float(), rms_norm_fused(x_TH, w_H, 1e-6).float()
        diff_TH = (out_TH - ref_TH).abs()
        max_rel = (diff_TH / ref_TH.abs().clamp_min(1e-30)).max().item()
        t_ref = do_bench(lambda: rms_norm_ref(x_TH, w_H, 1e-6))
        t_fused = do_bench(lambda: rms_norm_fused(x_TH, w_H, 1e-6))
        gbs = 2 * x_TH.numel() * x_TH.element_size() / t_fused / 1e6
        print(f"| {tokens} x {HIDDEN} bf16 | ref {t_ref:.3f} ms | fused {t_fused:.3f} ms ({gbs:.0f} GB/s) | "
              f"differing outputs {(diff_TH > 0).float().mean().item():.2e}, max rel {max_rel:.2e} |")
