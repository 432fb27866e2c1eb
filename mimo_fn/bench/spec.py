"""What a speculative decoding step costs: plain greedy decode steps against verify steps.

A 6-layer slice of MiMo-V2-Flash at the released dims (the prefill benchmark's layer mix),
random bf16 weights, a batch of prompts decoded greedily through Engine.generate. The verify
runs get k random draft tokens per sequence and step, so each step verifies exactly k drafts
and (almost surely) accepts none: their time per step is the cost of verifying k drafts. A
random model does not copy its prompt, so real proposers would gain nothing here; what a
proposer gains elsewhere follows from these costs and its acceptance:
  speedup = (1 + accepted drafts per step) * t_decode_step / t_verify_step(k)
The dflash rows run a DFlash draft model (mimo_fn.speculative.dflash, random weights, --dflash-layers
layers of the draft's default width, block k + 1, reading target layers 1, 3 and 5 of the slice) instead
of random drafts: their time per step adds the draft's forward passes and its context work. The
mtp rows (with --drafters ... mtp) run one random MTP layer (mimo_fn.speculative.mtp) likewise.
"same" counts the sequences whose tokens equal the plain run's, and "first diff" gives the
earliest and the median position where one differs: in bf16 a verify step
(several tokens per sequence, the prefill kernels) and a decode step (one token) round
differently, so a near-tie in a random model's logits can go either way.

With --trained it measures what a trained DFlash draft buys instead (mimo_fn.bench.spec_trained):
it trains a draft of --dflash-layers layers, block --block-size, for the target
(mimo_fn.speculative.dflash_distill: self-distillation on --train-prompts random prompts of
--train-prompt-len tokens continued greedily by --train-new tokens) for --train-seconds at most,
or loads one from --draft-path (a draft trained before is saved there), prints the mean
acceptance length on held-out prompts before and after training, and then decodes --new tokens
after --prompt random held-out tokens at each batch size of --batches with and without the
draft (--groups G: G different groups of B prompts one after another, reported together; a batch
of one prompt alone is a noisy sample of the acceptance): decode tokens/s (the generate call less
a prefill-only one, best of --repeats), their ratio, the same end to end (prefill included), the
acceptance length (Engine.spec_stats()), how many sequences got plain decoding's tokens and
where the others first differ, side by side in
one table. --quiet-layers C divides the target's layer outputs by C (params.quiet_layers; the header
says so): a random target's greedy continuations are nearly chaotic, and a draft trained on them
learns nothing that carries to held-out prompts. At the released widths the layers' outputs dwarf
the token embeddings: it takes C of a few thousand before most greedy tokens follow from the
previous token alone (scripts/quiet_probe.py: 0% of them at C = 8, 87% at 2,048, 99% at 8,192).
--quantization fp8 draws the target's experts in FP8 (after quieting), which fits an 80 GB card.
--train-eval-every N measures the held-out acceptance every N steps too (the curve goes into the
JSON row). --draft-vocab N gives the draft the N most frequent tokens of its training continuations
as its vocabulary (mimo_fn.speculative.draft_vocab); --train-data-on-host keeps the data's hidden
states in pinned host memory (24 KB a token at the released dims: 8,192 sequences of 128 tokens take
26 GB, which an 80 GB card holds beside the FP8 slice, 16,384 do not); --train-data-batch N continues N
training prompts at once while making the data (256 by default). --train-long-prompts F makes
a share F of the training prompts as long as the decode runs' (--prompt): a draft that saw only
short contexts drafts worse after long ones (scripts/dflash_diag.py --long-prompts measures it; the
held-out acceptance printed while training stays at --train-prompt-len). --min-confidence P ... decodes
with the same draft under each confidence cut P too (mimo_fn.speculative.draft_cut: a request verifies
only the drafts the draft believes in, and the others read no experts), a row each. The held-out
acceptance grows with the number of training sequences more than with training time
(scripts/dflash_diag.py): the quieted target's continuations run into paths that other
continuations took, which a draft learns from enough of them. --train-total-seconds T bounds the
data and the training together (training gets what the data left of T). The GPU run (the slice,
CUDA graphs on) takes two calls on one machine, each under 10 minutes: data and training within
520 s, saved (batch 1 measured), then the draft loaded and measured at each batch and cut:

    B="python -m mimo_fn.bench spec --trained --quantization fp8 --quiet-layers 8192 --new 128 --groups 4 \
        --train-prompt-len 32 --train-new 96 --draft-vocab 32768 --draft-path /tmp/dflash-slice"
    $B --batches 1 --train-total-seconds 520 --train-prompts 16384 --train-long-prompts 0.0625 \
        --train-data-on-host --train-data-batch 1024
    $B --batches 1 8 32 --min-confidence 0.15 0.3

(the server serves the same target with --load-format dummy --quantization fp8 --dummy-quiet-layers 8192).

and its CPU smoke run (the tiny model, seconds):

    python -m mimo_fn.bench spec --trained --model tiny --device cpu --batches 1 2 --prompt 16 --new 12 \
        --train-prompts 16 --train-prompt-len 8 --train-new 24 --train-seconds 10 --train-batch 4 --train-anchors 4

Decode and verify steps replay CUDA graphs (mimo_fn.graphs) unless --eager. --temperature T
samples instead of decoding greedily (the host's sampling work then counts too); "same" is
then expected to be low, since speculation keeps each token's distribution, not its value.

The MoE kernels run at their default configs (options.moe_autotune off, whatever
MIMO_FN_MOE_AUTOTUNE says, unless --moe-autotune): a verify step's token count is a new autotune
size, and tuning it inside a timed run would be charged to the verify step.

    python -m mimo_fn.bench spec [--batch 8] [--prompt 512] [--new 64] [--draft 1 2 4 8] [--dflash-layers 2]
                                 [--drafters random dflash mtp]
                                 [--eager] [--temperature 1.0] [--moe-autotune]

--model tiny --device cpu runs either on the CPU (the tiny model, fp32).
"""

