"""Train a DFlash draft for a target model by self-distillation, and report its acceptance length.

    python -m mimo_fn.speculative.train_dflash --out DRAFT_DIR [--steps 300] [--block-size 8] ...

The target is the tiny random model by default, or --model-path DIR (a hub-layout checkpoint;
with --load-format dummy, random weights from its config.json, and --json-model-override-args
'{"num_hidden_layers": 6}' for the 6-layer slice, as `python -m mimo_fn.serve` takes them). It
continues --num-prompts random prompts of --prompt-len tokens (or the prompts of --prompts FILE,
one JSON list of token ids a line) by --new-tokens tokens, greedily; the draft learns to predict
those continuations from the target's hidden states (mimo_fn.speculative.dflash_distill says
how). Before the first step, every --eval-every steps and after the last, it prints the loss
and the mean acceptance length (accepted drafts + the bonus token per verify step) that the
real Engine measures decoding --eval-prompts held-out prompts with the draft; then it writes
the draft to --out in z-lab's layout (mimo_fn.speculative.dflash_checkpoint.load_dflash reads
it; EngineConfig(num_draft_tokens=block_size - 1, proposer=DFlashProposer(...)) runs it).
"""

import argparse
import json
import sys
from dataclasses import replace

import torch

from mimo_fn.speculative.dflash import DFlashConfig, init_dflash
from mimo_fn.speculative.dflash_checkpoint import load_dflash, save_dflash
from mimo_fn.speculative.dflash_distill import TrainConfig, accept_length, cast, greedy_data, train
from mimo_fn.speculative.draft_vocab import coverage, frequent_tokens


