"""How predictable is a random target's greedy continuation, per --quiet-layers factor (CPU, fp32).

A draft can only learn a target whose next token follows from little context. Random weights at
the released widths give layers whose outputs dwarf the token embeddings, so greedy continuations
are close to chaotic; params.quiet_layers(C) divides every layer's output projections by C, leaving
more of the residual stream to the current token's embedding. For each C this prints, over the
greedy continuations of random prompts (Engine.generate, fp32):
  bigram   the share of generated tokens that follow from the previous token alone: the argmax
           of the head over that token's normed embedding (what a draft can learn from any token);
  flip     the share of positions whose argmax a bf16 forward of the same tokens turns (rounding
           alone: how far plain and speculative decoding, whose kernels round differently, agree);
  margin   the median gap between the top two logits (fp32).
A model at the released widths with fewer experts and a smaller vocabulary fits this machine
(4 layers, 16 experts, a 32K vocabulary: ~8 GB in fp32; about a minute a factor on 2 cores).

    python scripts/quiet_probe.py --quiet 1 8 128 512 2048        # the slice's widths
    python scripts/quiet_probe.py --tiny --quiet 1 8              # the tests' tiny model
"""

import argparse
import time

import torch

import mimo_fn as mf
from mimo_fn.layers.norm import rms_norm_ref
from mimo_fn.params import quiet_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quiet", type=float, nargs="+", default=[1, 8, 128, 512, 2048], help="factors C to probe")
    ap.add_argument("--tiny", action="store_true", help="ModelConfig.tiny() instead of the released widths")
    ap.add_argument("--layers", type=int, default=4, help="layers (released widths)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts, top-8 (released widths)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary (released widths)")
    ap.add_argument("--prompts", type=int, default=6, help="random prompts")
    ap.add_argument("--prompt-len", type=int, default=24, help="tokens a prompt")
    ap.add_argument("--new", type=int, default=24, help="greedy tokens a prompt")
    args = ap.parse_args()
    cfg = (mf.ModelConfig.tiny() if args.tiny else
           mf.ModelConfig.flash(num_layers=args.layers, num_experts=args.experts, vocab_size=args.vocab,
                                intermediate_size=8192))
    base = mf.init_params(cfg, seed=0, dtype=torch.float32)
    prompts = torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len),
                            generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{'tiny model' if args.tiny else f'{cfg.num_layers} layers at the released widths, {cfg.num_experts} experts, vocab {cfg.vocab_size}'}; "
          f"{args.prompts} prompts x {args.new} greedy tokens")
    print(f"{'C':>8} {'bigram':>7} {'flip':>6} {'margin':>7}")
    for c in args.quiet:
        t0 = time.time()
        p32 = quiet_layers(base, c)
        engine = mf.Engine(cfg, p32, mf.EngineConfig(max_tokens=args.prompts * (args.prompt_len + args.new + 32),
                                                     page_size=16))
        outs = engine.generate(prompts, args.new)
        del engine
        p16 = torch.utils._pytree.tree_map(
            lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, p32)
        bigram = flip = n = 0
        margins = []
        with torch.no_grad():
            for prompt, out in zip(prompts, outs):
                seq = torch.tensor(prompt + out.tokens)
                rows = slice(len(prompt) - 1, len(seq) - 1)  # the positions that predicted out.tokens
                l32 = mf.forward(p32, cfg, seq)[rows].float()
                l16 = mf.forward(p16, cfg, seq)[rows].float()
                want = torch.tensor(out.tokens)
                flip += (l16.argmax(-1) != l32.argmax(-1)).sum().item()
                alone_TV = rms_norm_ref(p32.embed[seq[rows]], p32.norm, cfg.rms_norm_eps) @ p32.lm_head.T
                bigram += (alone_TV.argmax(-1) == want).sum().item()
                top2 = l32.topk(2, dim=-1).values
                margins += (top2[:, 0] - top2[:, 1]).tolist()
                n += len(want)
        margins.sort()
        print(f"{c:8g} {bigram / n:7.3f} {flip / n:6.3f} {margins[len(margins) // 2]:7.3f}   ({n} tokens, {time.time() - t0:.0f} s)",
              flush=True)
        del p16, p32


if __name__ == "__main__":
    main()
