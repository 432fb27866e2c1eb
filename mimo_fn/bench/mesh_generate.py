"""Engine.generate's decode steps on a DP / TP / EP mesh, eager and with CUDA graphs.

The 6-layer slice at the released dims, random bf16 (or
--fp8: 128x128-block FP8) weights, one process per rank, each rank an `mf.Engine` over its
shard (the "gather" EP dispatch). For each batch size B, every DP group generates for B prompts
of --prompt tokens twice, --short and --short + --steps new tokens; the difference of the two
wall times over --steps is one decode step as the engine runs it. Engines with
`cuda_graphs=False` (every kernel launched from Python) and with graphs (overlap on in both).
"same" counts sequences whose tokens agree between the two (greedy). Best of --repeats.

    torchrun --nproc-per-node 2 -m mimo_fn.bench mesh-generate --dp 2 --tp 1 --ep 2 [--batch 1 8 64] [--fp8]
"""

import gc
import os

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import flash_slice
from mimo_fn.parallel.mesh import init_mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--dp", type=int, required=True, help="data-parallel attention groups")
    ap.add_argument("--tp", type=int, required=True, help="attention tensor-parallel ranks per DP group")
    ap.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="prompts per DP group B")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed (the difference of the two calls)")
    ap.add_argument("--short", type=int, default=8, help="new tokens of the shorter call")
    ap.add_argument("--repeats", type=int, default=2, help="timings per mode; the best counts")
    ap.add_argument("--fp8", action="store_true", help="128x128-block FP8 GEMM weights")


def timed(engine, prompts, new_tokens):
    seconds, outs = wall_s(lambda: engine.generate(prompts, max_new_tokens=new_tokens), barrier=True)
    return seconds, [o.tokens for o in outs]


def main(args, run) -> None:
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("mesh-generate: run under torchrun (torchrun --nproc-per-node N -m mimo_fn.bench "
                         "mesh-generate ...)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_mesh(args.dp, args.tp, args.ep)
    cfg = flash_slice()
    params = shard_params(mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device=device), cfg, mesh)
    if args.fp8:
        params = quantize_params(cfg, params)
    layout = f"dp{args.dp}_tp{args.tp}_ep{args.ep}"
    if rank == 0:
        print(f"{run.device}  torch {torch.__version__}  {layout}  "
              f"6-layer slice, {'FP8' if args.fp8 else 'bf16'}, prompt {args.prompt}, {args.steps} steps timed; "
              f"ms per decode step", flush=True)
    rows = []
    for b in args.batch:
        gen = torch.Generator().manual_seed(100 * mesh.dp_rank + b)
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(b)]
        pool = b * (args.prompt + args.short + args.steps + 256)
        ms, toks = {}, {}
        for graphs in (False, True):
            engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=pool, cuda_graphs=graphs), mesh=mesh)
            timed(engine, prompts, args.short + args.steps)  # warm-up: kernels tuned, graphs captured
            best = float("inf")
            for _ in range(args.repeats):
                short_s, _ = timed(engine, prompts, args.short)
                long_s, toks[graphs] = timed(engine, prompts, args.short + args.steps)
                best = min(best, (long_s - short_s) / args.steps * 1e3)
            ms[graphs] = best
            del engine
            torch.cuda.empty_cache()
        same = sum(a == c for a, c in zip(toks[False], toks[True]))
        row = dict(eager_ms=ms[False], graphs_ms=ms[True], speedup=ms[False] / ms[True], same=same)
        record(run, row, batch=b, layout=layout)
        rows.append({"batch": b, **row, "same": f"{same}/{b}"})
        if rank == 0:
            print(f"B={b}: eager {ms[False]:.2f} ms, graphs {ms[True]:.2f} ms", flush=True)
    if rank == 0:
        print_table(rows, [("B", "batch", "d"), ("eager", "eager_ms", ".2f"), ("graphs", "graphs_ms", ".2f"),
                           ("speedup", "speedup", ".2f"), ("same", "same", "")], "ms per decode step")
    gc.collect()  # graphs holding NCCL work must go before the communicators (docs/parallel.md)
    dist.destroy_process_group()
