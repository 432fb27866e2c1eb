"""Engine.generate's decode steps with and without EngineConfig.overlap, on one GPU.

The 6-layer slice of MiMo-V2-Flash at the released dims (as in bench_decode.py: full, 4 x SWA,
full; dense layer 0, MoE after), random bf16 weights, CUDA graphs on. For each batch size B, B
prompts of --prompt tokens go through `generate` twice, for --short and for --short + --steps new
tokens; the difference of the two wall times over --steps is the time of one decode step as
the engine runs it (scheduling, pages, step metadata, the step, sampling, bookkeeping).
  overlap off   each step's tokens are read back before the host prepares the next step
  overlap on    the next step is launched first, fed the sampled tokens on the device
  replay        the step's CUDA graph replayed back to back: the GPU's time for a step, the floor
  floor         the weights a step must read, at the copy bandwidth measured on one H200 (4.24
                TB/s): every weight but the embedding, of the experts only those some token is
                routed to, 256 (1 - (1 - 8/256)^B) of them per layer for uniform routing (random
                weights route about uniformly). KV reads are left out (short prompts here)
  same          sequences whose tokens agree between the two modes (no stop tokens, so both run
                the same batches and should agree bit for bit)
Greedy and sampled (temperature 1, one generator per prompt) rows. Best of --repeats timings.
--fp8: every GEMM weight as 128x128-block FP8 (the released checkpoint's format); --mxfp4: the
routed experts as MXFP4 and the other GEMM weights FP8 (the RL release's format).
Writes $OUT/bench_generate.json when OUT is set.

    python scripts/bench_generate.py [--batch 1 8 64] [--prompt 512] [--steps 64] [--short 8] [--repeats 3]
                                     [--fp8 | --mxfp4] [--greedy-only]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn.params import quantize_params, weight_bytes  # noqa: E402

COPY_TB_S = 4.24  # one H200's copy bandwidth, measured here (2026-11-30)


def timed(engine, prompts, new_tokens, sampling):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new_tokens, sampling=sampling)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, [o.tokens for o in outs]


def replay_ms(engine, steps: int) -> float:
    """The largest captured graph (this batch's bucket at its widest table), replayed back to back."""
    g = max(engine.graphs._graphs.items(), key=lambda kv: (kv[0][0], kv[0][2]))[1]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        g.graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def floor_ms(cfg, params, batch: int) -> float:
    """The weight bytes one decode step of `batch` sequences reads, over COPY_TB_S."""
    experts = [weight_bytes(layer.mlp.w13) + weight_bytes(layer.mlp.w2)
               for i, layer in enumerate(params.layers) if cfg.is_moe(i)]
    rest = weight_bytes(params) - sum(experts) - weight_bytes(params.embed)
    hit = 1 - (1 - cfg.top_k / cfg.num_experts) ** batch  # share of an layer's experts some token routes to
    return (rest + hit * sum(experts)) / (COPY_TB_S * 1e12) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="128x128-block FP8 GEMM weights")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, FP8 other GEMM weights")
    ap.add_argument("--greedy-only", action="store_true")
    args = ap.parse_args()
    cfg = mf.ModelConfig.flash(num_layers=6)
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    if args.fp8 or args.mxfp4:
        params = quantize_params(cfg, params, experts="mxfp4" if args.mxfp4 else "fp8")
    fmt = "MXFP4 experts + FP8" if args.mxfp4 else "FP8" if args.fp8 else "bf16"
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  6-layer slice, {fmt} weights, graphs, "
          f"prompt {args.prompt}, {args.steps} decode steps timed")
    print(f"{'B':>4} {'sampling':>8} {'off ms':>8} {'on ms':>8} {'speedup':>8} {'replay ms':>10} {'floor ms':>9} {'same':>9}")
    rows = []
    for b in args.batch:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(b)]
        pool = b * (args.prompt + args.short + args.steps + 256)
        engines = {on: mf.Engine(cfg, params, mf.EngineConfig(max_tokens=pool, overlap=on, max_batch=max(b, 256)))
                   for on in (False, True)}
        modes = (("greedy", None), ("sampled", mf.SamplingParams(temperature=1.0, seed=5)))
        for name, sampling in modes[:1] if args.greedy_only else modes:
            ms, toks = {}, {}
            for on, engine in engines.items():
                timed(engine, prompts, args.short + args.steps, sampling)  # warm-up: kernels tuned, graphs captured
                best = float("inf")
                for _ in range(args.repeats):
                    short_s, _ = timed(engine, prompts, args.short, sampling)
                    long_s, toks[on] = timed(engine, prompts, args.short + args.steps, sampling)
                    best = min(best, (long_s - short_s) / args.steps * 1e3)
                ms[on] = best
            same = sum(a == c for a, c in zip(toks[False], toks[True]))
            replay, floor = replay_ms(engines[True], args.steps), floor_ms(cfg, params, b)
            row = dict(batch=b, sampling=name, fp8=args.fp8, mxfp4=args.mxfp4, off_ms=ms[False], on_ms=ms[True],
                       replay_ms=replay, floor_ms=floor, same=same,
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            rows.append(row)
            print(f"{b:4d} {name:>8} {ms[False]:8.2f} {ms[True]:8.2f} {ms[False] / ms[True]:8.2f} {replay:10.2f} "
                  f"{floor:9.2f} {same:>4}/{b:<4}")
        del engines
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_generate.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
