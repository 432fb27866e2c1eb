"""Multi-GPU prefill sweep for one DP / TP / EP layout, in one process per rank.

For each weight format x attention-gather mode x routing x ISL: input tokens/s for all
GPUs and per GPU, MFU against the bf16 GEMM peak measured here, the share of device time
in NCCL kernels, and (real routing) the logits against the same weights on one GPU.
Last, the 48-layer extrapolation from per-layer-type times measured under the mesh.

    torchrun --nproc-per-node 8 scripts/bench_mesh.py --dp 2 --tp 4 --ep 8 \\
        --isl 16384 32768 65536 --chunk 32768 --out $OUT

The chunk is global: each DP rank prefills chunk // dp tokens per pass (16K at DP2).
"""

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mimo_fn as mf  # noqa: E402
from bench_prefill import sub_model  # noqa: E402
from mimo_fn.cache import DEFAULT_PAGE_SIZE  # noqa: E402
from mimo_fn.flops import prefill_flops  # noqa: E402
from mimo_fn.parallel.mesh import EP_DISPATCH_MODES, init_mesh  # noqa: E402
from mimo_fn.parallel.sharding import shard_params  # noqa: E402
from mimo_fn.params import quantize_params  # noqa: E402
from prefill import bf16_peak_tflops, flash_slice, run  # noqa: E402


def nccl_share(cfg, params, prompts, chunk, page_size, mesh) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(cfg, params, prompts, chunk, page_size, mesh)
    total = comm = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) or 0.0
        total += t
        comm += t if "nccl" in ev.key.lower() else 0.0
    return comm / max(total, 1.0)


def timed(cfg, params, prompts, chunk, page_size, mesh):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    run(cfg, params, prompts, chunk, page_size, mesh)  # warm-up at these shapes
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    logits = run(cfg, params, prompts, chunk, page_size, mesh)
    sync()
    dist.barrier()
    return time.perf_counter() - t0, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--isl", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--chunk", type=int, default=32768, help="global chunk, split across DP ranks")
    ap.add_argument("--quant", nargs="+", default=["fp8", "none"], choices=["fp8", "none"])
    ap.add_argument("--gather", nargs="+", default=["packed_fp8", "fp8_two", "bf16"])
    ap.add_argument("--routing", nargs="+", default=["real", "fake"], choices=["real", "fake"])
    ap.add_argument("--model", choices=["flash-slice", "tiny"], default="flash-slice")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--ep-dispatch", choices=EP_DISPATCH_MODES, default="gather", help="see mimo_fn.parallel.mesh.Mesh")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_mesh(args.dp, args.tp, args.ep, ep_dispatch=args.ep_dispatch)
    cfg = flash_slice() if args.model == "flash-slice" else mf.ModelConfig.tiny()
    dtype = torch.bfloat16 if cuda else torch.float32
    chunk = args.chunk // args.dp
    peak = bf16_peak_tflops() if cuda else float("nan")
    rows, extrapolation = [], {}
    os.makedirs(args.out, exist_ok=True)

    for quant in args.quant:
        full = mf.init_params(cfg, seed=0, dtype=dtype, device=device)  # same seed: same weights everywhere
        local = shard_params(full, cfg, mesh)
        if quant == "fp8":
            local, full = quantize_params(cfg, local), quantize_params(cfg, full)
        if args.no_check or mesh.tp_rank != 0:
            full = None  # only a DP group's first rank checks; free the rest
        for gather in args.gather if quant == "fp8" else ["bf16"]:
            for routing in args.routing:
                m = replace(mesh, attn_gather=gather, fake_balanced_routing=routing == "fake")
                for isl in args.isl:
                    gen = torch.Generator().manual_seed(1000 * mesh.dp_rank + isl)
                    prompts = [torch.randint(0, cfg.vocab_size, (isl,), generator=gen)]
                    dt, logits = timed(cfg, local, prompts, chunk, args.page_size, m)
                    share = nccl_share(cfg, local, prompts, chunk, args.page_size, m) if cuda else float("nan")
                    err = float("nan")
                    if full is not None and routing == "real":
                        ref = run(cfg, full, prompts, chunk, args.page_size)
                        err = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    errs = [None] * world
                    dist.all_gather_object(errs, err)
                    tokens = isl * args.dp
                    tflops = prefill_flops(cfg, [isl]) * args.dp / dt / 1e12
                    row = dict(quant=quant, gather=gather, routing=routing, isl=isl, seconds=dt, tok_s=tokens / dt,
                               tok_s_per_gpu=tokens / dt / world, tflops_per_gpu=tflops / world,
                               mfu_bf16_peak=tflops / world / peak, nccl_share_rank0=share,
                               logits_rel_err=max((e for e in errs if e == e), default=float("nan")))
                    rows.append(row)
                    if rank == 0:
                        print(f"{quant:4} {gather:10} {routing:4} ISL {isl:6}: {row['tok_s']:,.0f} tok/s "
                              f"({row['tok_s_per_gpu']:,.0f}/GPU), MFU {row['mfu_bf16_peak']:.1%}, NCCL "
                              f"{share:.0%}, logits rel err {row['logits_rel_err']:.2e}", flush=True)
        # 48 layers from per-layer-type times under this mesh, at the longest ISL, real routing
        isl = max(args.isl)
        prompts = [torch.randint(0, cfg.vocab_size, (isl,), generator=torch.Generator().manual_seed(7 + mesh.dp_rank))]
        m = replace(mesh, attn_gather=args.gather[0] if quant == "fp8" else "bf16")
        if args.model == "flash-slice":
            t_dense = timed(*sub_model(cfg, local, [0]), prompts, chunk, args.page_size, m)[0]
            t_two = timed(*sub_model(cfg, local, [0, 5]), prompts, chunk, args.page_size, m)[0]
            t_six = timed(cfg, local, prompts, chunk, args.page_size, m)[0]
            t48 = t_dense + 8 * (t_two - t_dense) + 39 * (t_six - t_two) / 4
            extrapolation[quant] = dict(isl=isl, t48_s=t48, tok_s_per_gpu=isl * args.dp / t48 / world,
                                        formula=f"T48 = {t_dense:.3f} + 8*{t_two - t_dense:.4f} + 39*{(t_six - t_two) / 4:.4f}")
            if rank == 0:
                print(f"[{quant}] {extrapolation[quant]['formula']} = {t48:.3f} s -> "
                      f"{extrapolation[quant]['tok_s_per_gpu']:,.0f} input tok/s per GPU at ISL {isl}", flush=True)
        del local, full
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(args.out, "bench_mesh.json"), "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), world=world, dp=args.dp, tp=args.tp, ep=args.ep,
                           chunk=args.chunk, peak_bf16_tflops=peak, rows=rows, extrapolation=extrapolation), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
