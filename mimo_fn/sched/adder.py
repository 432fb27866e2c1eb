"""PrefillAdder: which input tokens one rank prefills this pass, under three budgets.

Legend: lengths in tokens; P = page_size. Budgets of one rank for one pass:
  input   max_prefill_tokens          input tokens prefilled in the pass
  chunk   chunk_size // dp_size       the global chunk split across DP ranks
  kv      free_pages * P - reserved   KV not yet promised to in-flight requests, where
                                      reserved = what running / chunked requests will
                                      still allocate (remaining chunks, max_new_tokens)

Rules, in order:
1. The chunked request (if any) continues FIRST: its KV is already reserved, so it only
   spends input/chunk budget.
2. Waiting requests are taken in policy order. A request is admitted when a slot is free
   and its whole footprint (input + max_new_tokens, page-rounded) fits the kv budget;
   the footprint is reserved at once, so later chunks and decodes can never run out of
   KV (no retraction needed).
3. If its remaining input exceeds the input/chunk budget, it is truncated to a
   page-aligned chunk (floor to a multiple of P) and becomes the chunked request; at
   most one request is truncated per pass and planning stops there.
4. Planning stops at the first request that does not fit: no skipping ahead. Smaller
   requests behind a long one wait, which is what keeps long inputs from starving.
5. Copies: a waiting request whose prompt_key matches a request whose whole prompt is in
   the cache by the end of this pass and that has decoded nothing (running with no token
   generated, or finishing its prompt in this pass) runs no tokens: its chunk names that
   request as `source`, and the engine copies the source's KV (model.fork) after the
   pass's model step. It takes a slot like any admission, but no input budget, so copies of a
   prompt longer than a chunk still prefill once; and its footprint less the prompt's whole
   pages, which it holds in common with the source (SchedulerConfig.copies_share_pages).
   When copies of a prompt still wait after the pass that finishes it, the plan asks the engine
   to hold the prompt (`hold`; SchedulerConfig.hold_prompts): a sequence of its own that holds
   the prompt's filled pages in common and its partly filled last page, reserved in this pass.
   The held prompt is their source from then on, however far its first source decodes; the
   plan lets it go (`unhold`) in the pass that admits its last waiting copy.
6. Shared prefixes: a prefix request (`prefix_only`: tokens that several prompts begin with) is
   planned like any other, but once prefilled it is held, not run: its key is its rid. A waiting
   request with that `prefix_key` is admitted only once the prefix is held: its chunk names it
   as `prefix` and starts at `prefix_len`; the engine forks the held prefix's KV into it before
   the model step, so only the rest of the prompt runs, and it holds the prefix's pages in
   common (its footprint less prefix_len, as rule 5). Planning stops ("prefix") at a request
   whose prefix is prefilled in this very pass (it is held from the next one); one whose prefix
   is not held and not in this pass (let go) prefills its whole prompt. The plan lets a held
   prefix go once no request waits for it, as for rule 5. A prefix may also come held from
   outside (state.hold: the engine's prefix cache across calls), with no request of its own.

`plan_prefill` only proposes; `apply_prefill` moves the state once the delayer allows.
"""

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from mimo_fn.sched.config import SchedulerConfig
from mimo_fn.sched.policy import order_waiting
from mimo_fn.sched.state import SchedulerState, reserved_tokens

# Why planning stopped; "empty" means every waiting request was admitted.
STOP_REASONS = ("empty", "chunk", "tokens", "kv", "slots", "prefix")


class Chunk(NamedTuple):
    rid: int
    start: int  # first input position of this chunk (a multiple of page_size)
    num_tokens: int
    source: int = -1  # >= 0: a copy (rule 5) of this rid's prompt: no tokens run (KV from it or its held prompt)
    prefix: int = -1  # >= 0: the held prefix (rule 6) whose KV is forked first, its tokens those before start