import random

import torch

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import add_model_args, model_name, model_setup
from mimo_fn.params import random_params
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.mtp import MTPProposer, init_mtp
from mimo_fn.speculative.train_dflash import default_target_layers

NEEDS_CUDA = False  # the slice needs one (--device cuda says so); --model tiny --device cpu runs here


class RandomDrafts:
    def __init__(self, vocab: int):
        self.vocab, self.rng = vocab, random.Random(0)

    def propose(self, rid, tokens, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]


def add_args(ap) -> None:
    ap.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    ap.add_argument("--draft", type=int, nargs="+", default=[1, 2, 4, 8], help="draft tokens k per step")
    ap.add_argument("--dflash-layers", type=int, default=2, help="layers of the DFlash draft model")
    ap.add_argument("--drafters", nargs="+", default=["random", "dflash"], choices=["random", "dflash", "mtp"],
                    help="draft sources timed (mtp: one random MTP layer)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (EngineConfig.cuda_graphs=False)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy); sampled runs compare distributions, not tokens")
    ap.add_argument("--moe-autotune", action="store_true",
                    help="autotune the MoE kernels at each new size (off: their default configs; see above)")
    add_model_args(ap)
    ap.add_argument("--trained", action="store_true",
                    help="measure a trained DFlash draft against plain decoding (see above) instead of verify costs")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="--trained: batch sizes decoded")
    ap.add_argument("--block-size", type=int, default=8, help="--trained: the draft's block (block_size - 1 drafts)")
    ap.add_argument("--draft-path", default=None,
                    help="--trained: load the draft from this directory if one is there, else save the trained one "
                         "there (default: none, train and keep nothing)")
    ap.add_argument("--train-seconds", type=float, default=240.0, help="--trained: training time budget")
    ap.add_argument("--train-total-seconds", type=float, default=None,
                    help="--trained: the budget of the data and the training together: training gets what the "
                         "data left of it (default: none, --train-seconds of training after the data)")
    ap.add_argument("--train-steps", type=int, default=100000, help="--trained: most training steps")
    ap.add_argument("--train-eval-every", type=int, default=0,
                    help="--trained: steps between acceptance measurements on held-out prompts while training "
                         "(default: 0, before the first step and after the last only)")
    ap.add_argument("--train-lr", type=float, default=1e-3, help="--trained: peak learning rate of the draft")
    ap.add_argument("--train-batch", type=int, default=32, help="--trained: sequences a training step")
    ap.add_argument("--train-anchors", type=int, default=16, help="--trained: blocks a sequence and training step")
    ap.add_argument("--train-prompts", type=int, default=8192, help="--trained: random training prompts")
    ap.add_argument("--train-prompt-len", type=int, default=32, help="--trained: tokens a training prompt")
    ap.add_argument("--train-new", type=int, default=96, help="--trained: greedy tokens the target adds to each")
    ap.add_argument("--train-long-prompts", type=float, default=0.0,
                    help="--trained: this share of the training prompts has --prompt tokens (the decode runs' length) "
                         "instead of --train-prompt-len: a draft trained on short contexts alone drafts worse after long "
                         "ones")
    ap.add_argument("--train-data-on-host", action="store_true",
                    help="--trained: keep the training data's hidden states in pinned host memory (24 KB a token at "
                         "the released dims), each step copying its batch over: for more data than the GPU holds")
    ap.add_argument("--train-data-batch", type=int, default=256,
                    help="--trained: sequences the target continues at once while making the training data "
                         "(dflash_distill.greedy_data's decode_batch)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="--trained: the draft scores only this many tokens, the most frequent of its training "
                         "continuations (mimo_fn.speculative.draft_vocab); 0: the whole vocabulary")
    ap.add_argument("--min-confidence", type=float, nargs="*", default=[],
                    help="--trained: also decode with the draft under each of these confidence cuts "
                         "(mimo_fn.speculative.draft_cut: drafts verified only while the draft's belief that all "
                         "are right stays >= P), beside the draft without one")
    ap.add_argument("--groups", type=int, default=1,
                    help="--trained: decode this many different groups of B prompts at each batch size B, one after "
                         "another, and report them together (a batch of 1 is one prompt: a noisy sample alone)")
    ap.add_argument("--repeats", type=int, default=2, help="--trained: timed generate calls per case (the best counts)")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="--trained: the target's weights in FP8, quantised after --quiet-layers (the weights the "
                         "server's --quantization fp8 --dummy-quiet-layers C draws; default: the model's dtype)")
    ap.add_argument("--quiet-layers", type=float, default=1.0,
                    help="--trained: divide the target's layer outputs by this (1: the random target as it is)")


