"""Flush caches only when the scheduler is idle: never under running or waiting requests.

`flush_when_idle(state, flush, step, timeout_s)` drives `step` (one engine pass, which
returns the new scheduler state) until nothing waits, runs or is chunked, then calls
`flush()` exactly once. If the work does not drain within `timeout_s` seconds it raises
FlushTimeoutError and does NOT flush: flushing KV or prefix caches under live requests
would corrupt them.

With DP > 1 every rank calls this in lockstep, and each `step` joins the pass's
collective, so all ranks must leave the loop at the same poll: pass an `idle` that
agrees group-wide (e.g. an all-reduce of `is_idle(state)` over the DP group, one per
poll on every rank). An idle rank then keeps stepping (empty passes) until all are.
"""

import time
from typing import Callable

from mimo_fn.sched.state import SchedulerState, is_idle


class FlushTimeoutError(RuntimeError):
    """Requests were still in flight when the flush timeout expired; nothing was flushed."""


def flush_when_idle(
    state: SchedulerState,
    flush: Callable[[], None],
    step: Callable[[SchedulerState], SchedulerState],
    timeout_s: float,
    idle: Callable[[SchedulerState], bool] = is_idle,
    clock: Callable[[], float] = time.monotonic,
) -> SchedulerState:
    """Step until idle, then flush. Returns the (idle) state after the last step.

    idle: the idle test, polled before every step (group-wide for DP > 1, see above).
    clock: injectable for deterministic tests.
    """
    if timeout_s < 0:
        raise ValueError(f"flush_when_idle timeout_s must be >= 0, got {timeout_s}")
    deadline = clock() + timeout_s
    while not idle(state):
        if clock() >= deadline:
            raise FlushTimeoutError(
                f"cache flush timed out after {timeout_s}s with {len(state.waiting)} waiting, "
                f"{len(state.running)} running and "
                f"{int(state.chunked is not None)} chunked request(s); nothing was flushed"
            )
        state = step(state)
    assert is_idle(state), "idle() said idle while this rank still has requests"
    flush()
    return state
