"""Decode steps on a DP / TP / EP mesh: the two EP dispatches, eagerly and from CUDA graphs.

The 6-layer slice at the released dims, random weights, one
process per rank. For each batch size B (sequences per DP group): prefill B prompts, then run
greedy decode steps through `mf.decode` from the same prefilled state in each mode (the decoded
tokens' KV is dropped with `mf.truncate` between modes):
  a2a eager      Mesh.ep_dispatch "all_to_all": each (token, k) copy sent to its expert's rank;
                 the per-layer count exchange syncs the host
  gather eager   "gather": the EP group's rows all-gathered, outputs reduce-scattered; no host sync
  gather graphs  the same replayed from DecodeGraphs (the capture step excluded)
  replay         the graph alone, replayed back to back on every rank: the GPUs' time for a step
Per step the host builds the batch, runs the step and reads the argmax back, as the engine does.
"same" counts sequences whose graph tokens equal the gather eager run's, and the a2a eager run's
(bf16: the dispatches sum the experts' outputs in different orders, so near-ties in a random
model may go either way).
With --prefill ISL, one prompt of ISL tokens per DP group is also prefilled in one chunk with
each dispatch (eager), three times: the first compiles and tunes; the others are shown.

    torchrun --nproc-per-node 2 -m mimo_fn.bench mesh-decode --dp 1 --tp 2 --ep 2 [--batch 1 8 64]
        [--quant none fp8] [--prompt 512] [--steps 32] [--prefill 16384]
"""

import gc
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import sync
from mimo_fn.bench.workload import flash_slice
from mimo_fn.parallel.mesh import init_mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params

NEEDS_CUDA = True


def decode_run(state, ids, first, steps, graphs):
    """Greedy decode from `first`; returns (state, tokens per sequence, seconds per step)."""
    toks, cur = [], first
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = mf.decode(state, mf.Batch.from_tokens(ids, [[t] for t in cur]), graphs=graphs)
        cur = out.logits_BV.argmax(-1).tolist()
        toks.append(cur)
    sync()
    dt = (time.perf_counter() - t0) / steps
    return state, list(zip(*toks)), dt


def with_dispatch(state, dispatch):
    return replace(state, mesh=replace(state.mesh, ep_dispatch=dispatch))


def prefill_time(cfg, params, mesh, isl, dispatch, seed):
    prompt = torch.randint(0, cfg.vocab_size, (isl,), generator=torch.Generator().manual_seed(seed)).tolist()
    times = []
    for _ in range(3):  # the first compiles and tunes at this shape
        state = mf.init_state(cfg, params, max_tokens=isl + 1024, mesh=replace(mesh, ep_dispatch=dispatch))
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [prompt]))
        sync()
        times.append(time.perf_counter() - t0)
        del state
    return times[1:]


def add_args(ap) -> None:
    ap.add_argument("--dp", type=int, required=True, help="data-parallel attention groups")
    ap.add_argument("--tp", type=int, required=True, help="attention tensor-parallel ranks per DP group")
    ap.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="sequences per DP group B")
    ap.add_argument("--quant", nargs="+", default=["none"], choices=["none", "fp8"], help="weight formats")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prompt of this many tokens per DP group")


def main(args, run) -> None:
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("mesh-decode: run under torchrun (torchrun --nproc-per-node N -m mimo_fn.bench mesh-decode ...)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_mesh(args.dp, args.tp, args.ep)
    cfg = flash_slice()
    layout = f"dp{args.dp}_tp{args.tp}_ep{args.ep}"
    rows = []
    if rank == 0:
        print(f"{run.device}  torch {torch.__version__}  {layout}  "
              f"6-layer slice, prompt {args.prompt}, {args.steps} decode steps; ms per step", flush=True)
    for quant in args.quant:
        params = shard_params(mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device=device), cfg, mesh)
        if quant == "fp8":
            params = quantize_params(cfg, params)
        for b in args.batch:
            gen = torch.Generator().manual_seed(100 * mesh.dp_rank + b)
            ids = list(range(b))
            prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in ids]
            state = mf.init_state(cfg, params, b * (args.prompt + 2 * args.steps + 256), swa_slack=args.steps,
                                  mesh=mesh)
            state, out = mf.prefill(state, mf.Batch.from_tokens(ids, prompts))
            first = out.logits_BV.argmax(-1).tolist()
            lengths = {i: args.prompt for i in ids}
            res = {}
            graphs = mf.DecodeGraphs()
            for name, dispatch, g in (("a2a", "all_to_all", None), ("gather", "gather", None),
                                      ("graphs", "gather", graphs)):
                state = with_dispatch(state, dispatch)
                state, *_ = decode_run(state, ids, first, args.steps, g)  # warm-up (and captures)
                state = mf.truncate(state, lengths)
                state, toks, dt = decode_run(state, ids, first, args.steps, g)
                state = mf.truncate(state, lengths)
                res[name] = (toks, dt)
            g = next(iter(graphs._graphs.values()))
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                g.graph.replay()
            sync()
            replay = (time.perf_counter() - t0) / args.steps
            same = sum(a == c for a, c in zip(res["a2a"][0], res["graphs"][0]))
            same_gather = sum(a == c for a, c in zip(res["gather"][0], res["graphs"][0]))
            row = dict(a2a_eager_ms=res["a2a"][1] * 1e3, gather_eager_ms=res["gather"][1] * 1e3,
                       gather_graphs_ms=res["graphs"][1] * 1e3, replay_ms=replay * 1e3, same_as_a2a=same,
                       same_as_gather_eager=same_gather,
                       graphs=len(graphs), graph_stats=graphs.stats, failed=graphs.failed)
            record(run, row, quant=quant, batch=b, layout=layout)
            rows.append(dict(quant=quant, batch=b, **row, same=f"{same_gather}/{b}, {same}/{b}"))
            if rank == 0:
                print(f"{quant} B={b}: a2a eager {row['a2a_eager_ms']:.2f} ms, gather graphs "
                      f"{row['gather_graphs_ms']:.2f} ms", flush=True)
            del state, graphs, g
            torch.cuda.empty_cache()
        if args.prefill:
            for dispatch in ("all_to_all", "gather"):
                times = prefill_time(cfg, params, mesh, args.prefill, dispatch, 7 + mesh.dp_rank)
                tok_s = args.prefill * args.dp / min(times)
                record(run, {"seconds": times, "tok_s": tok_s}, section="prefill", quant=quant, isl=args.prefill,
                       dispatch=dispatch, layout=layout)
                if rank == 0:
                    print(f"{quant:>5} prefill {args.prefill} per DP group, {dispatch:10}: "
                          f"{' / '.join(f'{t * 1e3:.1f}' for t in times)} ms, {tok_s:,.0f} tok/s on "
                          f"{dist.get_world_size()} GPUs (best)", flush=True)
        del params
        torch.cuda.empty_cache()
    if rank == 0:
        print_table(rows, [("quant", "quant", ""), ("B", "batch", "d"), ("a2a eager", "a2a_eager_ms", ".2f"),
                           ("gather eager", "gather_eager_ms", ".2f"), ("gather graphs", "gather_graphs_ms", ".2f"),
                           ("replay", "replay_ms", ".2f"), ("same (gather, a2a)", "same", "")], "ms per decode step")
    gc.collect()  # graphs holding NCCL work must go before the communicators (docs/parallel.md)
    dist.destroy_process_group()
