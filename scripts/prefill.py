"""Prefill a few prompts and print tokens/s and each prompt's next-token argmax.

With no arguments it runs on the CPU on an embedded default: a tiny random-weight
MiMo-V2-Flash, written as a real hub-layout checkpoint to a cache directory and loaded
back through load_checkpoint. Point --checkpoint at a real model directory for real use.
Under torchrun it runs DP attention / attention TP / EP (gloo on the CPU, NCCL on GPUs):
each DP group prefills its own prompts, and --check compares every sequence's logits
with the same weights on one rank. Before anything loads, each rank's memory plan (weights,
KV cache, prefill activations; mimo_fn.memory_plan) is checked against the GPU's free memory.

    python scripts/prefill.py
    python scripts/prefill.py --checkpoint /models/MiMo-V2-Flash --device cuda --dtype bfloat16
    torchrun --nproc-per-node 8 scripts/prefill.py --dp 2 --tp 4 --ep 8 --model flash-slice \\
        --quant fp8 --attn-gather packed_fp8 --isl 32768 --prompts 1 --chunk 16384 --check --profile
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.bench.cli import HelpFormatter
from mimo_fn.bench.timing import gemm_peaks
from mimo_fn.bench.workload import chunked_prefill, flash_slice, pool_tokens
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.flops import prefill_flops
from mimo_fn.memory_plan import plan_memory, weight_bytes_per_rank
from mimo_fn.parallel.mesh import EP_DISPATCH_MODES, GATHER_MODES, Mesh, init_mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "mimo_fn", "tiny-random")


def default_checkpoint() -> str:
    if not os.path.exists(os.path.join(DEFAULT_DIR, "config.json")):
        cfg = mf.ModelConfig.tiny()
        mf.save_checkpoint(mf.init_params(cfg, seed=0), cfg, DEFAULT_DIR)
        print(f"wrote a tiny random checkpoint to {DEFAULT_DIR}")
    return DEFAULT_DIR


def load(args, mesh, device, dtype):
    """(cfg, this rank's params, full params or None): from a checkpoint, or random weights."""
    if args.model == "checkpoint":
        path = args.checkpoint or default_checkpoint()
        quant = "fp8" if args.quant == "fp8" else "auto"
        cfg, local = mf.load_checkpoint(path, dtype=dtype, device=device, mesh=mesh, quant=quant)
        full = mf.load_checkpoint(path, dtype=dtype, device=device, quant=quant)[1] if args.check else None
        if args.quant == "mxfp4":  # bf16 / FP8 experts of a checkpoint as MXFP4 (MXFP4 ones stay)
            local = quantize_params(cfg, local, experts="mxfp4")
            full = quantize_params(cfg, full, experts="mxfp4") if args.check else None
        return cfg, local, full
    cfg = model_config(args)
    full = mf.init_params(cfg, seed=args.seed, dtype=dtype, device=device)  # same seed: same weights on every rank
    local = shard_params(full, cfg, mesh)
    if args.quant != "none":  # quantise after sharding: each rank's blocks tile its own shard
        experts = "mxfp4" if args.quant == "mxfp4" else "fp8"
        local = quantize_params(cfg, local, experts=experts)
        full = quantize_params(cfg, full, experts=experts) if args.check else None
    elif not args.check:
        full = None
    return cfg, local, full


def model_config(args) -> mf.ModelConfig:
    if args.model == "checkpoint":
        return mf.ModelConfig.from_hf(args.checkpoint or default_checkpoint())
    return mf.ModelConfig.tiny() if args.model == "tiny" else flash_slice()


def stored_format(args) -> str:
    """The weight format the plan counts: --quant, else what the checkpoint stores (FP8 by its
    config's quantization_config, MXFP4 experts by a `weight_scale` tensor in its index)."""
    if args.quant != "none" or args.model != "checkpoint":
        return args.quant
    path = args.checkpoint or default_checkpoint()
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config") or {}
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = list(json.load(f)["weight_map"])
    else:  # one file: its header names the tensors
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
    if any(k.endswith("_proj.weight_scale") for k in names) or qc.get("quant_method") == "mxfp4":
        return "mxfp4"
    return "fp8" if qc.get("quant_method") == "fp8" else "none"


def profile(args, cfg, params, prompts, mesh, dt, tokens, world, rank) -> None:
    """MFU of the timed run, and the share of one profiled run's device time spent in NCCL."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    flops = prefill_flops(cfg, [args.isl] * args.prompts) * args.dp
    peak = gemm_peaks()["bf16_tflops"]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        chunked_prefill(cfg, params, prompts, args.chunk, args.page_size, mesh)
    total = comm = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) or 0.0
        total += t
        comm += t if "nccl" in ev.key.lower() else 0.0
    if rank == 0:
        achieved = flops / dt / 1e12
        print(f"achieved {achieved:,.0f} TFLOP/s on {world} GPU(s) = {achieved / world:,.0f} per GPU, "
              f"MFU {achieved / world / peak:.1%} of the bf16 GEMM peak measured now ({peak:,.0f} TFLOP/s); "
              f"rank 0 device time in collectives: {comm / 1e3:.1f} of {total / 1e3:.1f} ms ({comm / max(total, 1):.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--checkpoint", help="hub-layout checkpoint directory (default: a tiny random model written to "
                                         f"{DEFAULT_DIR})")
    ap.add_argument("--model", choices=["checkpoint", "tiny", "flash-slice"], default="checkpoint",
                    help="'tiny' / 'flash-slice': random weights of that config instead of a checkpoint")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to run (CUDA where torch sees a GPU)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="activation and weight dtype (None: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--quant", choices=["none", "fp8", "mxfp4"], default="none",
                    help="fp8: 128x128 block FP8 GEMM weights; mxfp4: MXFP4 routed experts, FP8 the other GEMM "
                         "weights (the RL release's format)")
    ap.add_argument("--prompts", type=int, default=4, help="random prompts per DP group")
    ap.add_argument("--isl", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk per sequence (per DP rank)")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="KV page size (slots)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel attention groups (under torchrun)")
    ap.add_argument("--tp", type=int, default=1, help="attention tensor-parallel ranks per DP group")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")
    ap.add_argument("--attn-gather", choices=GATHER_MODES, default="bf16",
                    help="how a TP group all-gathers the attention input (packed_fp8: one FP8 packet)")
    ap.add_argument("--ep-dispatch", choices=EP_DISPATCH_MODES, default="gather", help="see mimo_fn.parallel.mesh.Mesh")
    ap.add_argument("--fake-routing", action="store_true", help="benchmark only: balanced uniform expert choice")
    ap.add_argument("--check", action="store_true", help="compare logits with the same weights on one rank")
    ap.add_argument("--profile", action="store_true",
                    help="CUDA: MFU against a bf16 GEMM peak measured now, and the time in collectives")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("prefill.py --device cuda: needs a CUDA GPU (none is visible to torch); --device cpu runs "
                         "on the CPU")
    if args.checkpoint:
        args.model = "checkpoint"

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = args.device.startswith("cuda")
    if world > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_mesh(args.dp, args.tp, args.ep, fake_balanced_routing=args.fake_routing, attn_gather=args.attn_gather,
                     ep_dispatch=args.ep_dispatch)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))

    # the memory plan, before anything loads: (prompts x isl) tokens in the cache, one step of
    # min(chunk, isl) tokens from each prompt, and with --check the whole model's reference copy
    cfg, fmt = model_config(args), stored_format(args)
    reference = weight_bytes_per_rank(cfg, Mesh.single(), dtype, fmt) if args.check else 0
    plan = plan_memory(cfg, mesh, dtype, fmt, pool_tokens([args.isl] * args.prompts, args.page_size), args.page_size,
                       args.prompts * min(args.chunk, args.isl), torch.cuda.mem_get_info(device)[0] if cuda else None,
                       extra_weights=reference)
    if rank == 0:
        print(f"memory plan {plan.summary()}")
    try:
        plan.check()
    except ValueError as e:
        raise SystemExit(f"prefill.py (rank {rank}): {e}") from None

    t0 = time.perf_counter()
    cfg, params, full = load(args, mesh, device, dtype)
    if rank == 0:
        print(f"loaded in {time.perf_counter() - t0:.2f}s: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
              f"{cfg.num_experts} experts; rank 0 holds {mf.params.weight_bytes(params) / 2**30:.2f} GiB "
              f"(dp={args.dp} tp={args.tp} ep={args.ep}, {args.quant}, gather {args.attn_gather}, "
              f"EP dispatch {args.ep_dispatch})")

    gen = torch.Generator().manual_seed(args.seed + 1000 * mesh.dp_rank)  # each DP group its own prompts
    prompts = [torch.randint(0, cfg.vocab_size, (args.isl,), generator=gen) for _ in range(args.prompts)]
    chunked_prefill(cfg, params, prompts, args.chunk, args.page_size, mesh)  # warm-up: compiles and tunes kernels
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:  # the timed run's peak (weights, its cache, its temporaries) against the plan
        torch.cuda.reset_peak_memory_stats(device)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    logits = chunked_prefill(cfg, params, prompts, args.chunk, args.page_size, mesh)
    sync()
    if world > 1:
        dist.barrier()
    dt = time.perf_counter() - t0
    tokens = args.prompts * args.isl * args.dp
    if rank == 0:
        print(f"prefill: {args.dp} DP group(s) x {args.prompts} x {args.isl} tokens in {dt * 1e3:.1f} ms = "
              f"{tokens / dt:,.0f} tok/s ({tokens / dt / max(world, 1):,.0f} per rank)")
        if cuda:
            print(f"rank 0 peak memory allocated {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB "
                  f"(planned {plan.total / 2**30:.2f})")
    if mesh.tp_rank == 0:
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            print(f"dp group {mesh.dp_rank} prompt {i}: next-token argmax {tok}")
    if args.profile and cuda:
        profile(args, cfg, params, prompts, mesh, dt, tokens, world, rank)
    if args.check and mesh.tp_rank == 0:
        ref = chunked_prefill(cfg, full, prompts, args.chunk, args.page_size)
        err = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"dp group {mesh.dp_rank}: logits vs one rank, relative error {err:.2e}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
