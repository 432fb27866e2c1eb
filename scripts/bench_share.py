"""GRPO-style rollouts on one GPU: each prompt --copies times in one generate call, with
EngineConfig.share_prompts on (one prefill per prompt, the copies fork its K/V pages) and off.

The 6-layer slice of MiMo-V2-Flash at the released dims (as bench_generate.py), random bf16
weights, CUDA graphs and overlap on. --prompts prompts of --prompt tokens, each repeated
--copies times next to each other (as GRPO groups them), --new tokens sampled at --temperature
(default 1, one generator per request; 0: greedy). Prefill chunks of --chunk tokens: a prompt
longer than a chunk prefills over several passes, and its copies fork it in the last. A KV pool
of --max-tokens tokens (default: every request unshared at once): copies hold their prompt's
pages in common, so a smaller pool still holds them all with sharing on. At most --max-batch
requests in flight: with fewer than the requests, copies are admitted as others finish, and
fork the held prompt. Prints the wall time of `generate`, best of --repeats after a warm-up
call, the prompt tokens per second, and how many requests drew the same tokens with sharing
on and off (copied K/V equals computed K/V up to bf16 rounding, so a draw near a boundary may
differ), where the others first differ, and how many distinct outputs each prompt's copies drew.
With --prefix N every prompt begins with the same N tokens (a system prompt) and only its last
--prompt - N are its own: sharing on prefills the whole pages of those N once.

    python scripts/bench_share.py [--prompts 4] [--copies 8] [--prompt 2048] [--prefix 0] [--chunk 16384]
        [--max-tokens N] [--max-batch 256] [--new 1 32] [--temperature 1.0] [--repeats 3]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--new", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = mf.ModelConfig.flash(num_layers=6)
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    if not 0 <= args.prefix < args.prompt:
        ap.error(f"--prefix must be in [0, --prompt = {args.prompt}), got {args.prefix}")
    system = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=gen).tolist()
    distinct = [system + torch.randint(0, cfg.vocab_size, (args.prompt - args.prefix,), generator=gen).tolist()
                for _ in range(args.prompts)]
    prompts = [p for p in distinct for _ in range(args.copies)]
    sampling = mf.SamplingParams(temperature=args.temperature, seed=3) if args.temperature > 0 else None
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  6-layer slice, bf16, {args.prompts} prompts "
          f"x {args.copies} copies x {args.prompt} tokens ({args.prefix} shared by all), chunk {args.chunk}, KV pool "
          f"{args.max_tokens or 'all requests'}, max batch {args.max_batch}, temperature {args.temperature}")
    print(f"{'new':>4} {'share':>6} {'best s':>8} {'all s':>24} {'prompt tok/s':>13} {'same':>8}")
    for new in args.new:
        toks = {}
        for share in (False, True):
            max_tokens = args.max_tokens or len(prompts) * (args.prompt + new + 256)
            engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, chunk_size=args.chunk,
                                                            max_batch=args.max_batch, share_prompts=share))
            engine.generate(prompts, max_new_tokens=new, sampling=sampling)  # warm-up: kernels tuned, graphs captured
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = engine.generate(prompts, max_new_tokens=new, sampling=sampling)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            toks[share] = [o.tokens for o in outs]
            same = sum(a == b for a, b in zip(toks[False], toks[share]))
            # where each request that differs from "off" first does, and how many distinct outputs
            # each prompt's copies drew (greedy: 1 unless their batches rounded apart)
            apart = [next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                     for a, b in zip(toks[False], toks[share]) if a != b]
            kinds = [len({tuple(t) for t in toks[share][g * args.copies:(g + 1) * args.copies]})
                     for g in range(args.prompts)]
            print(f"{new:4d} {str(share):>6} {min(times):8.3f} {' / '.join(f'{t:.3f}' for t in times):>24} "
                  f"{len(prompts) * args.prompt / min(times):13,.0f} {same:>4}/{len(prompts):<3} "
                  f"first differing token {apart}, distinct outputs per prompt {kinds}", flush=True)
            del engine
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
