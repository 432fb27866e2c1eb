"""Multi-turn rollouts on one GPU with EngineConfig.prefix_cache on and off.

The 6-layer slice of MiMo-V2-Flash at the released dims (as the generate benchmark), random bf16
weights, CUDA graphs and overlap on (--device cpu: the tiny config in fp32). --convs conversations, each a generate call per turn over
all of them: turn 1's prompt is --prompt random tokens; each later turn's prompt is the turn
before's prompt, its --new generated tokens and a new message of --message random tokens (the
same messages in both modes). Each mode feeds its own answers forward, as a rollout does. With
the cache on, a turn forks the K/V of the turn before (its prompt and answer) and prefills the
rest. Prints, per turn and mode, the wall time of `generate` (after a warm-up call
on other prompts that tunes kernels and captures the decode graphs), the prompt tokens, those
forked from the cache, and how many conversations drew the same answer in both modes (K/V from
the cache equals recomputed K/V up to bf16 rounding, so a sampled draw near a boundary may
differ, and the conversations then go apart). The two modes run in turn --rounds times on fresh
engines (a first round also pays for kernels compiled on new shapes); the summary is the last
round's. --again: every turn draws new answers to the first prompts instead (more samples of
the same prompts with the same weights, as dynamic sampling asks for), each --copies times
(copies share K/V in a call anyway: EngineConfig.share_prompts); the cache forks all of each
prompt but its last token. --system: every turn asks each conversation a new question of
--message tokens after one system prompt of --prompt tokens that all turns share (one call
prefills it once anyway, as prompts that begin alike: EngineConfig.share_prompts); the cache
forks the system prompt's K/V from the turn before (--copies is not used). --logprobs: the calls
return log-probs, and each turn prints the largest difference between the modes' prompt
log-probs, over the prompts that are the same in both (every one with --system or --again).
--max-swa-tokens: both modes' sliding-window pool (EngineConfig.max_swa_tokens; default as large
as the full pool); a bounded one keeps an entry's last window only, which is all a turn forks.

    python -m mimo_fn.bench prefix-cache [--convs 16] [--turns 4] [--prompt 8192] [--message 1024]
        [--new 128] [--temperature 1.0] [--rounds 2] [--again] [--copies 1] [--system] [--logprobs]
        [--max-swa-tokens N]
"""

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import add_model_args, model_name, model_setup

NEEDS_CUDA = False


def add_args(ap) -> None:
    ap.add_argument("--convs", type=int, default=16, help="conversations")
    ap.add_argument("--turns", type=int, default=4, help="turns (generate calls) per round")
    ap.add_argument("--prompt", type=int, default=8192, help="tokens of turn 1's prompt (with --system: the system prompt)")
    ap.add_argument("--message", type=int, default=1024, help="tokens of each later message (with --system: each question)")
    ap.add_argument("--new", type=int, default=128, help="new tokens a turn")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both modes, on fresh engines")
    ap.add_argument("--again", action="store_true", help="every turn draws new answers to the first prompts")
    ap.add_argument("--copies", type=int, default=1, help="with --again: copies of each prompt")
    ap.add_argument("--system", action="store_true", help="every turn asks new questions after one system prompt")
    ap.add_argument("--logprobs", action="store_true", help="return log-probs and compare the modes' prompt log-probs")
    ap.add_argument("--max-swa-tokens", type=int, default=None,
                    help="both modes' sliding-window pool (default: as large as the full pool)")
    add_model_args(ap)


