"""Engine.generate's decode steps with and without EngineConfig.overlap.

The 6-layer slice of MiMo-V2-Flash at the released dims (full, 4 x SWA, full; dense layer 0, MoE
after), random bf16 weights, CUDA graphs on; or, with --device cpu, the tiny config in fp32
(what the CPU can show: the engine's own work around small steps). For each batch size B, B
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

    python -m mimo_fn.bench generate [--batch 1 8 64] [--prompt 512] [--steps 64] [--short 8] [--repeats 3]
                                     [--fp8 | --mxfp4] [--greedy-only]
    python -m mimo_fn.bench generate --device cpu --batch 1 4 --prompt 16 --steps 8 --repeats 1
"""

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import add_model_args, model_name, model_setup
from mimo_fn.params import quantize_params, weight_bytes

NEEDS_CUDA = False
COPY_TB_S = 4.24  # one H200's copy bandwidth, measured on the lent machines


def add_args(ap) -> None:
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes B")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed (the difference of the two calls)")
    ap.add_argument("--short", type=int, default=8, help="new tokens of the shorter call")
    ap.add_argument("--repeats", type=int, default=3, help="timings per mode; the best counts")
    ap.add_argument("--fp8", action="store_true", help="128x128-block FP8 GEMM weights")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts, FP8 other GEMM weights")
    ap.add_argument("--greedy-only", action="store_true", help="skip the sampled rows")
    add_model_args(ap)


def timed(engine, prompts, new_tokens, sampling):
    seconds, outs = wall_s(lambda: engine.generate(prompts, max_new_tokens=new_tokens, sampling=sampling))
    return seconds, [o.tokens for o in outs]


def replay_ms(engine, steps: int) -> float | None:
    """The largest captured graph (this batch's bucket at its widest table), replayed back to
    back; None without graphs (the CPU)."""
    if engine.graphs is None or not engine.graphs._graphs:
        return None
    g = max(engine.graphs._graphs.items(), key=lambda kv: (kv[0][0], kv[0][2]))[1]
    seconds, _ = wall_s(lambda: [g.graph.replay() for _ in range(steps)])
    return seconds / steps * 1e3


def floor_ms(cfg, params, batch: int) -> float:
    """The weight bytes one decode step of `batch` sequences reads, over COPY_TB_S."""
    experts = [weight_bytes(layer.mlp.w13) + weight_bytes(layer.mlp.w2)
               for i, layer in enumerate(params.layers) if cfg.is_moe(i)]
    rest = weight_bytes(params) - sum(experts) - weight_bytes(params.embed)
    hit = 1 - (1 - cfg.top_k / cfg.num_experts) ** batch  # share of a layer's experts some token routes to
    return (rest + hit * sum(experts)) / (COPY_TB_S * 1e12) * 1e3


def main(args, run) -> None:
    if args.fp8 and args.mxfp4:
        raise SystemExit("generate: --fp8 and --mxfp4 exclude each other")
    cfg, device, dtype = model_setup(args)
    params = mf.init_params(cfg, seed=0, dtype=dtype, device=device)
    if args.fp8 or args.mxfp4:
        params = quantize_params(cfg, params, experts="mxfp4" if args.mxfp4 else "fp8")
    fmt = "MXFP4 experts + FP8" if args.mxfp4 else "FP8" if args.fp8 else str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(0)
    graphs = "graphs" if device == "cuda" else "eager"
    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}, {fmt} weights, {graphs}, "
          f"prompt {args.prompt}, {args.steps} decode steps timed")
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
            res = dict(off_ms=ms[False], on_ms=ms[True], speedup=ms[False] / ms[True],
                       replay_ms=replay_ms(engines[True], args.steps),
                       floor_ms=floor_ms(cfg, params, b) if device == "cuda" else None, same=same)
            record(run, res, batch=b, sampling=name)
            rows.append({"batch": b, "sampling": name, **res, "same": f"{same}/{b}"})
            print(f"B={b} {name}: off {ms[False]:.2f} ms, on {ms[True]:.2f} ms", flush=True)
        del engines
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, [("B", "batch", "d"), ("sampling", "sampling", ""), ("off ms", "off_ms", ".2f"),
                       ("on ms", "on_ms", ".2f"), ("speedup", "speedup", ".2f"), ("replay ms", "replay_ms", ".2f"),
                       ("floor ms", "floor_ms", ".2f"), ("same", "same", "")], "ms per decode step")
