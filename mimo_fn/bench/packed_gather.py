"""Packed FP8 all-gather vs two FP8 collectives vs a bf16 all-gather, on NCCL.

Legend: W ranks, T tokens per rank, H hidden, G = ceil(H / 128), R = H + 4G packet bytes.

    torchrun --nproc-per-node 2 -m mimo_fn.bench packed-gather [--tokens 4096 8192 16384 32768]

Each variant is timed end to end as the model would call it (quantise, gather, unpack,
scale transpose) and the gather alone: the median of 20 calls between CUDA events, each after a
barrier (timing.time_ms(iters=20, barrier=True)). Before timing it checks, on every rank, that the
packed and two-collective results are identical bytes and equal the reference
quantisation of the bf16-gathered activations.
"""

import os

import torch
import torch.distributed as dist

from mimo_fn.bench.results import record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.fp8_quant import packet_bytes_per_row, quant_fp8_into_packet
from mimo_fn.parallel.packed_fp8 import (
    _gather_rows,
    all_gather_bf16,
    all_gather_fp8_two_collectives,
    all_gather_packed_fp8,
)
from mimo_fn.quant import quantize_fp8_act_ref

NEEDS_CUDA = True
HIDDEN = 4096


def _time_ms(fn) -> float:
    return time_ms(fn, iters=20, warmup_iters=3, barrier=True)


def _check(x_TH: torch.Tensor) -> None:
    q, s = all_gather_packed_fp8(x_TH)
    q2, s2 = all_gather_fp8_two_collectives(x_TH)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), "packed q != two-collective q"
    assert torch.equal(s.view(torch.int32), s2.view(torch.int32)), "packed scales != two-collective scales"
    q_ref, s_ref = quantize_fp8_act_ref(all_gather_bf16(x_TH))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "packed q != reference quantisation"
    assert torch.equal(s, s_ref), "packed scales != reference quantisation"


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768], help="tokens per rank T")


def main(args, run) -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rows = []
    for t in args.tokens:
        g = torch.Generator(device="cuda").manual_seed(rank * 7919 + t)
        x_TH = torch.randn(t, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        x_TH[rank, :128] = 0.0  # an all-zero group
        _check(x_TH)
        r = packet_bytes_per_row(HIDDEN)
        packet = quant_fp8_into_packet(x_TH, torch.empty(t, r, dtype=torch.uint8, device="cuda"))
        q_bytes = torch.empty(t, HIDDEN, dtype=torch.uint8, device="cuda")
        s_TG = torch.empty(t, HIDDEN // 128, device="cuda")
        row = dict(
            T=t, H=HIDDEN, W=world,
            packed_ms=_time_ms(lambda: all_gather_packed_fp8(x_TH)),
            two_ms=_time_ms(lambda: all_gather_fp8_two_collectives(x_TH)),
            bf16_ms=_time_ms(lambda: all_gather_bf16(x_TH)),
            packed_gather_only_ms=_time_ms(lambda: _gather_rows(packet, None)),
            two_gathers_only_ms=_time_ms(lambda: (_gather_rows(q_bytes, None), _gather_rows(s_TG, None))),
            packed_bytes_per_rank=t * r,
            two_bytes_per_rank=t * HIDDEN + t * (HIDDEN // 128) * 4,
            bf16_bytes_per_rank=t * HIDDEN * 2,
        )
        rows.append(row)
        record(run, {k: v for k, v in row.items() if k not in ("T", "H", "W")}, T=t, H=HIDDEN, W=world)
        if rank == 0:
            print(row, flush=True)
        del x_TH, packet, q_bytes, s_TG
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        print("checked: packed == two collectives == reference quantisation of the bf16 gather, bitwise, all sizes")
        print(f"\n{run.device}  torch {torch.__version__}  nccl {nccl}  (ms, median of 20)")
        print(f"{'T/rank':>7} | {'packed':>7} {'two':>7} {'bf16':>7} | gather only: {'packed':>7} {'two':>7}"
              f" | MB/rank: {'packed':>7} {'two':>7} {'bf16':>7}")
        for r in rows:
            print(f"{r['T']:7d} | {r['packed_ms']:7.3f} {r['two_ms']:7.3f} {r['bf16_ms']:7.3f} |"
                  f"              {r['packed_gather_only_ms']:7.3f} {r['two_gathers_only_ms']:7.3f} |"
                  f"          {r['packed_bytes_per_rank'] / 1e6:7.1f} {r['two_bytes_per_rank'] / 1e6:7.1f}"
                  f" {r['bf16_bytes_per_rank'] / 1e6:7.1f}")
    dist.destroy_process_group()
