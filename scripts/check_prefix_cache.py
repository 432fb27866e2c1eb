"""Numerics of the prefix cache at the released dims: are log-probs through a forked entry as
close to the reference path as those the engine computes without the cache?

The 6-layer slice of MiMo-V2-Flash (bf16, random weights, one GPU). Two engines, prefix cache on
and off. A first call on the cached engine leaves entries of --convs prompts that share a
--system-token system prompt (each then a --question-token question and --new generated tokens).
A second call asks both engines --convs new questions after the same system prompt, greedy, with
log-probs: with the cache on each prompt forks all of the system prompt but its last token from an
entry. Its prompt and output log-probs are compared with `forward` (the reference path: no cache,
plain-torch attention) on the prompt and its answer, for each engine. Prints max and mean
|log-prob - forward's| per engine and between them; the cached engine's differences should be of
the size of the uncached one's (bf16 rounding), not larger.

    python scripts/check_prefix_cache.py [--convs 4] [--system 4096] [--question 512] [--new 32]
"""

import argparse

import torch

import mimo_fn as mf
from mimo_fn.bench.cli import HelpFormatter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--convs", type=int, default=4, help="prompts per call")
    ap.add_argument("--system", type=int, default=4096, help="tokens of the system prompt every prompt begins with")
    ap.add_argument("--question", type=int, default=512, help="tokens of each prompt's own question")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated per prompt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_prefix_cache.py: needs a CUDA GPU (none is visible to torch)")
    cfg = mf.ModelConfig.flash(num_layers=6)
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    system = rand(args.system)
    config = dict(max_tokens=4 * args.convs * (args.system + args.question + args.new + 256))
    engines = {on: mf.Engine(cfg, params, mf.EngineConfig(prefix_cache=on, **config)) for on in (False, True)}
    engines[True].generate([system + rand(args.question) for _ in range(args.convs)], max_new_tokens=args.new,
                           return_logprobs=True)  # (an entry serves calls that ask for what it holds)
    prompts = [system + rand(args.question) for _ in range(args.convs)]
    outs = {on: e.generate(prompts, max_new_tokens=args.new, return_logprobs=True) for on, e in engines.items()}
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  6-layer slice, bf16, {args.convs} prompts of "
          f"{args.system} system + {args.question} question tokens, {args.new} greedy tokens; cache on forked "
          f"{engines[True].prefix_stats['tokens']:,d} tokens")
    diffs = {False: [], True: [], "on-off": []}
    for i, p in enumerate(prompts):
        lps = {}
        for on in (False, True):
            o = outs[on][i]
            full = torch.tensor(p + o.tokens, device="cuda")
            with torch.no_grad():
                ref = torch.log_softmax(mf.forward(params, cfg, full).float(), -1)[:-1].gather(-1, full[1:, None])[:, 0]
            lps[on] = torch.tensor(o.prompt_logprobs + o.logprobs, device="cuda")
            diffs[on].append((lps[on] - ref).abs())
        if outs[False][i].tokens == outs[True][i].tokens:
            diffs["on-off"].append((lps[True] - lps[False]).abs())
    same = sum(outs[False][i].tokens == outs[True][i].tokens for i in range(len(prompts)))
    print(f"same greedy tokens on and off: {same}/{len(prompts)}")
    print(f"{'log-probs':>22} {'max |diff|':>11} {'mean |diff|':>12} {'tokens':>8}")
    for name, key in (("cache off vs forward", False), ("cache on vs forward", True), ("cache on vs off", "on-off")):
        if diffs[key]:
            d = torch.cat(diffs[key])
            print(f"{name:>22} {d.max().item():11.4f} {d.mean().item():12.5f} {d.numel():8,d}")


if __name__ == "__main__":
    main()
