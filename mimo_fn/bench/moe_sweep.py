"""--mode sweep of `python -m mimo_fn.bench moe`: each candidate launch config of the up and the
down MoE kernel timed alone (balanced routing, fixed config, TMA or pointer weights), what the
autotune lists should hold.

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, M aligned rows.
"""

import time

import torch

from mimo_fn.bench.moe_layer import E, H, I, K, Weights, routing
from mimo_fn.bench.results import record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe import down_ws
from mimo_fn.kernels.moe import gemm as moe_gemm
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.gemm import _cfg
from mimo_fn.quant import FP8_DTYPE


# sweep candidates, most telling first: (label, kind, stage 0 up / 1 down, block_m, config, tma)
def _sweep_candidates():
    c = []
    for tma in (False, True):
        c.append(("bf16 up 128x2x128x64 w8 s3", "bf16", 0, 128, _cfg(128, 64, 8, 3), tma))
        c.append(("bf16 down 128x256x64 w8 s3", "bf16", 1, 128, _cfg(256, 64, 8, 3), tma))
        c.append(("fp8 up 128x2x128x128 w4 s3", "fp8", 0, 128, _cfg(128, 128, 4, 3), tma))
        c.append(("fp8 down 128x128x128 w4 s3", "fp8", 1, 128, _cfg(128, 128, 4, 3), tma))
    # the warp-specialised Gluon down GEMM (kernels/moe/down_ws.py): config None marks it
    c.append(("fp8 down ws", "fp8", 1, 128, None, True))
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


def sweep(w: Weights, tokens, gen, run, t_start, budget_s, only) -> list[dict]:
    """Each candidate config of each kernel timed alone at each token count (balanced); only:
    substrings of the labels to run (all when empty). Returns the timed rows."""
    rows = []
    x_TH, w13_E2IH, w2_EHI, w13_q, w2_q = w.x_TH, w.w13_E2IH, w.w2_EHI, w.w13_q, w.w2_q
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
            if cfg is None and not down_ws.serves(h_MI, w2, bm):  # else _moe_down would time the Triton kernel
                print(f"T={t:6d} {label:34s} skipped: {down_ws.unsupported_reason(h_MI) or 'shape'}")
                continue
            if stage == 0:
                fn = lambda: moe_gemm._moe_up(*up_args, cfg=cfg, tma=tma)  # noqa: E731
                flops = 2 * t * K * H * 2 * I
            else:
                fn = lambda: moe_gemm._moe_down(h_MI, hs_MIb, w2, w2_s, al, weights_TK, torch.bfloat16, cfg=cfg, tma=tma,  # noqa: E731
                                                ws=cfg is None)
                flops = 2 * t * K * I * H
            try:
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                ms = time_ms(fn, warmup_ms=10, rep_ms=60)
            except Exception as err:  # a config that does not compile or fit: record, go on
                print(f"T={t:6d} {label:34s} tma={int(tma)} FAILED {type(err).__name__}: {str(err)[:200]}")
                record(run, {"error": str(err)[:500]}, mode="sweep", tokens=t, label=label, tma=tma)
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            record(run, {"ms": round(ms, 4), "tflops": round(tflops, 1), "first_call_s": compile_s},
                   mode="sweep", tokens=t, label=label, tma=tma)
            rows.append({"tokens": t, "label": label, "tma": int(tma), "ms": ms, "tflops": tflops})
            print(f"T={t:6d} {label:34s} tma={int(tma)} {ms:8.3f} ms {tflops:7.1f} TFLOP/s  (first call {compile_s:.1f} s)")
        del inputs
        torch.cuda.empty_cache()
    return rows
