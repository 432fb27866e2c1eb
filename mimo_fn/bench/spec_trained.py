"""`python -m mimo_fn.bench spec --trained`: what a trained DFlash draft buys, side by side with
plain decoding (mimo_fn.bench.spec's docstring describes the run; this is its second half).

Legend: B sequences decoded together.
"""

import os
from collections import Counter
from dataclasses import replace

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.speculative.dflash import DFlashProposer, init_dflash
from mimo_fn.speculative.dflash_checkpoint import load_dflash, save_dflash
from mimo_fn.speculative.dflash_distill import TrainConfig, accept_length, cast, greedy_data, train
from mimo_fn.speculative.draft_vocab import coverage, frequent_tokens
from mimo_fn.speculative.train_dflash import draft_config


def trained_draft(args, cfg, params, device):
    """(DFlashConfig, draft weights in the target's dtype, training history or None): loaded from
    --draft-path where a draft is there, else trained for --train-seconds (and saved there)."""
    path = args.draft_path
    if path and os.path.exists(os.path.join(path, "config.json")):
        dcfg, dparams = load_dflash(path, cfg, dtype=params.embed.dtype, device=device)
        print(f"draft loaded from {path}: {dcfg}", flush=True)
        return dcfg, dparams, None
    dcfg = draft_config(cfg, args.block_size, num_layers=args.dflash_layers)
    gen = torch.Generator().manual_seed(1)
    if not 0 <= args.train_long_prompts <= 1:
        raise SystemExit(f"--train-long-prompts {args.train_long_prompts}: expected a share in [0, 1]")
    n_long = round(args.train_prompts * args.train_long_prompts)  # as long as the decode runs' prompts
    prompts = torch.randint(0, cfg.vocab_size, (args.train_prompts - n_long, args.train_prompt_len),
                            generator=gen).tolist()
    held_out = torch.randint(0, cfg.vocab_size, (8, args.train_prompt_len), generator=gen).tolist()
    prompts += torch.randint(0, cfg.vocab_size, (n_long, args.prompt), generator=gen).tolist()
    seconds, data = wall_s(lambda: greedy_data(cfg, params, prompts, args.train_new, dcfg.target_layers,
                                               on_host=args.train_data_on_host, decode_batch=args.train_data_batch))
    print(f"data: {len(prompts)} prompts ({n_long} of {args.prompt} tokens) x {args.train_new} greedy tokens in "
          f"{seconds:.1f} s", flush=True)

    def evaluate(d):
        return accept_length(cfg, params, cast(d, params.embed.dtype), dcfg, held_out, args.train_new)[0]

    budget = args.train_seconds
    if args.train_total_seconds is not None:  # the data's time comes out of the whole budget
        budget = args.train_total_seconds - seconds
        if budget <= 0:
            raise SystemExit(f"--train-total-seconds {args.train_total_seconds:g}: the data alone took "
                             f"{seconds:.0f} s; expected a budget above that")
        print(f"training for {budget:.0f} s: {args.train_total_seconds:g} s less the data's", flush=True)
    tc = TrainConfig(steps=args.train_steps, seqs=args.train_batch, anchors=args.train_anchors, lr=args.train_lr,
                     eval_every=args.train_eval_every or args.train_steps, max_seconds=budget)
    dparams = init_dflash(cfg, dcfg, seed=0, device=device)
    if args.draft_vocab:
        dparams = replace(dparams, vocab=frequent_tokens(data.tokens, data.prompt_lens, args.draft_vocab).to(device))
        print(f"draft vocabulary: {dparams.vocab.numel()} tokens, "
              f"{coverage(dparams.vocab, data.tokens, data.prompt_lens):.1%} of the continuations' tokens", flush=True)
    seconds, (dparams, history) = wall_s(lambda: train(
        cfg, params, dparams, dcfg, data, tc, evaluate, autocast=torch.bfloat16 if device == "cuda" else None))
    print(f"trained {history[-1]['step']} steps in {seconds:.0f} s", flush=True)
    dparams = cast(dparams, params.embed.dtype)
    if path:
        save_dflash(dparams, dcfg, cfg, path)
    return dcfg, dparams, history


