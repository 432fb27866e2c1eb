"""Prefill a few prompts and print tokens/s and each prompt's next-token argmax.

With no arguments it runs on the CPU on an embedded default: a tiny random-weight
MiMo-V2-Flash, written as a real hub-layout checkpoint to a cache directory and loaded
back through load_checkpoint. Point --checkpoint at a real model directory for real use.

    python scripts/prefill.py
    python scripts/prefill.py --checkpoint /models/MiMo-V2-Flash --device cuda --dtype bfloat16
"""

import argparse
import os
import time

import torch

import mimo_fn as mf

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "mimo_fn", "tiny-random")


def default_checkpoint() -> str:
    if not os.path.exists(os.path.join(DEFAULT_DIR, "config.json")):
        cfg = mf.ModelConfig.tiny()
        mf.save_checkpoint(mf.init_params(cfg, seed=0), cfg, DEFAULT_DIR)
        print(f"wrote a tiny random checkpoint to {DEFAULT_DIR}")
    return DEFAULT_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="hub-layout checkpoint directory (default: a tiny random model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    ap.add_argument("--isl", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk per sequence")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    path = args.checkpoint or default_checkpoint()
    t0 = time.perf_counter()
    cfg, params = mf.load_checkpoint(path, dtype=dtype, device=args.device)
    print(f"loaded {path} in {time.perf_counter() - t0:.2f}s: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts, {mf.params.weight_bytes(params) / 2**30:.2f} GiB on {args.device}")

    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (args.isl,), generator=gen) for _ in range(args.prompts)]
    state = mf.init_state(cfg, params, max_tokens=args.prompts * args.isl, page_size=args.page_size)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for start in range(0, args.isl, args.chunk):
        chunks = [p[start:start + args.chunk] for p in prompts]
        state, out = mf.prefill(state, mf.Batch.from_tokens(range(len(prompts)), chunks))
    sync()
    dt = time.perf_counter() - t0
    print(f"prefill: {args.prompts} x {args.isl} tokens in {dt * 1e3:.1f} ms = {args.prompts * args.isl / dt:,.0f} tok/s")
    for i, tok in enumerate(out.logits_BV.argmax(-1).tolist()):
        print(f"prompt {i}: next-token argmax {tok}")


if __name__ == "__main__":
    main()
