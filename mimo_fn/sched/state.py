"""SchedulerState: one DP rank's queues, the chunk in progress, and delayer bookkeeping.

Legend: lengths in tokens; "in flight" = running requests plus the chunked one, i.e.
everything that holds (or has reserved) KV and a slot.

Invariants (asserted where cheap):
- a request id is in exactly one of waiting / running / chunked;
- every running request is fully prefilled; the chunked one is not;
- waiting is in submission order (the policy sorts at planning time).
The state is a frozen value: every function returns a new one.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from mimo_fn.sched.config import SchedulerConfig
from mimo_fn.sched.request import Request


@dataclass(frozen=True)
class DelayerState:
    # Consecutive passes delayed so far; identical on every rank because it only
    # changes with the global decision.
    delayed_count: int = 0
    # This rank's batch sizes (new requests) of its last `recent_window` prefill passes.
    recent_prefill_bs: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerState:
    waiting: tuple[Request, ...] = ()
    running: tuple[Request, ...] = ()  # fully prefilled, decoding
    chunked: Request | None = None  # the one request whose prefill is split over passes
    pass_id: int = 0  # passes completed (finish_pass increments it)
    delayer: DelayerState = field(default_factory=DelayerState)
    # (prompt_key, source rid) of prompts the engine holds for copies still waiting, after their
    # source may have gone on to decode (adder rule 5; SchedulerConfig.hold_prompts), and (rid,
    # rid) of prefilled prefix requests, held for the requests that begin with them (rule 6)
    held: tuple[tuple[int, int], ...] = ()

    @property
    def in_flight(self) -> tuple[Request, ...]:
        return self.running + ((self.chunked,) if self.chunked is not None else ())

    @property
    def num_in_flight(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def request_ids(self) -> list[int]:
        return [r.rid for r in self.waiting + self.in_flight]


def init_state() -> SchedulerState:
    return SchedulerState()


def submit(state: SchedulerState, cfg: SchedulerConfig, requests: Iterable[Request]) -> SchedulerState:
    """Append requests to the waiting queue, stamped with the current pass.

    Raises ValueError for a request that could never fit this rank's KV pool (it would
    block the fcfs queue forever) or whose id is already known.
    """
    known = set(state.request_ids())
    new = []
    for r in requests:
        if r.footprint_tokens(cfg.page_size) > cfg.capacity_tokens:
            raise ValueError(
                f"Request.input_len + max_new_tokens = {r.input_len + r.max_new_tokens} "
                f"(rid {r.rid}) exceeds the KV capacity of a rank, "
                f"SchedulerConfig.num_pages * page_size = {cfg.capacity_tokens}"
            )
        if r.rid in known:
            raise ValueError(f"Request.rid {r.rid} is already queued or running")
        known.add(r.rid)
        new.append(dataclasses.replace(r, arrival_pass=state.pass_id, prefilled=0, generated=0))
    return dataclasses.replace(state, waiting=state.waiting + tuple(new))


def let_go(state: SchedulerState) -> tuple[SchedulerState, tuple[int, ...]]:
    """Stop holding every held prompt and prefix (their copies, and the requests that begin with
    the prefix, will run their whole prompts); returns the keys.
    For a rank whose pages held prompts keep from the next waiting request, with nothing in
    flight to give pages back."""
    return dataclasses.replace(state, held=()), tuple(k for k, _ in state.held)


def hold(state: SchedulerState, keys: Iterable[int]) -> SchedulerState:
    """Hold prefixes made outside this state (the engine's prefix cache, mimo_fn.engine.prefix_cache):
    each key is a prefix's sequence id, and a waiting request with that prefix_key forks it
    (adder rule 6). They are let go like the prefixes the adder holds."""
    return dataclasses.replace(state, held=state.held + tuple((k, k) for k in keys))


def unhold(state: SchedulerState, keys: Iterable[int]) -> SchedulerState:
    """Stop holding the held prompts and prefixes of keys (their requests are all done)."""
    keys = set(keys)
    return dataclasses.replace(state, held=tuple((k, s) for k, s in state.held if k not in keys))


def remove(state: SchedulerState, rid: int) -> SchedulerState:
    """The state without request rid, wherever it is (an abort): the caller frees its KV."""
    chunked = None if state.chunked is not None and state.chunked.rid == rid else state.chunked
    return dataclasses.replace(state, waiting=tuple(r for r in state.waiting if r.rid != rid),
                               running=tuple(r for r in state.running if r.rid != rid), chunked=chunked)


def is_idle(state: SchedulerState) -> bool:
    """Nothing waits, nothing runs, no chunk in progress."""
    return not state.waiting and not state.running and state.chunked is None


def held_tokens(state: SchedulerState, cfg: SchedulerConfig) -> int:
    """KV (page-rounded) that in-flight requests hold now."""
    return sum(r.held_tokens(cfg.page_size) for r in state.in_flight)


def reserved_tokens(state: SchedulerState, cfg: SchedulerConfig) -> int:
    """KV in-flight requests will still allocate: remaining chunks and max_new_tokens."""
    return sum(r.outstanding_tokens(cfg.page_size) for r in state.in_flight)
