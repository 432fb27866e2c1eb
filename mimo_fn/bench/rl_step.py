"""What a colocated RL step costs the rollout engine around memory release, on one GPU.

The 6-layer slice of MiMo-V2-Flash at the released dims (`ModelConfig.flash(num_layers=6)`),
random bf16 weights, CUDA graphs and overlap on. --batch prompts of --prompt tokens, each with
its own max_new_tokens drawn from [--min-new, --max-new], so the batch shrinks through the
graph buckets as requests finish (as an RL rollout's does). Timed, each `generate` on the same
prompts and seeds:
  warm            graphs already captured (the second call)
  after resume    release_memory(backup=True) then resume_memory(): resumed memory may sit at
                  new addresses, so the engine dropped its decode graphs and captures each
                  bucket again on first use (mimo_fn.rl.memory explains why)
  warm again      the call after that
and the release and resume themselves, and the graphs captured. With --memory-saver the engine
keeps the addresses across the release (EngineConfig.memory_saver: CUDA virtual memory through
torch_memory_saver, mimo_fn.rl.vmm) and releases "weights" and "kv_cache" only, so its graphs
stay and "after resume" replays them.

    python -m mimo_fn.bench rl-step [--batch 64] [--prompt 512] [--min-new 8] [--max-new 128] [--memory-saver]
"""

import time

import torch

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.bench.workload import flash_slice

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--batch", type=int, default=64, help="prompts per rollout")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--min-new", type=int, default=8, help="fewest new tokens a request may draw")
    ap.add_argument("--max-new", type=int, default=128, help="most new tokens a request may draw")
    ap.add_argument("--memory-saver", action="store_true", help="keep addresses (torch_memory_saver)")


def main(args, run) -> None:
    cfg = flash_slice()
    params = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    limits = torch.randint(args.min_new, args.max_new + 1, (args.batch,), generator=gen).tolist()
    sampling = mf.SamplingParams(temperature=1.0, seed=1)
    t0 = time.perf_counter()
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=args.batch * (args.prompt + args.max_new + 256),
                                                    memory_saver=args.memory_saver))
    init_s = time.perf_counter() - t0
    tags = ["weights", "kv_cache"] if args.memory_saver else None  # the saver keeps the graphs valid

    def rollout():
        return [o.tokens for o in engine.generate(prompts, max_new_tokens=limits, sampling=sampling)]

    print(f"{run.device}  torch {torch.__version__}  6-layer slice, bf16, {args.batch} prompts x "
          f"{args.prompt} tokens, {args.min_new}-{args.max_new} new (sum {sum(limits)}), "
          f"memory_saver={args.memory_saver} (Engine init {init_s:.2f} s)")
    rollout()  # kernels compiled and tuned, graphs captured
    warm_s, want = wall_s(rollout)
    graphs, captures = len(engine.graphs), engine.graphs.stats["captures"]
    free_s = torch.cuda.mem_get_info()[0]
    release_s, freed = wall_s(lambda: engine.release_memory(tags, backup=True))
    torch.cuda.empty_cache()
    gained = torch.cuda.mem_get_info()[0] - free_s
    resume_s, _ = wall_s(engine.resume_memory)
    cold_s, cold = wall_s(rollout)
    again_s, again = wall_s(rollout)
    res = {"warm_s": warm_s, "after_resume_s": cold_s, "warm_again_s": again_s,
           "recapture_s": cold_s - min(warm_s, again_s), "release_s": release_s, "resume_s": resume_s,
           "released_gib": freed / 2**30, "driver_gained_gib": gained / 2**30, "graphs": graphs,
           "captured_after_resume": engine.graphs.stats["captures"] - captures,
           "same_after_resume": cold == want, "same_warm_again": again == want}
    record(run, res)
    print(f"graphs per rollout {graphs} (captured after resume: {res['captured_after_resume']}); release "
          f"{freed / 2**30:.1f} GiB, backup; the driver's free memory grew {gained / 2**30:.1f} GiB")
    print(f"same tokens: after resume {cold == want}, warm again {again == want}")
    print_table([res], [("warm s", "warm_s", ".3f"), ("after resume s", "after_resume_s", ".3f"),
                        ("warm again s", "warm_again_s", ".3f"), ("recapture s", "recapture_s", ".3f"),
                        ("release s", "release_s", ".3f"), ("resume s", "resume_s", ".3f")],
                "generate around release_memory / resume_memory")
