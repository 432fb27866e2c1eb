"""Decode steps with and without CUDA graphs (mimo_fn.graphs).

A 6-layer slice of MiMo-V2-Flash at the released dims (the prefill benchmark's layer mix:
full, 4 x SWA, full; dense layer 0, MoE after), random bf16 weights, on one GPU. For each
batch size B: prefill B prompts, then run greedy decode steps through `mf.decode`, eagerly and
from graphs, each from the same prefilled state (the KV of one run's decoded tokens is dropped
with `mf.truncate` before the next). Per step the host builds the batch, runs the step and reads
the argmax back, as the engine does.
  eager ms      wall time per step, every kernel launched from Python
  graph ms      the same with DecodeGraphs (the first step's capture excluded: warm-up run)
  replay ms     the graph alone, replayed back to back: the GPU's time for a step
  capture s     what capturing cost, over the warm-up run (graphs for the table widths it met)
  same          sequences whose tokens equal the eager run's. In bf16 they may round
                differently: decode attention sizes its key splits from the padded table width
                and the batch size, and a batch padded to its bucket (20 -> 24) runs its GEMMs
                at another M, for which cuBLAS may pick another kernel. A near-tie in a random
                model's logits then goes the other way.
  max diff      the largest difference between the first step's logits, graph - eager, and
  std           the logits' standard deviation, for scale

    python -m mimo_fn.bench decode [--batch 1 5 8 20 32 64] [--prompt 512] [--steps 64]
"""

import time

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import sync, wall_s
from mimo_fn.bench.workload import flash_slice
from mimo_fn.graphs import DecodeGraphs

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 5, 8, 20, 32, 64], help="batch sizes B")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")


def decode_run(state, ids, first, steps, graphs):
    """Greedy decode from `first` tokens; returns (state, tokens [B, steps], seconds per step,
    the first step's logits)."""
    toks, cur, logits = [], first, None
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        state, out = mf.decode(state, mf.Batch.from_tokens(ids, [[t] for t in cur]), graphs=graphs)
        logits = out.logits_BV if logits is None else logits
        cur = out.logits_BV.argmax(-1).tolist()
        toks.append(cur)
    sync()
    return state, list(zip(*toks)), (time.perf_counter() - t0) / steps, logits.float()


def main(args, run) -> None:
    cfg = flash_slice()
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    print(f"{run.device}  torch {torch.__version__}  6-layer slice, bf16, prompt {args.prompt}, "
          f"{args.steps} decode steps")
    rows = []
    for b in args.batch:
        ids = list(range(b))
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in ids]
        state = mf.init_state(cfg, params, b * (args.prompt + 2 * args.steps + 256), swa_slack=args.steps)
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids, prompts))
        first = out.logits_BV.argmax(-1).tolist()
        lengths = {i: args.prompt for i in ids}
        # warm-up: eager kernels compiled and tuned for this batch, then the graphs captured
        state, *_ = decode_run(state, ids, first, args.steps, None)
        state = mf.truncate(state, lengths)
        graphs = DecodeGraphs()
        t0 = time.perf_counter()
        state, *_ = decode_run(state, ids, first, args.steps, graphs)
        warm_graph_s = time.perf_counter() - t0
        state = mf.truncate(state, lengths)
        state, eager_toks, eager_s, eager_logits = decode_run(state, ids, first, args.steps, None)
        state = mf.truncate(state, lengths)
        state, graph_toks, graph_s, graph_logits = decode_run(state, ids, first, args.steps, graphs)
        diff = (graph_logits - eager_logits).abs().max().item()
        capture_s = warm_graph_s - graph_s * args.steps
        g = next(iter(graphs._graphs.values()))
        replay_s = wall_s(lambda: [g.graph.replay() for _ in range(args.steps)])[0] / args.steps
        same = sum(a == c for a, c in zip(eager_toks, graph_toks))
        res = dict(eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3, speedup=eager_s / graph_s, replay_ms=replay_s * 1e3,
                   capture_s=capture_s, graphs=len(graphs), same=same, first_step_max_diff=diff,
                   logit_std=eager_logits.std().item())
        record(run, res, batch=b)
        rows.append({"batch": b, **res, "same": f"{same}/{b}"})
        print(f"B={b}: eager {res['eager_ms']:.2f} ms, graphs {res['graph_ms']:.2f} ms", flush=True)
        del state, graphs, g
        torch.cuda.empty_cache()
    print_table(rows, [("B", "batch", "d"), ("eager ms", "eager_ms", ".2f"), ("graph ms", "graph_ms", ".2f"),
                       ("speedup", "speedup", ".2f"), ("replay ms", "replay_ms", ".2f"),
                       ("capture s", "capture_s", ".2f"), ("graphs", "graphs", "d"), ("same", "same", ""),
                       ("max diff", "first_step_max_diff", ".3f"), ("std", "logit_std", ".2f")])
