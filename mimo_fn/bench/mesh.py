"""Multi-GPU prefill sweep for one DP / TP / EP layout, in one process per rank.

For each weight format x attention-gather mode x routing x ISL: input tokens/s for all
GPUs and per GPU, MFU against the bf16 GEMM peak measured here, the share of device time
in NCCL kernels, and (real routing) the logits against the same weights on one GPU.
Last, the 48-layer extrapolation from per-layer-type times measured under the mesh.

    torchrun --nproc-per-node 8 -m mimo_fn.bench mesh --dp 2 --tp 4 --ep 8 \\
        --isl 16384 32768 65536 --chunk 32768
    torchrun --nproc-per-node 2 -m mimo_fn.bench mesh --dp 1 --tp 2 --ep 2 --model tiny --quant none --isl 64 --chunk 32

The chunk is global: each DP rank prefills chunk // dp tokens per pass (16K at DP2). Without a
GPU the ranks run on gloo (--model tiny), which checks the sweep, not the speed.
"""

import os
from dataclasses import replace

import torch
import torch.distributed as dist

import mimo_fn as mf
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import gemm_peaks, wall_s
from mimo_fn.bench.workload import chunked_prefill, flash_slice, sub_model
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.flops import prefill_flops
from mimo_fn.parallel.mesh import EP_DISPATCH_MODES, GATHER_MODES, init_mesh
from mimo_fn.parallel.sharding import shard_params
from mimo_fn.params import quantize_params

NEEDS_CUDA = False


def nccl_share(cfg, params, prompts, chunk, page_size, mesh) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        chunked_prefill(cfg, params, prompts, chunk, page_size, mesh)
    total = comm = 0.0
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0.0) or 0.0
        total += t
        comm += t if "nccl" in ev.key.lower() else 0.0
    return comm / max(total, 1.0)


def timed(cfg, params, prompts, chunk, page_size, mesh):
    chunked_prefill(cfg, params, prompts, chunk, page_size, mesh)  # warm-up at these shapes
    return wall_s(lambda: chunked_prefill(cfg, params, prompts, chunk, page_size, mesh), barrier=True)


def add_args(ap) -> None:
    ap.add_argument("--dp", type=int, required=True, help="data-parallel attention groups")
    ap.add_argument("--tp", type=int, required=True, help="attention tensor-parallel ranks per DP group")
    ap.add_argument("--ep", type=int, required=True, help="expert-parallel ranks")
    ap.add_argument("--isl", type=int, nargs="+", default=[16384, 32768, 65536], help="prompt lengths, one per DP group")
    ap.add_argument("--chunk", type=int, default=32768, help="global chunk, split across DP ranks")
    ap.add_argument("--quant", nargs="+", default=["fp8", "none"], choices=["fp8", "none"], help="weight formats")
    ap.add_argument("--gather", nargs="+", default=["packed_fp8", "fp8_two", "bf16"], choices=GATHER_MODES,
                    help="attention-input all-gathers (FP8 weights; bf16 weights gather bf16)")
    ap.add_argument("--routing", nargs="+", default=["real", "fake"], choices=["real", "fake"],
                    help="real routing, or the benchmark-only balanced uniform choice")
    ap.add_argument("--model", choices=["flash-slice", "tiny"], default="flash-slice", help="the model")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="KV page size (slots)")
    ap.add_argument("--no-check", action="store_true", help="skip the logits check against one GPU")
    ap.add_argument("--ep-dispatch", choices=EP_DISPATCH_MODES, default="gather", help="see mimo_fn.parallel.mesh.Mesh")


def main(args, run) -> None:
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("mesh: run under torchrun (torchrun --nproc-per-node N -m mimo_fn.bench mesh ...)")
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
    peak = gemm_peaks()["bf16_tflops"] if cuda else float("nan")
    rows = []

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
                        ref = chunked_prefill(cfg, full, prompts, chunk, args.page_size)
                        err = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    errs = [None] * world
                    dist.all_gather_object(errs, err)
                    tokens = isl * args.dp
                    tflops = prefill_flops(cfg, [isl]) * args.dp / dt / 1e12
                    row = dict(seconds=dt, tok_s=tokens / dt, tok_s_per_gpu=tokens / dt / world,
                               tflops_per_gpu=tflops / world, mfu_bf16_peak=tflops / world / peak,
                               nccl_share_rank0=share, logits_rel_err=max((e for e in errs if e == e), default=float("nan")))
                    record(run, row, quant=quant, gather=gather, routing=routing, isl=isl, world=world)
                    rows.append(dict(quant=quant, gather=gather, routing=routing, isl=isl, **row))
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
            ex = dict(t48_s=t48, tok_s_per_gpu=isl * args.dp / t48 / world,
                      formula=f"T48 = {t_dense:.3f} + 8*{t_two - t_dense:.4f} + 39*{(t_six - t_two) / 4:.4f}")
            record(run, ex, section="extrapolation", quant=quant, isl=isl, world=world)
            if rank == 0:
                print(f"[{quant}] {ex['formula']} = {t48:.3f} s -> "
                      f"{ex['tok_s_per_gpu']:,.0f} input tok/s per GPU at ISL {isl}", flush=True)
        del local, full
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        print_table(rows, [("quant", "quant", ""), ("gather", "gather", ""), ("routing", "routing", ""),
                           ("ISL", "isl", "d"), ("tok/s", "tok_s", ",.0f"), ("tok/s/GPU", "tok_s_per_gpu", ",.0f"),
                           ("MFU", "mfu_bf16_peak", ".1%"), ("NCCL", "nccl_share_rank0", ".0%"),
                           ("logits rel err", "logits_rel_err", ".2e")],
                    f"{world} ranks, dp={args.dp} tp={args.tp} ep={args.ep}, chunk {args.chunk}; bf16 peak {peak:.0f} TFLOP/s")
    dist.destroy_process_group()