@dataclass(frozen=True)
class PrefillPlan:
    chunks: tuple[Chunk, ...]  # the continuing chunked request first, then admissions
    num_new: int  # chunks that admit a waiting request (the batch size the delayer sees)
    truncated: int | None  # rid left partially prefilled after this pass, if any
    stop: str  # one of STOP_REASONS
    kv_budget: int  # kv tokens free for admissions at the start of planning
    kv_reserved: int  # footprint reserved by this pass's admissions and holds (<= kv_budget)
    hold: tuple[tuple[int, int], ...] = ()  # (prompt_key, source rid) to hold after the pass (rule 5)
    unhold: tuple[int, ...] = ()  # held prompt_keys no copy waits for after the pass

    @property
    def num_tokens(self) -> int:
        """Input tokens the model runs (copies run none)."""
        return sum(c.num_tokens for c in self.chunks if c.source < 0)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def plan_prefill(state: SchedulerState, cfg: SchedulerConfig, free_pages: int) -> PrefillPlan:
    """Propose this pass's prefill chunks for one rank. Pure; does not touch `state`.

    free_pages: pages free in this rank's KV pool now (the cache is the source of truth).
    If the pool holds pages the scheduler does not know about, free_pages * P can be
    below the in-flight reservations; the kv budget is then 0, never negative.
    """
    page = cfg.page_size
    rem_tokens = cfg.pass_token_limit
    rem_kv = max(0, free_pages * page - reserved_tokens(state, cfg))
    kv_budget = rem_kv
    rem_slots = cfg.max_running_requests - state.num_in_flight
    chunks: list[Chunk] = []

    def take(req, skip: int = 0) -> int | None:
        """Tokens of `req` to prefill now (past `skip` forked ones), or None if not even one page fits."""
        if req.remaining_input - skip <= rem_tokens:
            return req.remaining_input - skip
        aligned = rem_tokens // page * page  # start stays page-aligned for the next chunk
        return aligned or None

    def done(stop: str, truncated: int | None = None) -> PrefillPlan:
        num_new = len(chunks) - (state.chunked is not None)
        hold, unhold = (), ()
        if chunks and (sources or state.held):  # rule 5: the prompts copies still wait for after this pass
            admitted = {c.rid for c in chunks}
            waits = {k for r in state.waiting if r.rid not in admitted for k in (r.prompt_key, r.prefix_key) if k >= 0}
            held = dict(state.held)
            hold = tuple((k, rid) for k, rid in sources.items() if rid in holdable and k in waits and k not in held)
            unhold = tuple(k for k in held if k not in waits)
        return PrefillPlan(tuple(chunks), num_new, truncated, stop, kv_budget, kv_budget - rem_kv, hold, unhold)

    # rule 5: prompt_key -> a request copies take their KV from: held prompts first, then those
    # finishing their prompt in this pass, as planned; the running ones are looked up only once a
    # waiting request has a key (a decode pass with a full batch never pays for the scan)
    sources: dict[int, int] = dict(state.held)
    held_keys = set(sources)  # held prompts and held prefixes (rule 6: a prefix's key is its rid)
    running_scanned = False
    holdable: set[int] = set()  # sources finishing their prompt in this pass, a hold's page reserved

    def source_of(req) -> int | None:
        nonlocal running_scanned
        if req.prompt_key < 0:
            return None
        if not running_scanned:
            running_scanned = True
            for r in state.running:
                if r.prompt_key >= 0 and r.generated == 0:
                    sources.setdefault(r.prompt_key, r.rid)
        return sources.get(req.prompt_key)

    def add(req, start: int, n: int, prefix: int = -1) -> None:
        nonlocal rem_kv
        chunks.append(Chunk(req.rid, start, n, prefix=prefix))
        if req.prompt_key >= 0 and start + n == req.input_len:
            sources.setdefault(req.prompt_key, req.rid)
            own = page if req.input_len % page else 0  # a held prompt's own page: its partly filled last one
            if cfg.hold_prompts and own <= rem_kv:
                rem_kv -= own
                holdable.add(req.rid)

    if state.chunked is not None:
        req = state.chunked
        n = take(req)
        assert n is not None, "pass_token_limit >= page_size is validated in the config"
        add(req, req.prefilled, n)
        rem_tokens -= n
        if n < req.remaining_input:
            return done("chunk", truncated=req.rid)

    for req in order_waiting(state.waiting, cfg.policy):
        if rem_slots == 0:
            return done("slots")
        footprint = req.footprint_tokens(page)
        source = source_of(req)
        skip = 0  # rule 6: prompt tokens forked from a held prefix
        if source is None and req.prefix_key >= 0:
            if req.prefix_key in held_keys:
                skip = req.prefix_len
            elif any(c.rid == req.prefix_key for c in chunks):
                return done("prefix")
        if source is not None and cfg.copies_share_pages:
            footprint -= req.input_len // page * page
        elif skip and cfg.copies_share_pages:
            footprint -= skip // page * page
        if footprint > rem_kv:
            return done("kv")
        if source is not None:
            chunks.append(Chunk(req.rid, 0, req.input_len, source))
            rem_kv -= footprint
            rem_slots -= 1
            continue
        n = take(req, skip)
        if n is None:
            return done("tokens")
        rem_kv -= footprint
        rem_slots -= 1
        add(req, skip, n, req.prefix_key if skip else -1)
        rem_tokens -= n
        if skip + n < req.input_len:
            return done("chunk", truncated=req.rid)
    return done("empty")


def apply_prefill(state: SchedulerState, plan: PrefillPlan) -> SchedulerState:
    """Advance the planned requests: finished prefills join running, a truncated one
    becomes the chunked request. The model runs the same chunks."""
    waiting = {r.rid: r for r in state.waiting}
    running = list(state.running)
    chunked = state.chunked
    prefixes = ()  # rule 6: prefixes prefilled in this pass, held from now on
    for rid, start, n, _, prefix in plan.chunks:
        if chunked is not None and chunked.rid == rid:
            req, chunked = chunked, None
        else:
            req = waiting.pop(rid)
        if prefix >= 0:  # its first `start` tokens come from the held prefix
            req = req.advance_prefill(start)
        assert req.prefilled == start, (req, start)
        req = req.advance_prefill(n)
        if req.is_prefilled and req.prefix_only:
            prefixes += ((rid, rid),)
        elif req.is_prefilled:
            running.append(req)
        else:
            assert chunked is None, "at most one chunked request"
            chunked = req
    remaining = tuple(r for r in state.waiting if r.rid in waiting)
    held = tuple((k, rid) for k, rid in state.held if k not in plan.unhold) + plan.hold + prefixes
    return dataclasses.replace(state, waiting=remaining, running=tuple(running), chunked=chunked, held=held)