def main(args, run) -> None:
    cfg, device, dtype = model_setup(args)
    with options.override(moe_autotune=args.moe_autotune):  # see the module docstring
        if args.quantization and not args.trained:
            raise SystemExit("--quantization: only with --trained")
        if args.trained:
            from mimo_fn.bench.spec_trained import run as run_trained

            # the server's --load-format dummy --random-seed 0 --quantization Q --dummy-quiet-layers C weights
            params = random_params(cfg, 0, dtype, device, quantize=args.quantization, quiet=args.quiet_layers)
            print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}, {dtype}, greedy, "
                  f"{'CUDA graphs' if device == 'cuda' and not args.eager else 'eager'}, "
                  f"{'FP8 experts, ' if args.quantization else ''}target layers divided by "
                  f"{args.quiet_layers}", flush=True)
            run_trained(args, run, cfg, params, device)
        else:
            _main(args, run, cfg, mf.init_params(cfg, seed=0, dtype=dtype, device=device), device)


def _main(args, run, cfg, params, device) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    max_tokens = args.batch * (args.prompt + args.new + 256)
    sampling = mf.SamplingParams(temperature=args.temperature, seed=0) if args.temperature > 0 else None

    def generate(k: int, proposer=None):
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, num_draft_tokens=k,
                                                        proposer=proposer or RandomDrafts(cfg.vocab_size),
                                                        cuda_graphs=not args.eager))
        engine.generate(prompts, args.new, sampling=sampling)  # warm-up: kernels compiled outside the timing
        seconds, outs = wall_s(lambda: engine.generate(prompts, args.new, sampling=sampling))
        return [o.tokens for o in outs], seconds, engine.spec_stats()

    print(f"{run.device}  torch {torch.__version__}  {model_name(cfg)}, {params.embed.dtype}, batch {args.batch}, "
          f"prompt {args.prompt}, {args.new} new tokens ({args.new - 1} decode steps), "
          f"{'eager' if args.eager else 'CUDA graphs'}, "
          f"{f'sampled at temperature {args.temperature}' if sampling else 'greedy'}")
    want, t_plain, _ = generate(0)
    step_plain = t_plain / (args.new - 1)
    rows = [{"drafts": "none", "k": 0, "ms_per_step": step_plain * 1e3, "vs_decode": 1.0,
             "same": f"{args.batch}/{args.batch}", "speedup_if_all_accepted": 1.0}]
    record(run, {"ms_per_step": step_plain * 1e3}, drafts="none", k=0)
    for name in args.drafters:
        for k in args.draft:
            proposer = None
            if name == "mtp":
                proposer = MTPProposer(init_mtp(cfg, 1, dtype=params.embed.dtype, device=device), params, cfg,
                                       cuda_graphs=not args.eager)
            if name == "dflash":
                dcfg = DFlashConfig(target_layers=default_target_layers(cfg.num_layers),
                                    mask_token_id=cfg.vocab_size - 1, block_size=k + 1, num_layers=args.dflash_layers)
                proposer = DFlashProposer(init_dflash(cfg, dcfg, dtype=params.embed.dtype, device=device), dcfg,
                                          params, cfg, cuda_graphs=not args.eager)
            got, t, st = generate(k, proposer)
            step = t / st["steps"]
            same = sum(g == w for g, w in zip(got, want))
            first = sorted(next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w))
                           for g, w in zip(got, want))
            res = {"ms_per_step": step * 1e3, "vs_decode": step / step_plain, "accepted": st["accepted"],
                   "drafted": st["drafted"], "same": same, "first_diff_min": first[0],
                   "first_diff_median": first[len(first) // 2], "speedup_if_all_accepted": (k + 1) * step_plain / step}
            record(run, res, drafts=name, k=k)
            rows.append({"drafts": name, "k": k, **res, "accepted": f"{st['accepted']}/{st['drafted']}",
                         "same": f"{same}/{args.batch}", "first_diff": f"{first[0]} / {first[len(first) // 2]}"})
            print(f"{name} k={k}: {step * 1e3:.2f} ms per step", flush=True)
    _, t_again, _ = generate(0)  # plain decoding once more: how far the machine drifted meanwhile
    record(run, {"ms_per_step": t_again / (args.new - 1) * 1e3, "vs_decode": t_again / t_plain},
           drafts="none, timed again last", k=0)
    rows.append({"drafts": "none again", "k": 0, "ms_per_step": t_again / (args.new - 1) * 1e3,
                 "vs_decode": t_again / t_plain})
    print_table(rows, [("drafts", "drafts", ""), ("k", "k", "d"), ("ms / step", "ms_per_step", ".2f"),
                       ("vs decode", "vs_decode", ".2f"), ("accepted", "accepted", ""), ("same", "same", ""),
                       ("first diff", "first_diff", ""), ("speedup if all accepted", "speedup_if_all_accepted", ".2f")])
