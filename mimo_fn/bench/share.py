"""GRPO-style rollouts on one GPU: each prompt --copies times in one generate call, with
EngineConfig.share_prompts on (one prefill per prompt, the copies fork its K/V pages) and off.

The 6-layer slice of MiMo-V2-Flash at the released dims (as the generate benchmark), random bf16
weights, CUDA graphs and overlap on (--device cpu: the tiny config in fp32). --prompts prompts of --prompt tokens, each repeated
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

    python -m mimo_fn.bench share [--prompts 4] [--copies 8] [--prompt 2048] [--prefix 0] [--chunk 16384]
        [--max-tokens N] [--max-batch 256] [--new 1 32] [--temperature 1.0] [--repeats 3]
"""

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import add_model_args, model_name, model_setup

NEEDS_CUDA = False


def add_args(ap) -> None:
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    ap.add_argument("--copies", type=int, default=8, help="copies of each prompt, next to each other")
    ap.add_argument("--prompt", type=int, default=2048, help="tokens per prompt")
    ap.add_argument("--prefix", type=int, default=0, help="tokens every prompt begins with (a system prompt)")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk (EngineConfig.chunk_size)")
    ap.add_argument("--max-tokens", type=int, default=None, help="KV pool tokens (default: every request unshared)")
    ap.add_argument("--max-batch", type=int, default=256, help="most requests in flight")
    ap.add_argument("--new", type=int, nargs="+", default=[1, 32], help="new tokens per request")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up; the best counts")
    add_model_args(ap)


def main(args, run) -> None:
    if not 0 <= args.prefix < args.prompt:
        raise SystemExit(f"share: --prefix must be in [0, --prompt = {args.prompt}), got {args.prefix}")
    cfg, device, dtype = model_setup(args)
    params = mf.init_params(cfg, seed=0, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=gen).tolist()
    distinct = [system + torch.randint(0, cfg.vocab_size, (args.prompt - args.prefix,), generator=gen).tolist()
                for _ in range(args.prompts)]
    prompts = [p for p in distinct for _ in range(args.copies)]
    sampling = mf.SamplingParams(temperature=args.temperature, seed=3) if args.temperature > 0 else None
    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}, {args.prompts} prompts "
          f"x {args.copies} copies x {args.prompt} tokens ({args.prefix} shared by all), chunk {args.chunk}, KV pool "
          f"{args.max_tokens or 'all requests'}, max batch {args.max_batch}, temperature {args.temperature}")
    rows = []
    for new in args.new:
        toks = {}
        for share in (False, True):
            max_tokens = args.max_tokens or len(prompts) * (args.prompt + new + 256)
            engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, chunk_size=args.chunk,
                                                            max_batch=args.max_batch, share_prompts=share))
            engine.generate(prompts, max_new_tokens=new, sampling=sampling)  # warm-up: kernels tuned, graphs captured
            times = []
            for _ in range(args.repeats):
                seconds, outs = wall_s(lambda: engine.generate(prompts, max_new_tokens=new, sampling=sampling))
                times.append(seconds)
            toks[share] = [o.tokens for o in outs]
            same = sum(a == b for a, b in zip(toks[False], toks[share]))
            # where each request that differs from "off" first does, and how many distinct outputs
            # each prompt's copies drew (greedy: 1 unless their batches rounded apart)
            apart = [next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                     for a, b in zip(toks[False], toks[share]) if a != b]
            kinds = [len({tuple(t) for t in toks[share][g * args.copies:(g + 1) * args.copies]})
                     for g in range(args.prompts)]
            res = {"best_s": min(times), "all_s": times, "prompt_tok_s": len(prompts) * args.prompt / min(times),
                   "same": same, "first_differing_token": apart, "distinct_outputs_per_prompt": kinds}
            record(run, res, new=new, share_prompts=share)
            rows.append({"new": new, "share": share, **res, "all_s": " / ".join(f"{t:.3f}" for t in times),
                         "same": f"{same}/{len(prompts)}"})
            print(f"new {new} share {share}: {min(times):.3f} s; first differing token {apart}, distinct outputs "
                  f"per prompt {kinds}", flush=True)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, [("new", "new", "d"), ("share", "share", ""), ("best s", "best_s", ".3f"), ("all s", "all_s", ""),
                       ("prompt tok/s", "prompt_tok_s", ",.0f"), ("same", "same", "")])
