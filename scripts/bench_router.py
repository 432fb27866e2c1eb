"""Router logits: the 16-bit GEMM with fp32 output (CUDA path) against transformers' fp32 GEMM.

Legend: T tokens, H hidden (4096), X experts (256): the released dims, bf16 weights.

    python3 scripts/bench_router.py

Prints per size both times (`do_bench` medians) and each path's largest error against the
float64 product, as a fraction of sum |x| |w| (the tests bound it by 2^-18), plus how many
top-8 choices differ between the two paths (bias-free sigmoid scores).
"""

import torch
from triton.testing import do_bench

from mimo_fn.layers.router import router_logits

HIDDEN, EXPERTS = 4096, 256

if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_XH = (torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    for tokens in (8192, 65536):
        x_TH = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
        fast_TX = router_logits(x_TH, w_XH)
        fp32_TX = x_TH.float() @ w_XH.float().T
        ref_TX = x_TH.double() @ w_XH.double().T
        mag_TX = x_TH.double().abs() @ w_XH.double().abs().T
        err_fast = ((fast_TX.double() - ref_TX).abs() / mag_TX).max().item()
        err_fp32 = ((fp32_TX.double() - ref_TX).abs() / mag_TX).max().item()
        ids_fast = torch.sigmoid(fast_TX).topk(8, dim=-1).indices.sort(-1).values
        ids_fp32 = torch.sigmoid(fp32_TX).topk(8, dim=-1).indices.sort(-1).values
        moved = (ids_fast != ids_fp32).any(-1).sum().item()
        t_fast = do_bench(lambda: router_logits(x_TH, w_XH))
        t_fp32 = do_bench(lambda: x_TH.float() @ w_XH.float().T)
        print(f"| {tokens} x {HIDDEN} x {EXPERTS} | fp32 {t_fp32:.3f} ms | 16-bit GEMM {t_fast:.3f} ms | "
              f"max err / sum|x||w|: fp32 {err_fp32:.1e}, 16-bit {err_fast:.1e} | tokens whose top-8 differ: {moved} |")
