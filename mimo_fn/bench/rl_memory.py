"""Time release / resume of GPU memory by tag (mimo_fn.rl.memory) and check what the driver gets back.

Stands in for an engine's tags with plain tensors: --weights-gib of bf16 matrices (256 MiB
each, the size of a few stacked expert weights) and --kv-gib of KV pages. For each mode it
prints the time of release and of resume, and how much free memory the driver reports
before, between and after (torch.cuda.mem_get_info):
  no backup     the weights' bytes are dropped (an RL step then rewrites them)
  backup        release copies them to pinned host memory first, resume copies them back
  backup again  the same, refilling the pinned buffers of the first backup

    python -m mimo_fn.bench rl-memory [--weights-gib 16] [--kv-gib 16]
"""

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import wall_s
from mimo_fn.rl import memory

NEEDS_CUDA = True
GIB = 1 << 30


def add_args(ap) -> None:
    ap.add_argument("--weights-gib", type=int, default=16, help="GiB of weight-like tensors")
    ap.add_argument("--kv-gib", type=int, default=16, help="GiB of KV-page-like tensors")


def main(args, run) -> None:
    per = 256 << 20  # bytes per tensor
    weights = [torch.randn(per // 2 // 4096, 4096, device="cuda").bfloat16() for _ in range(args.weights_gib * 4)]
    kv = [torch.zeros(per // 2 // 1024, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(args.kv_gib * 4)]
    print(f"{run.device}  torch {torch.__version__}  weights {args.weights_gib} GiB  kv {args.kv_gib} GiB")
    reuse, rows = None, []
    for mode in ("no backup", "backup", "backup again"):
        backup = mode != "no backup"
        for w in weights:
            w.normal_()  # fresh values: a round without backup leaves garbage behind
        probe = [w[:4, :8].clone() for w in weights]  # a few values of each weight, to check a restore
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        t_rel, (rw, rk) = wall_s(lambda: (memory.release(weights, backup=backup, reuse=reuse), memory.release(kv)))
        reuse = rw.backups
        free1 = torch.cuda.mem_get_info()[0]
        t_res, _ = wall_s(lambda: (memory.resume(rw), memory.resume(rk)))
        free2 = torch.cuda.mem_get_info()[0]
        restored = all(torch.equal(w[:4, :8], p) for w, p in zip(weights, probe))
        res = {"release_s": t_rel, "resume_s": t_res, "free_before_gib": free0 / GIB, "free_released_gib": free1 / GIB,
               "free_resumed_gib": free2 / GIB, "restored": restored if backup else None}
        record(run, res, mode=mode)
        rows.append({"mode": mode, **res, "restored": restored if backup else "-"})
        if backup and not restored:
            raise SystemExit("rl-memory: backup: the weights did not come back")
    print_table(rows, [("mode", "mode", ""), ("release s", "release_s", ".3f"), ("resume s", "resume_s", ".3f"),
                       ("free GiB: before", "free_before_gib", ".1f"), ("released", "free_released_gib", ".1f"),
                       ("resumed", "free_resumed_gib", ".1f"), ("restored", "restored", "")])
