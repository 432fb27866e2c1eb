"""FP8 full attention (MIMO_FN_ATTENTION_FP8=1) at the model level: what it changes in the logits.

The 6-layer slice of MiMo-V2-Flash at the released dims (random weights, seed 0; --quantization fp8:
FP8 experts and projections, as served) on one GPU (--device cpu: the tiny config in fp32, a smoke run:
off CUDA attention always takes the reference, so every row agrees). --prompts random prompts of
--prompt-len tokens, each run with options.attention_fp8 off and on (options.override):
  last-token cos / top-1   the batch's last-token logits after a chunked prefill (mf.prefill, the
                           engine's paged path): cosine, and how many prompts pick the same top token
  all-pos top-1            every position's logits (mf.prefill with all_logits, one prompt at a time): the
                           share of positions whose top token agrees
  greedy                   Engine.generate of --new tokens: prompts whose tokens all agree, and the mean
                           length of the agreeing prefix (decode itself runs the bf16 split-K kernel: the
                           difference enters through the prefill's attention and the K/V it leads to)
As a noise floor, the same for the bf16 kernels against the plain-torch reference (options.attention_ref)
on the prompts' first --ref-len tokens (the reference's [N, Q, L] scores do not fit at 8K), with FP8
against the reference at that length beside it.

    python -m mimo_fn.bench attention-fp8 [--prompts 4] [--prompt-len 8192] [--ref-len 2048] [--new 32]
        [--quantization bf16|fp8]
"""

import torch

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.batch import Batch
from mimo_fn.bench.results import record
from mimo_fn.bench.workload import add_model_args, chunked_prefill, model_name, model_setup
from mimo_fn.cache import DEFAULT_PAGE_SIZE

NEEDS_CUDA = False
MODES = {"bf16": dict(attention_fp8=False), "fp8": dict(attention_fp8=True), "ref": dict(attention_ref=True)}


def add_args(ap) -> None:
    ap.add_argument("--prompts", type=int, default=4, help="random prompts")
    ap.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    ap.add_argument("--ref-len", type=int, default=2048, help="prompt tokens for the comparisons with the reference (0: none)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk, tokens per pass")
    ap.add_argument("--quantization", choices=["bf16", "fp8"], default="fp8",
                    help="weights: bf16, or FP8 experts and projections (what serving runs; leaves memory room)")
    add_model_args(ap)


def all_positions_top1(cfg, params, prompt, chunk):
    """Top-1 token at every position of one prompt, through the paged prefill (the kernels the
    options pick; mf.forward is the dense reference and would not use them), chunk tokens a pass."""
    state = mf.init_state(cfg, params, max_tokens=len(prompt) + 2 * DEFAULT_PAGE_SIZE)
    top = []
    for c0 in range(0, len(prompt), chunk):
        state, out = mf.prefill(state, Batch.from_tokens([0], [prompt[c0:c0 + chunk].tolist()]), all_logits=True)
        top.append(out.logits_TV.argmax(-1).cpu())
        del out
    del state
    return torch.cat(top)


def run_mode(cfg, params, prompts, mode, args, device):
    """Last-token logits_BV (prefill), top-1 of every position per prompt (prefill), greedy tokens."""
    with options.override(**MODES[mode]), torch.no_grad():
        last = chunked_prefill(cfg, params, prompts, args.chunk).float()
        top = [all_positions_top1(cfg, params, p, args.chunk) for p in prompts]
        engine = mf.Engine(cfg, params, mf.EngineConfig(
            max_tokens=sum(len(p) for p in prompts) + len(prompts) * (args.new + 256),
            chunk_size=args.chunk, cuda_graphs=device == "cuda" and mode != "ref"))  # the reference syncs
        greedy = [o.tokens for o in engine.generate([p.tolist() for p in prompts], max_new_tokens=args.new)]
        del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return last, top, greedy


def compare(a, b):
    last_a, top_a, greedy_a = a
    last_b, top_b, greedy_b = b
    cos = torch.nn.functional.cosine_similarity(last_a, last_b, dim=-1)
    same_top = (last_a.argmax(-1) == last_b.argmax(-1)).sum().item()
    all_pos = torch.cat([x == y for x, y in zip(top_a, top_b)]).float().mean().item()
    same_greedy = sum(x == y for x, y in zip(greedy_a, greedy_b))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
              for x, y in zip(greedy_a, greedy_b)]
    return dict(cos_min=cos.min().item(), cos_mean=cos.mean().item(), top1=same_top, all_pos_top1=all_pos,
                greedy_same=same_greedy, greedy_prefix=sum(prefix) / max(len(prefix), 1))


def main(args, run) -> None:
    cfg, device, dtype = model_setup(args)
    quantize = None if args.quantization == "bf16" or device == "cpu" else args.quantization
    params = mf.init_params(cfg, seed=0, dtype=dtype, device=device, quantize=quantize)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen) for _ in range(args.prompts)]
    short = [p[:min(args.ref_len, args.prompt_len)] for p in prompts]
    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)} ({args.quantization if quantize else dtype}), "
          f"{args.prompts} prompts x {args.prompt_len} tokens (reference: {len(short[0]) if args.ref_len > 0 else 'none'}), {args.new} greedy tokens",
          flush=True)
    rows = []
    full = {mode: run_mode(cfg, params, prompts, mode, args, device) for mode in ("bf16", "fp8")}
    rows.append(("fp8 vs bf16", args.prompt_len, compare(full["fp8"], full["bf16"])))
    if args.ref_len > 0:
        at_ref = {mode: run_mode(cfg, params, short, mode, args, device) for mode in ("ref", "bf16", "fp8")}
        rows.append(("bf16 vs ref", len(short[0]), compare(at_ref["bf16"], at_ref["ref"])))
        rows.append(("fp8 vs ref", len(short[0]), compare(at_ref["fp8"], at_ref["ref"])))
    n = args.prompts
    print(f"\n{'comparison':12} {'tokens':>6} {'last-token cos (min/mean)':>26} {'top-1':>6} {'all-pos top-1':>13} "
          f"{'greedy same':>11} {'greedy prefix':>13}")
    for name, tokens, r in rows:
        record(run, r, comparison=name, tokens=tokens, prompts=n, new=args.new)
        print(f"{name:12} {tokens:>6} {r['cos_min']:>12.6f} / {r['cos_mean']:.6f}   {r['top1']:>2}/{n:<2} "
              f"{r['all_pos_top1']:>13.4f} {r['greedy_same']:>6}/{n:<4} {r['greedy_prefix']:>9.1f}/{args.new}")
