"""GPU smoke check: Engine.generate (Triton attention + MoE kernels) against forward() on the tiny config.

For fp32 and bf16 weights: three prompts of different lengths, greedy, with log-probs. Prints how
many generated tokens equal the argmax of `forward` (the reference path) on the prompt and the
tokens before, and the largest difference between the engine's log-probs and forward's.

    python scripts/check_gpu_engine.py [--new 24] [--seed 1]
"""

import argparse

import torch

import mimo_fn as mf
from mimo_fn.bench.cli import HelpFormatter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--new", type=int, default=24, help="tokens generated per prompt")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random weights")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_gpu_engine.py: needs a CUDA GPU (none is visible to torch)")
    cfg = mf.ModelConfig.tiny()
    for dtype in (torch.float32, torch.bfloat16):
        params = mf.init_params(cfg, seed=args.seed, dtype=dtype, device="cuda")
        eng = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=512, page_size=16, chunk_size=32))
        prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 77, 140)]
        outs = eng.generate(prompts, max_new_tokens=args.new, return_logprobs=True)
        agree = tot = 0
        errs = []
        for p, o in zip(prompts, outs):
            full = torch.tensor(p + o.tokens, device="cuda")
            ref = mf.forward(params, cfg, full).float()
            agree += sum(int(a == b) for a, b in zip(o.tokens, ref[len(p) - 1:-1].argmax(-1).tolist()))
            tot += len(o.tokens)
            lp = torch.log_softmax(ref, -1)[:-1].gather(-1, full[1:, None]).squeeze(-1)
            errs.append((torch.tensor(o.prompt_logprobs + o.logprobs, device="cuda") - lp).abs().max().item())
        print(f"GPU engine {dtype}: greedy tokens equal forward argmax {agree}/{tot}, max logprob diff {max(errs):.2e}")


if __name__ == "__main__":
    main()
