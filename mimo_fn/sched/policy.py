"""Waiting-queue order: which request the adder considers first.

  fcfs  first come, first served: by arrival pass, then submission order. With the
        adder's "stop at the first request that does not fit" rule this is what keeps
        long inputs from being starved by a stream of short ones.
  lof   longest output (max_new_tokens) first, ties in fcfs order. Useful for offline
        batches where long decodes should start early; a request with a short output
        can wait behind newer long-output ones, so it offers no starvation bound.

Sorting is stable, and `SchedulerState.waiting` is kept in submission order, so equal
keys keep fcfs order without a separate sequence number.
"""

from mimo_fn.sched.request import Request


def order_waiting(waiting: tuple[Request, ...], policy: str) -> tuple[Request, ...]:
    if policy == "fcfs":
        return tuple(sorted(waiting, key=lambda r: r.arrival_pass))
    if policy == "lof":
        return tuple(sorted(waiting, key=lambda r: (-r.max_new_tokens, r.arrival_pass)))
    raise ValueError(f"SchedulerConfig.policy: unknown policy {policy!r}")
