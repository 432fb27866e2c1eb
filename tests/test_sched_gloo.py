"""The delayer's collective on gloo processes at DP 2 and 4, against the simulator.

Each process drives one rank with schedule_pass and dist_gather (one all_gather per
pass); the parent checks that every rank saw the same decisions and that each rank's
pass-by-pass trace equals the single-process lockstep simulation.
"""

import pickle
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from mimo_fn.sched import SchedulerConfig, dist_gather
from mimo_fn.sched.simulate import Arrival, run_rank, simulate

NUM_PASSES = 48


def scenario(dp: int) -> tuple[SchedulerConfig, list[Arrival]]:
    cfg = SchedulerConfig(
        num_pages=512, page_size=16, dp_size=dp, chunk_size=1024 * dp, max_delay_passes=3, max_running_requests=6
    )
    arrivals = [
        Arrival(0, 0, 0, 100, 6),  # pass 0: only rank 0 has work -> mixed, delayed, timeout
        Arrival(4, 0, 1, 3000, 4),  # a chunked prefill on rank 0 -> "chunk"
        *[Arrival(12, r, 10 + r, 50 + r, 20) for r in range(dp)],  # all ranks at once -> "all"
        *[Arrival(12, r, 20 + r, 60, 20) for r in range(dp)],
        *[Arrival(15, r, 30 + r, 40, 3) for r in range(dp)],  # small batches while busy -> "fuller"
        Arrival(30, dp - 1, 40, 7000, 2),  # the last rank alone, 7 chunks: mixed, then chunk
    ]
    return cfg, arrivals


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, dp: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=dp)
    try:
        cfg, arrivals = scenario(dp)
        trace = run_rank(cfg, arrivals, rank, dist_gather(dist.group.WORLD), NUM_PASSES)
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as f:
            pickle.dump(trace, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dp", [2, 4])
def test_gloo_negotiation_matches_simulation(dp, tmp_path):
    mp.spawn(_worker, args=(dp, _free_port(), str(tmp_path)), nprocs=dp, join=True)
    traces = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(dp)]
    cfg, arrivals = scenario(dp)
    sim = simulate(cfg, arrivals, NUM_PASSES, stop_when_idle=False)
    for p in range(NUM_PASSES):
        assert len({traces[r][p].plan.decision for r in range(dp)}) == 1, p
        for r in range(dp):
            assert traces[r][p].num_negotiations == 1
            assert traces[r][p] == sim[p][r], (p, r)
    reasons = {sim[p][0].plan.decision.reason for p in range(NUM_PASSES)}
    assert {"mixed", "timeout", "chunk", "all", "fuller", "none"} <= reasons, reasons
    assert all(any(rp.finished for rp in (sim[p][r] for p in range(NUM_PASSES))) for r in range(dp))
