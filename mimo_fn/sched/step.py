"""One scheduling pass of one DP rank: adder, then ONE negotiation, then the plan.

Legend: N = DP ranks, F = record fields; lengths in tokens.

  schedule_pass(state, cfg, free_pages, gather_fn) -> (state, PassPlan)
      = propose (adder + record) -> gather_fn (the one collective) -> commit
  finish_pass(state, pass_plan, finished=()) -> (state, finished_requests)
      after the model ran the pass: count decode steps, retire finished requests,
      advance the pass counter.

`propose` / `commit` are the two halves, exposed so that a single process can drive
several simulated ranks in lockstep (simulate.py); an engine calls schedule_pass, which
guarantees every rank joins exactly one negotiation per pass, prefilling or not.

A rank does not mix prefill and decode in one pass: if it prefills, its running
requests wait one pass (PassPlan.decode is empty); otherwise they all decode.
"""

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Mapping

from mimo_fn._types import Int, Tensor, typed
from mimo_fn.sched.adder import Chunk, PrefillPlan, apply_prefill, plan_prefill
from mimo_fn.sched.config import SchedulerConfig
from mimo_fn.sched.delayer import Decision, decide, make_record, note_prefill
from mimo_fn.sched.exchange import GatherFn
from mimo_fn.sched.request import Request
from mimo_fn.sched.state import SchedulerState


@dataclass(frozen=True)
class Proposal:
    plan: PrefillPlan  # what the adder would prefill if allowed
    record_F: Tensor  # this rank's int64 record for the negotiation


@dataclass(frozen=True)
class PassPlan:
    prefill: tuple[Chunk, ...]  # (rid, start, num_tokens) to prefill now; () if delayed
    decode: tuple[int, ...]  # rids to decode now, in running order
    decision: Decision  # the group's decision (identical on every rank)
    proposed: PrefillPlan  # the adder's proposal, kept for metrics and tests


def propose(state: SchedulerState, cfg: SchedulerConfig, free_pages: int) -> Proposal:
    plan = plan_prefill(state, cfg, free_pages)
    return Proposal(plan, make_record(state, cfg, plan, free_pages))


@typed
def commit(
    state: SchedulerState, cfg: SchedulerConfig, proposal: Proposal, records_NF: Int[Tensor, "N F"]
) -> tuple[SchedulerState, PassPlan]:
    delayer, decision = decide(records_NF, state.delayer, cfg)
    plan = proposal.plan
    if decision.allow and not plan.is_empty:
        state = apply_prefill(state, plan)
        delayer = note_prefill(delayer, cfg, plan.num_new)
        out = PassPlan(plan.chunks, (), decision, plan)
    else:
        out = PassPlan((), tuple(r.rid for r in state.running), decision, plan)
    return dataclasses.replace(state, delayer=delayer), out


def schedule_pass(
    state: SchedulerState, cfg: SchedulerConfig, free_pages: int, gather_fn: GatherFn
) -> tuple[SchedulerState, PassPlan]:
    """Plan this rank's pass. Call exactly once per pass on every DP rank (the gather is
    collective). free_pages: free pages of this rank's KV pool now."""
    proposal = propose(state, cfg, free_pages)
    return commit(state, cfg, proposal, gather_fn(proposal.record_F))


def finish_pass(
    state: SchedulerState, pass_plan: PassPlan, finished: Iterable[int] = (),
    decoded_tokens: Mapping[int, int] | None = None,
) -> tuple[SchedulerState, tuple[Request, ...]]:
    """Record that the pass ran. Decoded requests gain one token (decoded_tokens[rid] where
    given: speculative steps keep several); a request finishes at max_new_tokens or when its
    rid is in `finished` (EOS, stop string, abort).
    Returns the new state and the finished requests (their KV may be freed now)."""
    stop = set(finished)
    decoded = set(pass_plan.decode)
    running, done = [], []
    for r in state.running:
        if r.rid in decoded:
            r = r.advance_decode((decoded_tokens or {}).get(r.rid, 1))
        (done if r.is_done or r.rid in stop else running).append(r)
    return dataclasses.replace(state, running=tuple(running), pass_id=state.pass_id + 1), tuple(done)
