"""Why a trained DFlash draft's acceptance stays where it does: per block position, on held-out
continuations, split by whether the anchor token was an anchor in the training data.

    python scripts/dflash_diag.py [--prompts 1024 4096] [--train-seconds 150]      # the GPU run (~6 min)
    python scripts/dflash_diag.py --device cpu --prompts 16 64 --prompt-len 8 --new 24 --held-out 8 \
        --train-seconds 15                                                        # the tiny model, seconds
    python scripts/dflash_diag.py --device cpu --prompts 128 --prompt-len 8 --new 24 --held-out 8 --lr 1e-2 \
        --train-batch 16 --train-anchors 8 --train-seconds 60 --long-len 128 --long-prompts 0.25  # (and 0)

The target is `bench spec --trained`'s (the slice, FP8 experts, layers divided by --quiet-layers).
One set of --max(prompts) random prompts of --prompt-len tokens, continued greedily by --new
tokens, is drawn once; each value of --prompts trains a fresh 2-layer block-8 draft on the first
that many sequences for --train-seconds (--device cpu: the tiny model instead). Then, teacher-forced
on --held-out other sequences (every anchor of their continuations) and on as many training ones:
  pos k accuracy: the share of blocks whose draft k is the target's token;
  accept: 1 + the leading drafts that are right (what a verify step would keep), mean;
and the real Engine's mean acceptance length on 8 of the held-out prompts and on 8 of --long-len
tokens (a verify step's anchors are where the draft failed before, so it weighs the hard anchors
more). --long-prompts F makes a share F of the training prompts --long-len tokens long (the
held-out sequences stay short): whether a draft that saw only short contexts drafts as well after
long ones. "seen" anchors are
tokens that were anchors in the training sequences' continuations. The data line says how many
distinct tokens the continuations hold and how many held-out continuation tokens they hold too.

Legend: S sequences, C tokens, A anchors, J drafts a block.
"""

import argparse
from dataclasses import replace

import torch

from mimo_fn.bench.workload import flash_slice
from mimo_fn.cli_help import HelpFormatter
from mimo_fn.config import ModelConfig
from mimo_fn.params import random_params
from mimo_fn.quant import QTensor, dequantize
from mimo_fn.speculative.dflash import init_dflash
from mimo_fn.speculative.dflash_distill import (GreedyData, TrainConfig, accept_length, block_logits, cast,
                                                greedy_data, train)
from mimo_fn.speculative.train_dflash import draft_config


def subset(data: GreedyData, rows) -> GreedyData:
    return GreedyData([data.tokens[i] for i in rows], [data.hidden[i] for i in rows], [data.prompt_lens[i] for i in rows])


def anchor_tokens(data: GreedyData, block: int) -> set[int]:
    """The tokens that sit at an anchor position of a continuation (one a training block can start at)."""
    return {t for toks, p in zip(data.tokens, data.prompt_lens) for t in toks[p:len(toks) - block + 1].tolist()}


