"""A deterministic lockstep simulator of DP ranks with a fake model (tests, benchmarks).

Legend: R = DP ranks; lengths in tokens; a "pass" is one forward step of the group.

Each pass, on every rank: submit this pass's arrivals; run the adder (`propose`); then
ONE negotiation over all ranks' records; then the fake model runs the pass: prefill
chunks or decode one token for every running request (`finish_pass`). A request
finishes after max_new_tokens decode steps. The fake KV pool of a rank holds exactly
the pages of its in-flight requests, so free_pages = num_pages - held pages.

  simulate(cfg, arrivals, max_passes)          all ranks in one process; the gather is
                                               a stack of the R records
  run_rank(cfg, arrivals, rank, gather_fn, n)  one rank driven by schedule_pass, for a
                                               real collective (one process per rank)
Both return per-pass RankPass records; `timelines` summarises them per request.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from mimo_fn.sched.config import SchedulerConfig
from mimo_fn.sched.exchange import GatherFn
from mimo_fn.sched.request import Request
from mimo_fn.sched.state import SchedulerState, held_tokens, init_state, is_idle, submit
from mimo_fn.sched.step import PassPlan, commit, finish_pass, propose, schedule_pass


class Arrival(NamedTuple):
    pass_id: int  # the pass at whose start the request is submitted
    rank: int  # the DP rank it is routed to
    rid: int
    input_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class RankPass:
    pass_id: int
    rank: int
    free_pages: int  # seen by the adder at the start of the pass
    plan: PassPlan
    num_negotiations: int  # gathers this rank joined during the pass (must be 1)
    held_tokens: int  # KV held after the pass (must stay <= capacity)
    finished: tuple[int, ...]  # rids finished by this pass


class Timeline(NamedTuple):
    rank: int
    arrival: int
    first_proposed: int | None  # first pass the adder planned it
    first_prefilled: int | None  # first pass one of its chunks ran
    finished: int | None  # pass whose decode produced its last token


def fake_free_pages(state: SchedulerState, cfg: SchedulerConfig) -> int:
    return cfg.num_pages - held_tokens(state, cfg) // cfg.page_size


def _arrivals_by_pass(arrivals: Sequence[Arrival]) -> dict[tuple[int, int], list[Request]]:
    out: dict[tuple[int, int], list[Request]] = defaultdict(list)
    for a in arrivals:
        out[(a.pass_id, a.rank)].append(Request(a.rid, a.input_len, a.max_new_tokens))
    return out


def _run_model(state, cfg, rank, free, plan, negotiations) -> tuple[SchedulerState, RankPass]:
    state, done = finish_pass(state, plan)
    rec = RankPass(
        state.pass_id - 1, rank, free, plan, negotiations, held_tokens(state, cfg), tuple(r.rid for r in done)
    )
    return state, rec


def simulate(
    cfg: SchedulerConfig, arrivals: Sequence[Arrival], max_passes: int, stop_when_idle: bool = True
) -> list[list[RankPass]]:
    """Run all cfg.dp_size ranks in lockstep; returns trace[pass][rank]. Stops early once
    every rank is idle and no arrival is left (unless stop_when_idle is False)."""
    by_pass = _arrivals_by_pass(arrivals)
    last_arrival = max((a.pass_id for a in arrivals), default=-1)
    states = [init_state() for _ in range(cfg.dp_size)]
    trace = []
    for p in range(max_passes):
        states = [submit(s, cfg, by_pass.get((p, r), ())) for r, s in enumerate(states)]
        if stop_when_idle and p > last_arrival and all(is_idle(s) for s in states):
            break
        free = [fake_free_pages(s, cfg) for s in states]
        proposals = [propose(s, cfg, f) for s, f in zip(states, free)]
        records_RF = torch.stack([pr.record_F for pr in proposals])
        calls = [0] * cfg.dp_size

        def gather(rank: int, record_F: torch.Tensor) -> torch.Tensor:
            # The simulated all-gather: every rank receives the same stacked records.
            calls[rank] += 1
            assert torch.equal(record_F, records_RF[rank])
            return records_RF

        committed = [
            commit(s, cfg, pr, gather(r, pr.record_F)) for r, (s, pr) in enumerate(zip(states, proposals))
        ]
        row = []
        for r, (s, plan) in enumerate(committed):
            states[r], rec = _run_model(s, cfg, r, free[r], plan, negotiations=calls[r])
            row.append(rec)
        trace.append(row)
    return trace


def run_rank(
    cfg: SchedulerConfig, arrivals: Sequence[Arrival], rank: int, gather_fn: GatherFn, num_passes: int
) -> list[RankPass]:
    """Drive one rank for exactly num_passes passes with schedule_pass and a real
    gather_fn (every rank must run the same number of passes)."""
    by_pass = _arrivals_by_pass(arrivals)
    state = init_state()
    out = []
    for p in range(num_passes):
        state = submit(state, cfg, by_pass.get((p, rank), ()))
        calls = []

        def counted(record_F, calls=calls):
            calls.append(1)
            return gather_fn(record_F)

        free = fake_free_pages(state, cfg)
        state, plan = schedule_pass(state, cfg, free, counted)
        state, rec = _run_model(state, cfg, rank, free, plan, negotiations=len(calls))
        out.append(rec)
    return out


def timelines(trace: list[list[RankPass]], arrivals: Sequence[Arrival]) -> dict[int, Timeline]:
    proposed: dict[int, int] = {}
    prefilled: dict[int, int] = {}
    finished: dict[int, int] = {}
    for row in trace:
        for rp in row:
            for c in rp.plan.proposed.chunks:
                proposed.setdefault(c.rid, rp.pass_id)
            for c in rp.plan.prefill:
                prefilled.setdefault(c.rid, rp.pass_id)
            for rid in rp.finished:
                finished[rid] = rp.pass_id
    return {
        a.rid: Timeline(a.rank, a.pass_id, proposed.get(a.rid), prefilled.get(a.rid), finished.get(a.rid))
        for a in arrivals
    }