def default_target_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` layers spread evenly from layer 1 to the last (fewer on a shallow model)."""
    top = num_layers - 1
    if top < 1:
        return (0,)
    count = min(count, top)
    return tuple(sorted({round(1 + i * (top - 1) / max(1, count - 1)) for i in range(count)}))


def draft_config(cfg, block_size: int, target_layers=None, num_layers: int = 1, heads: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None, intermediate: int | None = None,
                 mask_token_id: int | None = None) -> DFlashConfig:
    """A DFlashConfig for target `cfg`; the draft's width defaults follow the target's hidden size
    (32 heads of 128 and an MLP of 2H at the released dims; 4 heads at the tiny model's)."""
    H = cfg.hidden_size
    heads = heads or max(4, H // 128)
    return DFlashConfig(
        target_layers=tuple(target_layers or default_target_layers(cfg.num_layers)),
        mask_token_id=cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        block_size=block_size, num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads or max(1, heads // 4),
        head_dim=head_dim or min(128, H // heads), intermediate_size=intermediate or (4 * H if H < 1024 else 2 * H))


def build_parser() -> argparse.ArgumentParser:
    tc = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m mimo_fn.speculative.train_dflash", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(*names, **kw):
        if "default" in kw and "(default:" not in kw["help"]:
            kw["help"] = f"{kw['help']} (default: {kw['default']})"
        ap.add_argument(*names, **kw)

    add("--out", default="dflash-draft", help="directory the trained draft is written to")
    add("--model-path", default=None, help="the target's hub-layout checkpoint directory; none: the tiny random model")
    add("--load-format", choices=("auto", "dummy"), default="auto",
        help="dummy: random target weights from --model-path's config.json")
    add("--json-model-override-args", default="{}", help="JSON applied to the target's config.json")
    add("--random-seed", type=int, default=0, help="seed of random (dummy / tiny) target weights")
    add("--dummy-quiet-layers", type=float, default=1.0,
        help="divide random target weights' layer outputs by this, as the server's flag of the name does (a random "
             "target's continuations are near chaotic; the draft serves a server started with the same value)")
    add("--quantization", choices=("fp8",), default=None,
        help="the target's GEMM weights in FP8, as the server's --quantization fp8 (default: the weights' dtype)")
    add("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
        help="where target and draft run (bf16 target on CUDA, fp32 on the CPU)")
    add("--block-size", type=int, default=8, help="tokens a block: the last verified token and block_size - 1 drafts")
    add("--target-layers", type=int, nargs="+", default=None,
        help="target layers whose hidden states the draft reads (default: 3 spread from layer 1 to the last)")
    add("--draft-layers", type=int, default=1, help="decoder layers of the draft")
    add("--draft-heads", type=int, default=None, help="draft query heads (default: hidden / 128, at least 4)")
    add("--draft-kv-heads", type=int, default=None, help="draft KV heads (default: a quarter of the heads)")
    add("--draft-head-dim", type=int, default=None, help="draft head dim (default: hidden / heads, at most 128)")
    add("--draft-intermediate", type=int, default=None, help="draft MLP size (default: 2 x hidden; 4 x below 1024)")
    add("--init", default=None, help="start from this draft directory (load_dflash) instead of random weights")
    add("--prompts", default=None, help="JSON lines file, one list of token ids a line (default: random prompts)")
    add("--num-prompts", type=int, default=256, help="random training prompts")
    add("--prompt-len", type=int, default=32, help="tokens a random prompt")
    add("--new-tokens", type=int, default=64, help="greedy tokens the target adds to each prompt")
    add("--long-prompts", type=float, default=0.0,
        help="this share of the random prompts has --long-prompt-len tokens: a draft that saw only short contexts "
             "drafts worse after long ones")
    add("--long-prompt-len", type=int, default=512, help="tokens a long random prompt")
    add("--data-on-host", action="store_true",
        help="keep the data's hidden states in pinned host memory, a step's batch copied over (more data than the GPU "
             "holds)")
    add("--data-batch", type=int, default=256,
        help="sequences the target continues at once while making the data (greedy_data's decode_batch)")
    add("--draft-vocab", type=int, default=0,
        help="the draft scores only this many tokens, the most frequent of the continuations "
             "(mimo_fn.speculative.draft_vocab; EAGLE-3 keeps 32768); 0: the target's whole vocabulary")
    add("--eval-prompts", type=int, default=16, help="held-out random prompts the acceptance length is measured on")
    add("--steps", type=int, default=tc.steps, help="optimiser steps")
    add("--batch-seqs", type=int, default=tc.seqs, help="sequences a step")
    add("--anchors", type=int, default=tc.anchors, help="blocks (anchor positions) a sequence and step")
    add("--lr", type=float, default=tc.lr, help="peak learning rate (AdamW; linear warm-up, cosine decay to 10%%)")
    add("--warmup", type=int, default=tc.warmup, help="warm-up steps")
    add("--gamma", type=float, default=tc.gamma, help="block position k weighted exp(-(k-1)/gamma); 0: all alike")
    add("--eval-every", type=int, default=tc.eval_every, help="steps between acceptance measurements")
    add("--seed", type=int, default=tc.seed, help="seed of prompts, draft init and batches")
    return ap


def load_target(args):
    """(config, weights) of the target the flags name: the server's own loading (serve.launch)."""
    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.serve.args import ServerArgs
    from mimo_fn.serve.launch import load_params, model_config

    try:
        sargs = ServerArgs(model_path=args.model_path, load_format=args.load_format,
                           json_model_override_args=args.json_model_override_args, random_seed=args.random_seed,
                           dummy_quiet_layers=args.dummy_quiet_layers, quantization=args.quantization,
                           device=args.device)
    except ValueError as e:
        raise SystemExit(f"train_dflash: {e}") from None
    cfg, d = model_config(sargs)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return cfg, load_params(sargs, cfg, d, Mesh.single(), dtype, torch.device(args.device))


def read_prompts(path: str, vocab: int) -> list[list[int]]:
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)
            except json.JSONDecodeError:
                ids = None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise SystemExit(f"train_dflash: {path}:{n}: expected a non-empty JSON list of token ids in [0, {vocab})")
            prompts.append(ids)
    if not prompts:
        raise SystemExit(f"train_dflash: {path} holds no prompts")
    return prompts


def main(argv: list[str] | None = None) -> dict:
    """Train and save a draft; returns {"history": [...], "out": path}."""
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_dflash: --device cuda needs a CUDA GPU (none is visible to torch)")
    cfg, params = load_target(args)
    if args.init:
        dcfg, dparams = load_dflash(args.init, cfg, dtype=torch.float32, device=args.device)
    else:
        try:
            dcfg = draft_config(cfg, args.block_size, args.target_layers, args.draft_layers, args.draft_heads,
                                args.draft_kv_heads, args.draft_head_dim, args.draft_intermediate)
            dparams = init_dflash(cfg, dcfg, seed=args.seed, device=args.device)
        except ValueError as e:
            raise SystemExit(f"train_dflash: {e}") from None
    gen = torch.Generator().manual_seed(args.seed)
    held_out = torch.randint(0, cfg.vocab_size, (args.eval_prompts, args.prompt_len), generator=gen).tolist()
    if not 0 <= args.long_prompts <= 1:
        raise SystemExit(f"train_dflash: --long-prompts {args.long_prompts}: expected a share in [0, 1]")
    n_long = round(args.num_prompts * args.long_prompts)
    prompts = read_prompts(args.prompts, cfg.vocab_size) if args.prompts else \
        torch.randint(0, cfg.vocab_size, (args.num_prompts - n_long, args.prompt_len), generator=gen).tolist() + \
        torch.randint(0, cfg.vocab_size, (n_long, args.long_prompt_len), generator=gen).tolist()
    print(f"target: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; draft: {dcfg}",
          flush=True)
    data = greedy_data(cfg, params, prompts, args.new_tokens, dcfg.target_layers, on_host=args.data_on_host,
                       decode_batch=args.data_batch)
    print(f"data: {len(prompts)} prompts continued by {args.new_tokens} greedy tokens", flush=True)
    if args.draft_vocab:
        dparams = replace(dparams, vocab=frequent_tokens(data.tokens, data.prompt_lens, args.draft_vocab).to(args.device))
        print(f"draft vocabulary: {dparams.vocab.numel()} tokens, "
              f"{coverage(dparams.vocab, data.tokens, data.prompt_lens):.1%} of the continuations' tokens", flush=True)
    dtype = params.embed.dtype

    def evaluate(d):
        return accept_length(cfg, params, cast(d, dtype), dcfg, held_out, args.new_tokens)[0]

    tc = TrainConfig(steps=args.steps, seqs=args.batch_seqs, anchors=args.anchors, lr=args.lr, warmup=args.warmup,
                     gamma=args.gamma, eval_every=args.eval_every, seed=args.seed)
    dparams, history = train(cfg, params, dparams, dcfg, data, tc, evaluate,
                             autocast=torch.bfloat16 if args.device == "cuda" else None)
    save_dflash(cast(dparams, dtype), dcfg, cfg, args.out)
    print(f"saved the draft to {args.out}: mean acceptance length {history[0]['accept_length']:.3f} untrained, "
          f"{history[-1]['accept_length']:.3f} after {args.steps} steps (block {dcfg.block_size}, "
          f"{len(held_out)} held-out prompts)", flush=True)
    return {"history": history, "out": args.out}


if __name__ == "__main__":
    main(sys.argv[1:])
