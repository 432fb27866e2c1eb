"""Deterministic mode on and off: prefill tok/s and decode step time (docs/deterministic.md).

A 6-layer slice of MiMo-V2-Flash at the released dims (full dense, SWA MoE x4, full MoE), random
weights in bf16 and FP8, on one GPU. For each weight format and each mode
(init_state(..., deterministic=False / True), what EngineConfig.deterministic sets):
  prefill tok/s   one sequence of each --isl tokens in --chunk chunks (best of two runs, after a
                  warm-up at 2K that compiles and tunes)
  decode ms       one greedy step of --batch sequences of --prompt tokens through mf.decode,
                  from CUDA graphs (DecodeGraphs, as the engine runs them), averaged over --steps
and the ratio on / off. The issue's goal: within 10% at 16K+ prefill, 15% at decode B = 64.
--profile adds each prefill's device time by kernel category (attention, MoE, dense GEMMs, other;
bench.prefill.split_of), off and on, and a decode step's (one more run of the graphs, profiled).
--linears times instead the slice's linear shapes (attention projections, the dense MLP) at each
--linear-m rows, per --dtypes: in bf16 cuBLAS (what the mode replaces) against the mode's linear
(kernels.gemm_ws on Hopper, else fixed_gemm) and kernels.fixed_gemm at its tiles and at other fixed
tiles (TILE_CANDIDATES); in FP8 the default path (scaled_mm, or the split-K Triton kernel for a few
rows) against kernels.fp8_linear's deterministic tiles (FP8_TILE_CANDIDATES); in TFLOP/s, and what
each costs over the slice's linears in one 16K prefill: where the mode's prefill time goes, and
which fixed tile would buy it back. --ws adds the warp-specialised Gluon GEMM (Hopper only:
kernels.gemm_ws in bf16, kernels.fp8_gemm_ws in FP8) and its largest error against an fp32
reference (x @ w.T, fp8_linear_ref) relative to the reference's largest magnitude.

    python -m mimo_fn.bench deterministic [--isl 16384 65536] [--batch 64] [--dtypes bf16 fp8]
    python -m mimo_fn.bench deterministic --linears [--linear-m 16384 64] [--dtypes bf16 fp8] [--ws]
"""

from collections import Counter
from functools import partial

import torch
import torch.nn.functional as F

import mimo_fn as mf
from mimo_fn.bench.decode import decode_run
from mimo_fn.bench.prefill import split_of
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms, wall_s
from mimo_fn.bench.workload import flash_slice, pool_tokens, prefill_chunks, slice_params
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.kernels import fp8_gemm_ws as fgw
from mimo_fn.kernels import fp8_linear as fl
from mimo_fn.kernels import gemm_ws as gw
from mimo_fn.kernels.fixed_gemm import CUDA_TILES, CUDA_TILES_LARGE_M, FixedTiles, fixed_gemm
from mimo_fn.layers.linear import linear, linear_fp8
from mimo_fn.params import describe
from mimo_fn.quant import quantize_fp8_act_ref, quantize_fp8_block

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--isl", type=int, nargs="+", default=[16384], help="prefill lengths (one sequence each)")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk, tokens per pass")
    ap.add_argument("--batch", type=int, nargs="+", default=[64], help="decode batch sizes B")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens per decoding sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"], help="weight formats")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one prefill and one decode run off and on: device ms by kernel category "
                         "(default: off)")
    ap.add_argument("--linears", action="store_true",
                    help="time the slice's bf16 linear shapes, cuBLAS vs fixed tiles, instead (default: off)")
    ap.add_argument("--linear-m", type=int, nargs="+", default=[16384, 64], help="--linears: rows M per shape")
    ap.add_argument("--ws", action="store_true",
                    help="--linears: also the warp-specialised Gluon GEMMs and their error (default: off)")


# fixed tiles worth timing beside the mode's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): each is as
# M-invariant as the mode's own; which is fastest at both prefill and decode sizes is the question
TILE_CANDIDATES = [FixedTiles(128, 256, 64, 8, 3), FixedTiles(128, 128, 64, 4, 4), FixedTiles(64, 256, 64, 8, 4)]
# the same for kernels.fp8_linear's deterministic tiles (BLOCK_M, BLOCK_N, warps, stages)
FP8_TILE_CANDIDATES = [(128, 256, 8, 3), (128, 128, 4, 4), (64, 256, 8, 3)]
WS_NAMES = {"bf16": "ws (Gluon 128x256)", "fp8": "ws (Gluon 128x128)"}  # --ws: kernels.gemm_ws, fp8_gemm_ws


