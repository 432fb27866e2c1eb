"""The engine's host time per step: `Engine.generate` with a stub model that returns random logits.

What is left is everything the engine does around a model's forward: scheduling, page
allocation, the step's metadata (positions, slots, page tables), sampling and bookkeeping. On a
GPU this work sits between two steps' kernels (docs/benchmarks.md, "Host overhead"), so it
bounds small and large batches alike. Runs on the CPU with the tiny config; pages of 128
tokens, prompts of --prompt tokens, greedy.

    python -m mimo_fn.bench host [--batch 1 64 256] [--steps 64] [--prompt 100] [--repeats 3] [--profile]
                                 [--drafts K]

--drafts K makes every step a speculative verify step of K host-made random drafts (random logits
accept almost none): the engine's side of a verify step (the drafts' batch, acceptance, truncation).
Prints ms per generated token step (the one prefill pass included, amortised over --steps),
the best of --repeats runs; --profile adds a cProfile table of the largest batch (before the
table of results).
"""

import cProfile
import pstats

import torch

import mimo_fn as mf
from mimo_fn import model
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s

NEEDS_CUDA = False


def add_args(ap) -> None:
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256], help="batch sizes B")
    ap.add_argument("--steps", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--prompt", type=int, default=100, help="prompt tokens per sequence")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size; the best counts")
    ap.add_argument("--profile", action="store_true", help="a cProfile table of the largest batch")
    ap.add_argument("--drafts", type=int, default=0, help="random drafts a step: verify steps (0: decode steps)")


class _RandomDrafts:
    def __init__(self, vocab: int):
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(1)

    def propose(self, rid, tokens, k):
        return torch.randint(0, self.vocab, (k,), generator=self.gen).tolist()


def main(args, run) -> None:
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)

    def stub(state, batch, cache, meta, all_logits, capture_experts, capture_hidden=()):
        # the layers' place in the step: every sequence's last-token logits (every token's for a
        # verify step), random
        logits_TV = torch.randn(batch.num_tokens, cfg.vocab_size, generator=gen) if all_logits else None
        last = batch.cu_seqlens[1:] - 1
        return model.StepOutput(torch.randn(len(batch.seq_ids), cfg.vocab_size, generator=gen)
                                if logits_TV is None else logits_TV[last], logits_TV)

    real = model._run_layers
    model._run_layers = stub
    try:
        print(f"torch {torch.__version__}, stub model (tiny config, V = {cfg.vocab_size}), {args.steps} steps"
              + (f", verify steps of {args.drafts} random drafts" if args.drafts else ""))
        engine, rows = None, []
        for b in args.batch:
            pool = b * (args.prompt + args.steps + 256)
            engine = mf.Engine(cfg, params, mf.EngineConfig(
                max_tokens=pool, page_size=128, max_batch=max(b, 256), cuda_graphs=False, num_draft_tokens=args.drafts,
                proposer=_RandomDrafts(cfg.vocab_size) if args.drafts else None))
            prompts = [[1 + i % 50] * args.prompt for i in range(b)]
            engine.generate(prompts, 4)  # warm-up
            best = min(wall_s(lambda: engine.generate(prompts, args.steps))[0] for _ in range(args.repeats))
            steps = engine.spec_stats()["steps"] if args.drafts else args.steps
            res = {"ms_per_step": best / steps * 1e3, "seconds": best}
            record(run, res, batch=b)
            rows.append({"batch": b, **res})
        if args.profile and engine is not None:
            prof = cProfile.Profile()
            prof.enable()
            engine.generate(prompts, args.steps)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    finally:  # the real layers back: this runs in-process in tests
        model._run_layers = real
    print_table(rows, [("B", "batch", "d"), ("ms per step", "ms_per_step", ".3f"), ("best s", "seconds", ".3f")],
                f"host time per step, best of {args.repeats}")
