"""What a speculative decoding step costs: plain greedy decode steps against verify steps.

A 6-layer slice of MiMo-V2-Flash at the released dims (the prefill benchmark's layer mix),
random bf16 weights, a batch of prompts decoded greedily through Engine.generate. The verify
runs get k random draft tokens per sequence and step, so each step verifies exactly k drafts
and (almost surely) accepts none: their time per step is the cost of verifying k drafts. A
random model does not copy its prompt, so real proposers would gain nothing here; what a
proposer gains elsewhere follows from these costs and its acceptance:
  speedup = (1 + accepted drafts per step) * t_decode_step / t_verify_step(k)
The dflash rows run a DFlash draft model (mimo_fn.speculative.dflash, random weights, --dflash-layers
layers of the draft's default width, block k + 1, reading target layers 1, 3 and 5) instead
of random drafts: their time per step adds the draft's forward passes and its context work.
"same" counts the sequences whose tokens equal the plain run's, and "first diff" gives the
earliest and the median position where one differs: in bf16 a verify step
(several tokens per sequence, the prefill kernels) and a decode step (one token) round
differently, so a near-tie in a random model's logits can go either way.

Decode and verify steps replay CUDA graphs (mimo_fn.graphs) unless --eager. --temperature T
samples instead of decoding greedily (the host's sampling work then counts too); "same" is
then expected to be low, since speculation keeps each token's distribution, not its value.

    python scripts/bench_spec.py [--batch 8] [--prompt 512] [--new 64] [--draft 1 2 4 8] [--dflash-layers 2] [--eager]
                                 [--temperature 1.0]
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# the MoE kernels' default configs: a verify step's token count is a new autotune size, and
# tuning it inside a timed run would be charged to the verify step
os.environ.setdefault("MIMO_FN_MOE_AUTOTUNE", "0")

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash  # noqa: E402


class RandomDrafts:
    def __init__(self, vocab: int):
        self.vocab, self.rng = vocab, random.Random(0)

    def propose(self, rid, tokens, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--draft", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dflash-layers", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (EngineConfig.cuda_graphs=False)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy); sampled runs compare distributions, not tokens")
    args = ap.parse_args()
    cfg = mf.ModelConfig.flash(num_layers=6)
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    max_tokens = args.batch * (args.prompt + args.new + 256)

    sampling = mf.SamplingParams(temperature=args.temperature, seed=0) if args.temperature > 0 else None

    def run(k: int, proposer=None):
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, num_draft_tokens=k,
                                                        proposer=proposer or RandomDrafts(cfg.vocab_size),
                                                        cuda_graphs=not args.eager))
        engine.generate(prompts, args.new, sampling=sampling)  # warm-up: kernels compiled outside the timing
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, args.new, sampling=sampling)
        torch.cuda.synchronize()
        return [o.tokens for o in outs], time.perf_counter() - t0, engine.spec_stats

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  6-layer slice, bf16, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens ({args.new - 1} decode steps), "
          f"{'eager' if args.eager else 'CUDA graphs'}, "
          f"{f'sampled at temperature {args.temperature}' if sampling else 'greedy'}")
    want, t_plain, _ = run(0)
    step_plain = t_plain / (args.new - 1)
    print(f"\n{'drafts':7} {'k':>3} {'ms / step':>9} {'vs decode':>9} {'accepted':>9} {'same':>5} {'first diff':>10} "
          f"{'speedup if all accepted':>24}")
    print(f"{'none':7} {0:3d} {step_plain * 1e3:9.2f} {1:9.2f} {'-':>9} {args.batch:>3}/{args.batch} {'-':>10} "
          f"{1:24.2f}")
    for name in ("random", "dflash"):
        for k in args.draft:
            proposer = None
            if name == "dflash":
                dcfg = DFlashConfig(target_layers=(1, 3, 5), mask_token_id=cfg.vocab_size - 1, block_size=k + 1,
                                    num_layers=args.dflash_layers)
                proposer = DFlashProposer(init_dflash(cfg, dcfg, dtype=torch.bfloat16, device="cuda"), dcfg,
                                          params, cfg)
            got, t, st = run(k, proposer)
            step = t / st["steps"]
            same = sum(g == w for g, w in zip(got, want))
            first = sorted(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                           for g, w in zip(got, want))
            print(f"{name:7} {k:3d} {step * 1e3:9.2f} {step / step_plain:9.2f} {st['accepted']:>4}/{st['drafted']:<4} "
                  f"{same:>3}/{args.batch} {first[0]:>4} / {first[len(first) // 2]:<3} "
                  f"{(k + 1) * step_plain / step:24.2f}")
    _, t_again, _ = run(0)  # plain decoding once more: how far the machine drifted meanwhile
    print(f"{'none':7} {0:3d} {t_again / (args.new - 1) * 1e3:9.2f} {t_again / t_plain:9.2f}  "
          "(plain, timed again last)")


if __name__ == "__main__":
    main()