def run(args, run_, cfg, params, device) -> None:
    """The --trained measurement on target params (quieted already where --quiet-layers asks)."""
    dcfg, dparams, history = trained_draft(args, cfg, params, device)
    if history is not None:
        record(run_, {"accept_length_untrained": history[0]["accept_length"],
                      "accept_length_trained": history[-1]["accept_length"], "steps": history[-1]["step"],
                      "loss": history[-1]["loss"], "curve": history}, case="training")
    gen = torch.Generator().manual_seed(2)  # held out: neither the training prompts nor its evaluation's
    top = max(args.batches)
    prompts = torch.randint(0, cfg.vocab_size, (top * args.groups, args.prompt), generator=gen).tolist()
    config = mf.EngineConfig(max_tokens=top * (args.prompt + args.new + 256), cuda_graphs=not args.eager)
    engines = {"plain": mf.Engine(cfg, params, config)}
    for cut in [0.0, *args.min_confidence]:  # the draft as it is, then under each confidence cut
        proposer = DFlashProposer(dparams, dcfg, params, cfg, cuda_graphs=not args.eager, min_confidence=cut)
        engines[cut] = mf.Engine(cfg, params, replace(config, num_draft_tokens=dcfg.block_size - 1, proposer=proposer))
    rows = []
    for b in args.batches:
        groups = [prompts[g * b:(g + 1) * b] for g in range(args.groups)]  # decoded one group after another
        got = {name: _decode(engine, groups, args) for name, engine in engines.items()}
        plain_tok_s, plain_e2e, want, _ = got.pop("plain")
        for cut, (tok_s, e2e, tokens, (kept, steps, lengths)) in got.items():
            same = sum(a == w for a, w in zip(tokens, want))
            first = sorted(next((i for i, (a, w) in enumerate(zip(sa, wa)) if a != w), len(wa))
                           for sa, wa in zip(tokens, want))  # where each sequence first differs
            res = {"min_confidence": cut, "plain_tok_s": plain_tok_s, "spec_tok_s": tok_s,
                   "speedup": tok_s / plain_tok_s if plain_tok_s and tok_s else None,
                   "plain_e2e_tok_s": plain_e2e, "spec_e2e_tok_s": e2e, "e2e_speedup": e2e / plain_e2e,
                   "accept_length": kept / steps if steps else None, "same": same, "first_diff_min": first[0],
                   "first_diff_median": first[len(first) // 2],
                   "accept_histogram": dict(sorted(lengths.items()))}  # acceptance length -> verify steps
            record(run_, res, case="decode", batch=b, groups=args.groups)
            rows.append({"batch": b, **res, "same": f"{same}/{len(first)}",
                         "first_diff": f"{first[0]} / {first[len(first) // 2]}"})
            print(f"batch {b}, cut {cut}: {plain_e2e:.0f} -> {e2e:.0f} tok/s end to end, accept length "
                  f"{res['accept_length']:.2f}", flush=True)
    untrained = "" if history is None else f", untrained {history[0]['accept_length']:.2f}"
    print_table(rows, [("batch", "batch", "d"), ("cut", "min_confidence", "g"),
                       ("plain decode tok/s", "plain_tok_s", ",.0f"),
                       ("DFlash decode tok/s", "spec_tok_s", ",.0f"), ("speedup", "speedup", ".2f"),
                       ("plain e2e tok/s", "plain_e2e_tok_s", ",.0f"), ("DFlash e2e tok/s", "spec_e2e_tok_s", ",.0f"),
                       ("e2e speedup", "e2e_speedup", ".2f"), ("accept length", "accept_length", ".2f"),
                       ("same tokens", "same", ""), ("first diff (min / median)", "first_diff", "")],
                title=f"decode tokens/s, greedy, plain vs a trained DFlash draft (block {dcfg.block_size}"
                      f"{untrained}; cut: --min-confidence, 0 = none)")


def _decode(engine, groups, args):
    """(decode tok/s or None, end-to-end tok/s, every sequence's tokens, (tokens kept, verify
    steps, acceptance histogram) or None for a plain engine) over the groups, one after another."""
    engine.generate(groups[0], args.new)  # warm-up: compiled, tuned, captured outside the timing
    t_prefill = t_all = 0.0
    tokens, kept, steps, lengths = [], 0, 0, Counter()
    for batch in groups:
        t_prefill += min(wall_s(lambda: engine.generate(batch, 1))[0] for _ in range(args.repeats))
        timed = [wall_s(lambda: engine.generate(batch, args.new)) for _ in range(args.repeats)]
        t, outs = min(timed, key=lambda x: x[0])
        t_all += t
        tokens += [o.tokens for o in outs]
        if engine.config.num_draft_tokens:  # the last call's tally: every group's verify steps count alike
            stats = engine.spec_stats()
            kept, steps = kept + stats["accepted"] + stats["verified"], steps + stats["verified"]
            lengths.update(stats["histogram"])
    decode = t_all - t_prefill  # the generate calls less their prefills (None where noise hides it)
    n = len(tokens)
    return (n * (args.new - 1) / decode if decode > 0 else None, n * args.new / t_all, tokens,
            (kept, steps, lengths) if engine.config.num_draft_tokens else None)