def linear_shapes(cfg) -> Counter:
    """(N, K) of every full-precision 2-D GEMM weight of cfg's layers -> how many the model has."""
    return Counter(tuple(info.shape) for name, info in describe(cfg).items()
                   if name.startswith("layers.") and len(info.shape) == 2 and info.quantizable)


def linears(args, run) -> None:
    """--linears: see the module docstring (per --dtypes: bf16 as fixed_gemm, FP8 as fp8_linear)."""
    for dtype in args.dtypes:
        _linears(args, run, dtype)


def _linears(args, run, dtype: str) -> None:
    cfg = flash_slice()
    shapes = linear_shapes(cfg)
    if dtype == "bf16":
        tiles = [CUDA_TILES, CUDA_TILES_LARGE_M] + [t for t in TILE_CANDIDATES
                                                   if t not in (CUDA_TILES, CUDA_TILES_LARGE_M)]
        names = ["cuBLAS"] + [f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}" for t in tiles]
    else:  # fp8_linear's K step is the 128-deep scale block
        tiles = [fl.DET_TILES, fl.DET_TILES_LARGE_M] + [t for t in FP8_TILE_CANDIDATES
                                                       if t not in (fl.DET_TILES, fl.DET_TILES_LARGE_M)]
        names = ["default (scaled_mm / split-K Triton)"] + [f"{m}x{n}x128 w{w} s{st}" for m, n, w, st in tiles]
    names.insert(1, "mode (deterministic linear)")
    ws = args.ws
    if ws:
        names.append(WS_NAMES[dtype])
    rows, totals = [], {m: Counter() for m in args.linear_m}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for (n, k), count in sorted(shapes.items()):
        w_NK = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k**0.5
        w_q = quantize_fp8_block(w_NK) if dtype == "fp8" else None
        for m in args.linear_m:
            x_MK = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
            if dtype == "bf16":
                fns = [lambda: F.linear(x_MK, w_NK), lambda: linear(x_MK, w_NK, deterministic=True)]
                fns += [lambda t=t: fixed_gemm(x_MK, w_NK, tiles=t) for t in tiles]
                if ws:
                    fns.append(lambda: gw.gemm_ws(x_MK, w_NK))
            else:  # activations quantised once, off the clock: the GEMMs alone
                q_MK, s_MG = quantize_fp8_act_ref(x_MK)
                fns = [lambda: linear_fp8(q_MK, s_MG, w_q), lambda: linear_fp8(q_MK, s_MG, w_q, deterministic=True)]
                fns += [lambda t=t: fl.fp8_linear(q_MK, s_MG, w_q.data, w_q.scale, torch.bfloat16,
                                                  deterministic=True, tiles=t) for t in tiles]
                if ws:
                    fns.append(lambda: fgw.fp8_gemm_ws(q_MK, s_MG, w_q.data, w_q.scale, torch.bfloat16))
            ms = [time_ms(fn) for fn in fns]
            row = {"shape": f"{n}x{k} (x{count})", "m": m}
            if ws:
                ref = x_MK.float() @ w_NK.float().T if dtype == "bf16" else \
                    fl.fp8_linear_ref(q_MK, s_MG, w_q.data, w_q.scale, torch.float32)
                err = (fns[-1]().float() - ref).abs().max() / ref.abs().max()
                row["ws_err"] = err.item()
            for name, t in zip(names, ms):
                row[name] = 2 * m * n * k / t / 1e9  # TFLOP/s
                totals[m][name] += count * t
            record(run, {name: row[name] for name in names} | ({"ws max rel err": row["ws_err"]} if ws else {}),
                   what="linear", dtype=dtype, n=n, k=k, m=m, count=count)
            rows.append(row)
    for m in args.linear_m:
        rows.append({"shape": "all the slice's linears, ms", "m": m, **totals[m]})
        record(run, dict(totals[m]), what="linears total ms", dtype=dtype, m=m)
    columns = [("N x K (in the slice)", "shape", ""), ("M", "m", "d")] + [(n, n, ".1f") for n in names]
    print_table(rows, columns + ([("ws max rel err", "ws_err", ".1e")] if ws else []),
                title=f"{dtype} linears: TFLOP/s per shape (last rows: ms over all the slice's linears)")


def prefill_s(cfg, params, isl: int, chunk: int, det: bool) -> float:
    """Seconds of one chunked prefill of a fresh random sequence (the state made off the clock)."""
    prompt = torch.randint(0, cfg.vocab_size, (isl,), generator=torch.Generator().manual_seed(isl))
    swa = chunk + cfg.sliding_window + 256
    state = mf.init_state(cfg, params, max_tokens=pool_tokens([isl], 128), max_swa_tokens=swa, deterministic=det)
    return wall_s(lambda: prefill_chunks(state, [prompt], chunk))[0]


