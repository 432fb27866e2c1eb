"""Time release / resume of GPU memory by tag (mimo_fn.rl.memory) and check what the driver gets back.

Stands in for an engine's tags with plain tensors: --weights-gib of bf16 matrices (256 MiB
each, the size of a few stacked expert weights) and --kv-gib of KV pages. For each mode it
prints the time of release and of resume, and how much free memory the driver reports
before, between and after (torch.cuda.mem_get_info):
  no backup     the weights' bytes are dropped (an RL step then rewrites them)
  backup        release copies them to pinned host memory first, resume copies them back
  backup again  the same, refilling the pinned buffers of the first backup

    python scripts/bench_rl_memory.py [--weights-gib 16] [--kv-gib 16]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mimo_fn.rl import memory  # noqa: E402

GIB = 1 << 30


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gib", type=int, default=16)
    ap.add_argument("--kv-gib", type=int, default=16)
    args = ap.parse_args()
    per = 256 << 20  # bytes per tensor
    weights = [torch.randn(per // 2 // 4096, 4096, device="cuda").bfloat16() for _ in range(args.weights_gib * 4)]
    kv = [torch.zeros(per // 2 // 1024, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(args.kv_gib * 4)]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  weights {args.weights_gib} GiB  "
          f"kv {args.kv_gib} GiB")
    print(f"{'mode':12} {'release s':>9} {'resume s':>9} {'free GiB: before':>17} {'released':>9} {'resumed':>8} "
          "restored")
    reuse = None
    for mode in ("no backup", "backup", "backup again"):
        backup = mode != "no backup"
        for w in weights:
            w.normal_()  # fresh values: a round without backup leaves garbage behind
        probe = [w[:4, :8].clone() for w in weights]  # a few values of each weight, to check a restore
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        (rw, rk), t_rel = _timed(lambda: (memory.release(weights, backup=backup, reuse=reuse), memory.release(kv)))
        reuse = rw.backups
        free1 = torch.cuda.mem_get_info()[0]
        _, t_res = _timed(lambda: (memory.resume(rw), memory.resume(rk)))
        free2 = torch.cuda.mem_get_info()[0]
        restored = all(torch.equal(w[:4, :8], p) for w, p in zip(weights, probe))
        print(f"{mode:12} {t_rel:9.3f} {t_res:9.3f} {free0 / GIB:17.1f} "
              f"{free1 / GIB:9.1f} {free2 / GIB:8.1f} {restored if backup else '-'}")
        if backup and not restored:
            raise SystemExit("backup: the weights did not come back")


if __name__ == "__main__":
    main()
