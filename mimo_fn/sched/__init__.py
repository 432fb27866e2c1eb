"""Prefill scheduler: pure functions over frozen state, one DP rank per state.

Per pass, on every DP rank (in lockstep):
    state = submit(state, cfg, new_requests)                       # arrivals
    state, plan = schedule_pass(state, cfg, free_pages, gather_fn) # adder + ONE negotiation
    ... run the model: prefill plan.prefill chunks, or decode plan.decode ...
    state, done = finish_pass(state, plan, finished=eos_rids)      # retire, pass += 1
gather_fn is local_gather at DP1, dist_gather(dp_group) at DP > 1.

Files: request (Request), config (SchedulerConfig), policy (queue order), state
(SchedulerState), adder (PrefillAdder), delayer (PrefillDelayer), exchange (the one
collective), step (one pass), flush (flush_when_idle), simulate (lockstep simulator).
"""

from mimo_fn.sched.adder import Chunk, PrefillPlan, apply_prefill, plan_prefill
from mimo_fn.sched.config import SchedulerConfig, check_overrides
from mimo_fn.sched.delayer import Decision, RecordField, decide, make_record
from mimo_fn.sched.exchange import GatherFn, dist_gather, local_gather
from mimo_fn.sched.flush import FlushTimeoutError, flush_when_idle
from mimo_fn.sched.request import Request, pages_for
from mimo_fn.sched.state import (
    DelayerState, SchedulerState, hold, init_state, is_idle, let_go, remove, submit, unhold,
)
from mimo_fn.sched.step import PassPlan, Proposal, commit, finish_pass, propose, schedule_pass

__all__ = [
    "Chunk",
    "Decision",
    "DelayerState",
    "FlushTimeoutError",
    "GatherFn",
    "PassPlan",
    "PrefillPlan",
    "Proposal",
    "RecordField",
    "Request",
    "SchedulerConfig",
    "SchedulerState",
    "apply_prefill",
    "check_overrides",
    "commit",
    "decide",
    "dist_gather",
    "finish_pass",
    "flush_when_idle",
    "hold",
    "init_state",
    "is_idle",
    "let_go",
    "local_gather",
    "make_record",
    "pages_for",
    "plan_prefill",
    "propose",
    "remove",
    "schedule_pass",
    "submit",
    "unhold",
]
