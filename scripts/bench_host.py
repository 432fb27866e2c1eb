"""The engine's host time per step: `Engine.generate` with a stub model that returns random logits.

What is left is everything the engine does around a model's forward: scheduling, page
allocation, the step's metadata (positions, slots, page tables), sampling and bookkeeping. On a
GPU this work sits between two steps' kernels (docs/benchmarks.md measured the gap between a
CUDA-graph step and its replay), so it bounds small and large batches alike. Runs on the CPU
with the tiny config; pages of 128 tokens, prompts of --prompt tokens, greedy.

    python scripts/bench_host.py [--batch 1 64 256] [--steps 64] [--prompt 100] [--repeats 3] [--profile]

Prints ms per generated token step (the one prefill pass included, amortised over --steps),
the best of --repeats runs; --profile adds a cProfile table of the largest batch.
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn import model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)

    def stub(state, batch, cache, meta, all_logits, capture_experts, capture_hidden=()):
        # the layers' place in the step: every sequence's last-token logits, random
        return model.StepOutput(torch.randn(len(batch.seq_ids), cfg.vocab_size, generator=gen))

    model._run_layers = stub
    print(f"torch {torch.__version__}, stub model (tiny config, V = {cfg.vocab_size}), {args.steps} steps")
    engine = None
    for b in args.batch:
        pool = b * (args.prompt + args.steps + 256)
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=pool, page_size=128, max_batch=max(b, 256),
                                                        cuda_graphs=False))
        prompts = [[1 + i % 50] * args.prompt for i in range(b)]
        engine.generate(prompts, 4)  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.generate(prompts, args.steps)
            best = min(best, time.perf_counter() - t0)
        print(f"B = {b:4d}: {best / args.steps * 1e3:7.3f} ms per step")
    if args.profile and engine is not None:
        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompts, args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
