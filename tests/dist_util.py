"""Run a test body on N gloo CPU processes and surface any rank's failure in the parent."""

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.setdefault("MIMO_FN_TYPECHECK", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        msg = "ok"
    except BaseException:  # report, then let the parent fail the test with the traceback
        msg = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(msg)


def run_ranks(world: int, fn, *args, tmp_dir: str) -> None:
    """fn(rank, world, *args) on `world` processes; raises with the first failing rank's traceback."""
    mp.spawn(_entry, args=(world, free_port(), tmp_dir, fn, args), nprocs=world, join=True)
    failures = []
    for r in range(world):
        with open(os.path.join(tmp_dir, f"rank{r}.txt")) as f:
            msg = f.read()
        if msg != "ok":
            failures.append(f"rank {r} failed:\n{msg}")
    if failures:  # the root cause first: a crashed rank's peers fail with "connection closed"
        failures.sort(key=lambda m: "Connection closed" in m)
        raise AssertionError("\n".join(failures))