@torch.no_grad()
def teacher_forced(dparams, dcfg, target, data: GreedyData, seen: set[int], rows: int = 8):
    """Per sequence group: every continuation anchor's block, drafts against the target's tokens.
    Returns {"all" / "seen" / "unseen" / "<16 in" / ">=16 in" (tokens into the continuation):
    (blocks, accuracy per position [J], mean accept)}."""
    B, J = dcfg.block_size, dcfg.block_size - 1
    hits, kinds, early = [], [], []
    for g in range(0, len(data.tokens), rows):
        toks = data.tokens[g:g + rows]
        C = max(map(len, toks))
        tokens_SC = torch.zeros(len(toks), C, dtype=torch.long)
        hidden = data.hidden[g].new_zeros(len(toks), C, *data.hidden[g].shape[1:])
        for s, t in enumerate(toks):
            tokens_SC[s, :len(t)], hidden[s, :len(t)] = t, data.hidden[g + s]
        first, last = max(data.prompt_lens[g:g + rows]), min(map(len, toks)) - B
        anchors_SA = torch.arange(first, last + 1).expand(len(toks), -1).contiguous()
        dev = hidden.device
        logits = block_logits(dparams, dcfg, target, hidden, tokens_SC.to(dev), anchors_SA.to(dev))
        labels_SAJ = tokens_SC.gather(1, (anchors_SA[..., None] + torch.arange(1, B)).flatten(1)).view(*anchors_SA.shape, J)
        hits.append((logits.argmax(-1).cpu() == labels_SAJ).flatten(0, 1))
        kinds += [int(t) in seen for t in tokens_SC.gather(1, anchors_SA).flatten().tolist()]
        early += (anchors_SA - first < 16).flatten().tolist()
    hit_XJ = torch.cat(hits)
    kind_X, early_X = torch.tensor(kinds), torch.tensor(early)
    accept_X = 1 + hit_XJ.int().cumprod(-1).sum(-1)
    out = {}
    for name, m in (("all", torch.ones_like(kind_X)), ("seen", kind_X), ("unseen", ~kind_X),
                    ("<16 in", early_X), (">=16 in", ~early_X)):
        if m.any():
            out[name] = (int(m.sum()), hit_XJ[m].float().mean(0).tolist(), accept_X[m].float().mean().item())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the slice in FP8; cpu: the tiny model in fp32 (a smoke run)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096], help="training sequences, one draft each")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens a random prompt")
    ap.add_argument("--new", type=int, default=96, help="greedy tokens after each prompt")
    ap.add_argument("--held-out", type=int, default=16, help="held-out sequences")
    ap.add_argument("--train-seconds", type=float, default=150.0, help="training time of each draft")
    ap.add_argument("--train-batch", type=int, default=32, help="sequences a training step")
    ap.add_argument("--train-anchors", type=int, default=16, help="blocks a sequence and training step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the tiny draft learns faster at 1e-2)")
    ap.add_argument("--quiet-layers", type=float, default=8192.0, help="the target's layer outputs divided by this")
    ap.add_argument("--long-prompts", type=float, default=0.0,
                    help="this share of the training prompts has --long-len tokens (spread evenly over them)")
    ap.add_argument("--long-len", type=int, default=512,
                    help="tokens a long prompt; the Engine's acceptance is measured after 8 held-out ones too")
    args = ap.parse_args(argv)
    if not 0 <= args.long_prompts <= 1:
        raise SystemExit(f"--long-prompts {args.long_prompts}: expected a share in [0, 1]")
    cuda = args.device == "cuda"
    cfg = flash_slice() if cuda else ModelConfig.tiny()
    params = random_params(cfg, 0, torch.bfloat16 if cuda else torch.float32, args.device,
                           quantize="fp8" if cuda else None, quiet=args.quiet_layers)
    dcfg = draft_config(cfg, 8, num_layers=2)
    gen = torch.Generator().manual_seed(1)
    top = max(args.prompts)
    prompts = torch.randint(0, cfg.vocab_size, (top + args.held_out, args.prompt_len), generator=gen).tolist()
    long = [i for i in range(top) if int((i + 1) * args.long_prompts) > int(i * args.long_prompts)]
    for i in long:
        prompts[i] = torch.randint(0, cfg.vocab_size, (args.long_len,), generator=gen).tolist()
    long_set = set(long)
    long_held = torch.randint(0, cfg.vocab_size, (8, args.long_len), generator=gen).tolist()
    data = greedy_data(cfg, params, prompts, args.new, dcfg.target_layers)
    held = subset(data, range(top, top + args.held_out))
    held_cont = {t for toks, p in zip(held.tokens, held.prompt_lens) for t in toks[p:].tolist()}
    target = params
    if isinstance(params.lm_head, QTensor):
        target = replace(params, lm_head=dequantize(params.lm_head, params.embed.dtype))
    rows = []
    for n in args.prompts:
        train_data = subset(data, range(n))
        seen = anchor_tokens(train_data, dcfg.block_size)
        cont = {t for toks, p in zip(train_data.tokens, train_data.prompt_lens) for t in toks[p:].tolist()}
        print(f"{n} sequences: {len(cont)} distinct continuation tokens; held-out continuation tokens also in "
              f"them: {len(held_cont & cont)} of {len(held_cont)}", flush=True)
        dparams = init_dflash(cfg, dcfg, seed=0, device=args.device)
        tc = TrainConfig(steps=100000, seqs=args.train_batch, anchors=args.train_anchors, lr=args.lr, eval_every=100000,
                         max_seconds=args.train_seconds)
        dparams, hist = train(cfg, params, dparams, dcfg, train_data, tc, None,
                              autocast=torch.bfloat16 if cuda else None)
        d = cast(dparams, params.embed.dtype)
        engine_accept = (accept_length(cfg, params, d, dcfg, prompts[top:top + 8], args.new)[0],
                         accept_length(cfg, params, d, dcfg, long_held, args.new)[0])
        short = [i for i in range(n) if i not in long_set][:args.held_out]
        for split, part in (("held-out", held), ("train", subset(train_data, short))):
            for kind, (count, acc, accept) in teacher_forced(d, dcfg, target, part, seen).items():
                rows.append((n, hist[-1]["step"], hist[-1]["loss"], split, kind, count, acc, accept, engine_accept))
        del dparams, d
    print(f"\nteacher-forced draft accuracy per block position (quiet {args.quiet_layers}, {args.device}; "
          f"{len(long)} of the {top} prompts of {args.long_len} tokens, the others {args.prompt_len})")
    print("train seqs  steps  mean loss  split     anchors  blocks  " + "  ".join(f"pos{k}" for k in range(1, 8))
          + f"  accept  engine accept after {args.prompt_len} / {args.long_len} held-out tokens")
    for n, steps, loss, split, kind, count, acc, accept, (ea, ea_long) in rows:
        print(f"{n:10d}  {steps:5d}  {loss:9.4f}  {split:8s}  {kind:7s}  {count:6d}  "
              + "  ".join(f"{a:.2f}" for a in acc) + f"  {accept:6.2f}  {ea:.2f} / {ea_long:.2f}")


if __name__ == "__main__":
    main()
