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

    python scripts/bench_rl_step.py [--batch 64] [--prompt 512] [--min-new 8] [--max-new 128] [--memory-saver]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import mimo_fn as mf  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--memory-saver", action="store_true", help="keep addresses (torch_memory_saver)")
    args = ap.parse_args()
    cfg = mf.ModelConfig.flash(num_layers=6)
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

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  6-layer slice, bf16, {args.batch} prompts x "
          f"{args.prompt} tokens, {args.min_new}-{args.max_new} new (sum {sum(limits)}), "
          f"memory_saver={args.memory_saver} (Engine init {init_s:.2f} s)")
    rollout()  # kernels compiled and tuned, graphs captured
    warm_s, want = timed(rollout)
    graphs, captures = len(engine.graphs), engine.graphs.stats["captures"]
    free_s = torch.cuda.mem_get_info()[0]
    release_s, freed = timed(lambda: engine.release_memory(tags, backup=True))
    torch.cuda.empty_cache()
    gained = torch.cuda.mem_get_info()[0] - free_s
    resume_s, _ = timed(engine.resume_memory)
    cold_s, cold = timed(rollout)
    again_s, again = timed(rollout)
    print(f"graphs per rollout {graphs} (captured after resume: {engine.graphs.stats['captures'] - captures})")
    print(f"release {release_s:.3f} s ({freed / 2**30:.1f} GiB, backup; the driver's free memory grew "
          f"{gained / 2**30:.1f} GiB)  resume {resume_s:.3f} s")
    print(f"generate: warm {warm_s:.3f} s  after resume {cold_s:.3f} s  warm again {again_s:.3f} s  "
          f"-> recapture {cold_s - min(warm_s, again_s):.3f} s per RL step")
    print(f"same tokens: after resume {cold == want}, warm again {again == want}")


if __name__ == "__main__":
    main()
