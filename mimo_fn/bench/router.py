"""Router logits: the 16-bit GEMM with fp32 output (CUDA path) against transformers' fp32 GEMM.

Legend: T tokens, H hidden (4096), X experts (256): the released dims, bf16 weights.

    python -m mimo_fn.bench router [--tokens 8192 65536]

Prints per size both times (mimo_fn.bench.timing.time_ms: do_bench, median) and each path's
largest error against the float64 product, as a fraction of sum |x| |w| (the tests bound it by
2^-18), plus how many top-8 choices differ between the two paths (bias-free sigmoid scores).
"""

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms
from mimo_fn.layers.router import router_logits

NEEDS_CUDA = True
HIDDEN, EXPERTS = 4096, 256


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536], help="token counts T")


def main(args, run) -> None:
    print(f"{run.device}  torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_XH = (torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5).bfloat16()
    rows = []
    for tokens in args.tokens:
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
        t_fast = time_ms(lambda: router_logits(x_TH, w_XH))
        t_fp32 = time_ms(lambda: x_TH.float() @ w_XH.float().T)
        res = {"fp32_ms": t_fp32, "gemm16_ms": t_fast, "fp32_err": err_fp32, "gemm16_err": err_fast, "top8_differ": moved}
        record(run, res, tokens=tokens, hidden=HIDDEN, experts=EXPERTS)
        rows.append({"shape": f"{tokens} x {HIDDEN} x {EXPERTS}", **res})
    print_table(rows, [("T x H x X", "shape", ""), ("fp32 ms", "fp32_ms", ".3f"), ("16-bit ms", "gemm16_ms", ".3f"),
                       ("fp32 err", "fp32_err", ".1e"), ("16-bit err", "gemm16_err", ".1e"),
                       ("top-8 differ", "top8_differ", "d")],
                "err: max |logit - float64| / sum|x||w|; top-8 differ: tokens whose top-8 differ between the paths")
