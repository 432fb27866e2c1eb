"""moe_align's four kernels timed one by one under launch-shape variants, on one GPU.

Top-8 of 256 experts, balanced routing, 128-row blocks (what the MoE layer runs at prefill).
A variant is (CHUNK pairs per count/scatter program, count warps, scan warps, scan chunks per
step, scan experts per program, scatter warps); the first row is what `moe_align` launches.
Each variant's layout is checked against `moe_align` before it is timed.

    python -m mimo_fn.bench moe-align [--tokens 16384 65536]

Prints us per kernel (memset of the count table, count, scan, blocks, scatter) and for all
five back to back (mimo_fn.bench.timing.time_ms: do_bench, median).
"""

import torch
import triton

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.moe import align as ma

NEEDS_CUDA = True

E, K, BLOCK_M = 256, 8, 128
DEV = "cuda"
VARIANTS = [  # (chunk, count warps, scan warps, scan chunks a step, scan experts a program, scatter warps)
    (128, 2, 4, 512, 4, 4),  # moe_align's launch
    (128, 8, 4, 64, 32, 4),  # its launch before
    (128, 4, 4, 512, 4, 4),
    (64, 2, 4, 512, 4, 4),
    (128, 2, 4, 256, 8, 4),
    (128, 2, 4, 512, 4, 2),
]


def launches(ids_TK: torch.Tensor, chunk: int, cw: int, sw: int, bc: int, be: int, tw: int):
    """The alignment's five steps as closures over fresh buffers, and the (sorted_ids, blocks,
    used slots) they fill."""
    dev = ids_TK.device
    ids_P = ids_TK.reshape(-1)
    P = ids_P.numel()
    nb = triton.cdiv(ma.max_padded_slots(P, E, BLOCK_M), BLOCK_M)
    sorted_ids_M = torch.empty(nb * BLOCK_M, dtype=torch.int32, device=dev)
    block_e_NB = torch.empty(nb, dtype=torch.int32, device=dev)
    used_1 = torch.zeros(1, dtype=torch.int32, device=dev)
    C = triton.cdiv(P, chunk)
    counts_CE = torch.zeros(C, E, dtype=torch.int32, device=dev)
    off_CE = torch.empty_like(counts_CE)
    rank_P = torch.empty(P, dtype=torch.int32, device=dev)
    total_E, start_E = (torch.empty(E, dtype=torch.int32, device=dev) for _ in range(2))
    bb = max(1, min(32, 4096 // triton.next_power_of_2(E)))
    steps = {
        "memset": lambda: counts_CE.zero_(),
        "count": lambda: ma._moe_align_count_kernel[(C,)](ids_P, rank_P, counts_CE, P, E, CHUNK=chunk, num_warps=cw),
        "scan": lambda: ma._moe_align_scan_kernel[(triton.cdiv(E, be),)](
            counts_CE, off_CE, total_E, C, E, BLOCK_C=bc, BLOCK_E=be, num_warps=sw),
        "blocks": lambda: ma._moe_align_blocks_kernel[(triton.cdiv(nb, bb),)](
            total_E, start_E, sorted_ids_M, block_e_NB, used_1, P, E, nb,
            BLOCK_M=BLOCK_M, BLOCK_E=triton.next_power_of_2(E), BLOCK_B=bb, num_warps=4),
        "scatter": lambda: ma._moe_align_scatter_kernel[(C,)](
            ids_P, rank_P, off_CE, start_E, sorted_ids_M, P, E, CHUNK=chunk, num_warps=tw),
    }
    return steps, (sorted_ids_M, block_e_NB, used_1)


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="token counts T")


STEPS = ("memset", "count", "scan", "blocks", "scatter")


def main(args, run) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for t in args.tokens:
        ids_TK = torch.rand(t, E, device=DEV, generator=gen).topk(K, dim=1).indices.int()
        ref = ma.moe_align(ids_TK, E, BLOCK_M)
        used = int(ref.num_tokens_post_pad_1)
        print(f"T={t}  us: memset count scan blocks scatter | all    variant (chunk cw sw bc be tw)")
        for v in VARIANTS:
            steps, (sorted_ids_M, block_e_NB, used_1) = launches(ids_TK, *v)
            for step in steps.values():
                step()
            # slots past the used ones are never written (by moe_align either)
            same = (int(used_1) == used and torch.equal(sorted_ids_M[:used], ref.sorted_ids_M[:used])
                    and torch.equal(block_e_NB, ref.expert_of_block_NB))
            if not same:
                raise SystemExit(f"variant {v}: layout differs from moe_align's")
            times = [time_ms(f, warmup_ms=20, rep_ms=100) * 1e3 for f in steps.values()]
            every = time_ms(lambda: [f() for f in steps.values()], warmup_ms=20, rep_ms=100) * 1e3
            res = {f"{name}_us": x for name, x in zip(STEPS, times)} | {"all_us": every}
            record(run, res, tokens=t, variant=list(v))
            rows.append({"tokens": t, "variant": " ".join(map(str, v)), **res})
            print("  " + " ".join(f"{x:7.1f}" for x in times) + f" | {every:7.1f}    {v}", flush=True)
    print_table(rows, [("tokens", "tokens", "d"), ("chunk cw sw bc be tw", "variant", "")]
                + [(f"{s} us", f"{s}_us", ".1f") for s in STEPS] + [("all us", "all_us", ".1f")])