def main(args, run) -> None:
    cfg, device, dtype = model_setup(args)
    params = mf.init_params(cfg, seed=0, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    first = [p for p in (rand(args.prompt) for _ in range(args.convs)) for _ in range(args.copies)]
    messages = [[rand(args.message) for _ in range(args.convs)] for _ in range(args.turns - 1)]
    if args.system:  # each turn's prompts: the system prompt (first[0]), then a question of their own
        asks = [[first[0] + rand(args.message) for _ in range(args.convs)]] + [[first[0] + m for m in ms]
                                                                               for ms in messages]
        first = asks[0]

    def sampling(turn):  # other draws every turn
        return mf.SamplingParams(temperature=args.temperature, seed=3 + 1000 * turn) if args.temperature > 0 else None

    longest = args.prompt + (0 if args.again else args.message if args.system else
                             (args.turns - 1) * (args.new + args.message)) + args.new
    max_tokens = 2 * len(first) * (longest + 256)  # every conversation's last turn, and the entries beside it
    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}, {args.convs} conversations "
          f"x {args.copies} copies x {args.turns} turns: {args.prompt}-token first prompt, "
          + ("the same prompts every turn" if args.again else f"{args.message}-token questions after one system prompt"
             if args.system else f"{args.message}-token messages")
          + f", {args.new} new tokens a turn, temperature {args.temperature}, KV pool {max_tokens} tokens, "
          f"sliding-window pool {args.max_swa_tokens or max_tokens}")
    answers, totals, scored, rows = {}, {}, {}, []
    for round_, cache in ((r, c) for r in range(args.rounds) for c in (False, True)):
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, max_swa_tokens=args.max_swa_tokens,
                                                        prefix_cache=cache))
        # warm-up on other prompts (at most 2K tokens: what the pool holds at small --prompt)
        engine.generate([rand(min(2048, args.prompt)) for _ in range(len(first))], max_new_tokens=args.new,
                        sampling=sampling(-1))
        engine.update_weights({})  # (empties the cache of the warm-up's entries)
        prompts, answers[cache], totals[cache], scored[cache] = first, [], 0.0, []
        for turn in range(args.turns):
            dt, outs = wall_s(lambda: engine.generate(prompts, max_new_tokens=args.new, sampling=sampling(turn),
                                                      return_logprobs=args.logprobs))
            totals[cache] += dt
            answers[cache].append([o.tokens for o in outs])
            same = (sum(a == b for a, b in zip(answers[False][turn], answers[cache][turn]))
                    if cache else len(first))
            diff, max_diff = "", None
            if args.logprobs:
                scored[cache].append([(p, o.prompt_logprobs) for p, o in zip(prompts, outs)])
                pairs = [(a, b) for (p, la), (q, lb) in zip(scored[False][turn], scored[cache][turn]) if p == q
                         for a, b in zip(la, lb)]
                max_diff = max(abs(a - b) for a, b in pairs) if pairs else None
                diff = f"{max_diff:.4f} over {len(pairs):,d}" if pairs else "-"
            res = {"seconds": dt, "prompt_tokens": sum(map(len, prompts)), "forked": engine.prefix_stats["tokens"],
                   "same_answers": same, "max_prompt_logprob_diff": max_diff}
            record(run, res, round=round_ + 1, turn=turn + 1, prefix_cache=cache)
            rows.append({"round": round_ + 1, "turn": turn + 1, "cache": cache, **res,
                         "same_answers": f"{same}/{len(first)}", "logprob_diff": diff})
            print(f"round {round_ + 1} turn {turn + 1} cache {cache}: {dt:.3f} s", flush=True)
            if turn + 1 < args.turns and args.system:
                prompts = asks[turn + 1]
            elif turn + 1 < args.turns and not args.again:
                prompts = [p + o.tokens + messages[turn][i // args.copies]
                           for i, (p, o) in enumerate(zip(prompts, outs))]
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    record(run, {"off_s": totals[False], "on_s": totals[True], "speedup": totals[False] / totals[True]},
           section="last round, all turns")
    columns = [("round", "round", "d"), ("turn", "turn", "d"), ("cache", "cache", ""), ("s", "seconds", ".3f"),
               ("prompt tokens", "prompt_tokens", ",d"), ("forked", "forked", ",d"), ("same answers", "same_answers", "")]
    print_table(rows, columns + ([("max |prompt log-prob diff|", "logprob_diff", "")] if args.logprobs else []),
                f"last round, all turns: cache off {totals[False]:.3f} s, on {totals[True]:.3f} s "
                f"({totals[False] / totals[True]:.2f}x)")
