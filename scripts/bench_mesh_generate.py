"""Engine.generate's decode steps on a DP / TP / EP mesh, eager and with CUDA graphs.

The 6-layer slice at the released dims (scripts/prefill.py's flash_slice), random bf16 (or
--fp8: 128x128-block FP8) weights, one process per rank, each rank an `mf.Engine` over its
shard (the "gather" EP dispatch). For each batch size B, every DP group generates for B prompts
of --prompt tokens twice, --short and --short + --steps new tokens; the difference of the two
wall times over --steps is one decode step as the engine runs it. Engines with
`cuda_graphs=False` (every kernel launched from Python) and with graphs (overlap on in both).
"same" counts sequences whose tokens agree between the two (greedy). Best of --repeats.

    torchrun --nproc-per-node 2 scripts/bench_mesh_generate.py --dp 2 --tp 1 --ep 2 [--batch 1 8 64] [--fp8]
Writes $OUT/bench_mesh_generate_<layout>.json when OUT is set.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mimo_fn as mf  # noqa: E402
from mimo_fn.parallel.mesh import init_mesh  # noqa: E402
from mimo_fn.parallel.sharding import shard_params  # noqa: E402
from mimo_fn.params import quantize_params  # noqa: E402
from prefill import flash_slice  # noqa: E402


def timed(engine, prompts, new_tokens):
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new_tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, [o.tokens for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args()

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
        print(f"{torch.cuda.get_device_name()} x {dist.get_world_size()}  torch {torch.__version__}  {layout}  "
              f"6-layer slice, {'FP8' if args.fp8 else 'bf16'}, prompt {args.prompt}, {args.steps} steps timed; "
              f"ms per decode step", flush=True)
        print(f"{'B':>4} {'eager':>8} {'graphs':>8} {'speedup':>8} {'same':>9}", flush=True)
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
        row = dict(batch=b, fp8=args.fp8, eager_ms=ms[False], graphs_ms=ms[True], same=same,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        rows.append(row)
        if rank == 0:
            print(f"{b:4d} {ms[False]:8.2f} {ms[True]:8.2f} {ms[False] / ms[True]:8.2f} {same:>4}/{b:<4}", flush=True)
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"bench_mesh_generate_{layout}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    gc.collect()  # graphs holding NCCL work must go before the communicators (docs/parallel.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