def decode_ms(cfg, params, batch: int, prompt: int, steps: int, det: bool, profile: bool = False):
    """(ms per decode step from CUDA graphs, after a warm-up run that captures them; with profile
    the device ms a step by kernel category over one more run, else None)."""
    gen = torch.Generator().manual_seed(batch)
    ids = list(range(batch))
    prompts = [torch.randint(0, cfg.vocab_size, (prompt,), generator=gen).tolist() for _ in ids]
    state = mf.init_state(cfg, params, batch * (prompt + 2 * steps + 256), swa_slack=steps, deterministic=det)
    first = []
    for g in range(0, batch, 8):  # 8 prompts a pass: the activations of B x prompt tokens at once need not fit
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids[g:g + 8], prompts[g:g + 8]))
        first += out.logits_BV.argmax(-1).tolist()
    graphs = DecodeGraphs()
    state, *_ = decode_run(state, ids, first, steps, graphs)  # compile, capture
    state = mf.truncate(state, {i: prompt for i in ids})
    state, _, seconds, _ = decode_run(state, ids, first, steps, graphs)
    split = None
    if profile:
        state = mf.truncate(state, {i: prompt for i in ids})
        total = split_of(partial(decode_run, state, ids, first, steps, graphs))["ms"]
        split = {c: ms / steps for c, ms in total.items()}
    del state, graphs
    torch.cuda.empty_cache()
    return seconds * 1e3, split


def main(args, run) -> None:
    if args.linears:
        return linears(args, run)
    cfg = flash_slice()
    print(f"{run.device}  torch {torch.__version__}  6-layer slice, deterministic mode off / on")
    rows = []
    for dtype in args.dtypes:
        params = slice_params(cfg, dtype)  # one weight format on the card at a time
        for isl in args.isl:
            res = {}
            for det in (False, True):
                prefill_s(cfg, params, 2048, args.chunk, det)  # compile / tune
                res[det] = min(prefill_s(cfg, params, isl, args.chunk, det) for _ in range(2))
            row = dict(off_tok_s=isl / res[False], on_tok_s=isl / res[True], on_over_off=res[False] / res[True])
            if args.profile:  # where the time goes, by kernel category, off and on
                row["split_ms"] = {("on" if det else "off"): split_of(partial(prefill_s, cfg, params, isl, args.chunk,
                                                                            det))["ms"] for det in (False, True)}
                print(f"{dtype} prefill {isl}, device ms by category: " + "; ".join(
                    f"{k} " + ", ".join(f"{c} {v:.1f}" for c, v in split.items())
                    for k, split in row["split_ms"].items()), flush=True)
            record(run, row, what="prefill", dtype=dtype, isl=isl, chunk=args.chunk)
            rows.append({"what": f"prefill {isl}", "dtype": dtype, "off": row["off_tok_s"], "on": row["on_tok_s"],
                         "unit": "tok/s", "ratio": row["on_over_off"]})
            print(f"{dtype} prefill {isl}: off {row['off_tok_s']:.0f} tok/s, on {row['on_tok_s']:.0f}", flush=True)
        for b in args.batch:
            got = {det: decode_ms(cfg, params, b, args.prompt, args.steps, det, args.profile) for det in (False, True)}
            ms = {det: t for det, (t, _) in got.items()}
            row = dict(off_ms=ms[False], on_ms=ms[True], on_over_off=ms[False] / ms[True])
            if args.profile:
                row["split_ms_per_step"] = {("on" if det else "off"): split for det, (_, split) in got.items()}
                print(f"{dtype} decode B={b}, device ms a step by category: " + "; ".join(
                    f"{k} " + ", ".join(f"{c} {v:.2f}" for c, v in split.items())
                    for k, split in row["split_ms_per_step"].items()), flush=True)
            record(run, row, what="decode", dtype=dtype, batch=b, prompt=args.prompt)
            rows.append({"what": f"decode B={b}", "dtype": dtype, "off": ms[False], "on": ms[True], "unit": "ms/step",
                         "ratio": row["on_over_off"]})
            print(f"{dtype} decode B={b}: off {ms[False]:.2f} ms, on {ms[True]:.2f} ms", flush=True)
        del params
        torch.cuda.empty_cache()
    print_table(rows, [("what", "what", ""), ("dtype", "dtype", ""), ("off", "off", ".2f"), ("on", "on", ".2f"),
                       ("unit", "unit", ""), ("speed on / off", "ratio", ".3f")])
