"""PrefillDelayer: should the DP group prefill this pass? One decision, same on every rank.

Legend: N = DP ranks, F = record fields (RecordField). Each pass every rank builds one
int64 record F from its state and its adder's plan, the ranks exchange records in ONE
all-gather (exchange.py), and `decide` maps the gathered records_NF plus the shared
delay counter to a Decision. Being a pure function of identical inputs, the decision
is identical on every rank without a second collective.

Why delay at all: with DP attention the ranks run each forward together (the MoE/EP
layers are collective), so one rank prefilling stretches the pass for all the others,
whose decode batches stall behind it. Prefilling on all ranks in the same pass costs
one long pass instead of several.

Branches, first match wins (reason in quotes):
  "chunk"      some rank is mid chunked request: allow; that rank's pass is a prefill
               pass anyway, so the others lose nothing by prefilling too
  "none"       no rank can prefill: allow (nothing happens), reset the counter
  "watermark"  a prefillable rank's KV usage is under token_usage_low_watermark: allow
  "mixed"      some ranks can prefill, some cannot: delay ...
  "fuller"     all can prefill, but each is busy decoding and would admit a small batch
               (fewer than its recent max, drained queue, free slots): delay ...
  "timeout"    ... unless max_delay_passes passes in a row were already delayed: allow
  "all"        all can prefill: allow
A rank is prefillable iff its adder planned at least one chunk, i.e. the delayer runs
after the KV / token budget checks. Allowing resets the counter; delaying bumps it, so a
proposed request waits at most max_delay_passes passes (during a delay no rank
prefills, budgets only grow and fcfs arrivals queue behind it, so it stays proposed).
"""

import dataclasses
from dataclasses import dataclass
from enum import IntEnum

import torch

from mimo_fn._types import Int, Tensor, typed
from mimo_fn.sched.adder import PrefillPlan
from mimo_fn.sched.config import SchedulerConfig
from mimo_fn.sched.state import DelayerState, SchedulerState


class RecordField(IntEnum):
    PREFILLABLE = 0  # 1 if the adder planned any chunk
    WATERMARK = 1  # 1 if prefillable and KV usage < token_usage_low_watermark
    IN_CHUNK = 2  # 1 if a chunked request is in progress on this rank
    NUM_RUNNING = 3  # in-flight requests (running + chunked): the full running batch
    RECENT_MAX_BS = 4  # max new requests per prefill pass over the recent window
    QUEUE_LEN = 5  # waiting requests
    NUM_NEW = 6  # waiting requests the adder would admit this pass


NUM_FIELDS = len(RecordField)


@dataclass(frozen=True)
class Decision:
    allow: bool
    reason: str
    num_prefillable: int  # ranks whose adder planned something


def make_record(
    state: SchedulerState, cfg: SchedulerConfig, plan: PrefillPlan, free_pages: int
) -> Tensor:
    """This rank's int64 record of NUM_FIELDS values (built from the whole state)."""
    prefillable = not plan.is_empty
    usage = 1.0 - free_pages / cfg.num_pages
    w = cfg.token_usage_low_watermark
    rec = [0] * NUM_FIELDS
    rec[RecordField.PREFILLABLE] = int(prefillable)
    rec[RecordField.WATERMARK] = int(prefillable and w is not None and usage < w)
    rec[RecordField.IN_CHUNK] = int(state.chunked is not None)
    rec[RecordField.NUM_RUNNING] = state.num_in_flight
    rec[RecordField.RECENT_MAX_BS] = max(state.delayer.recent_prefill_bs, default=0)
    rec[RecordField.QUEUE_LEN] = len(state.waiting)
    rec[RecordField.NUM_NEW] = plan.num_new
    return torch.tensor(rec, dtype=torch.int64)


@typed
def decide(
    records_NF: Int[Tensor, "N F"], delayer: DelayerState, cfg: SchedulerConfig
) -> tuple[DelayerState, Decision]:
    """The group's decision from all ranks' records. Pure and rank-independent."""
    rows = records_NF.tolist()  # one host copy; the rest is plain Python
    num_prefillable = sum(r[RecordField.PREFILLABLE] for r in rows)

    def allow(reason: str) -> tuple[DelayerState, Decision]:
        return dataclasses.replace(delayer, delayed_count=0), Decision(True, reason, num_prefillable)

    def delay(reason: str) -> tuple[DelayerState, Decision]:
        if delayer.delayed_count >= cfg.max_delay_passes:
            return allow("timeout")
        bumped = dataclasses.replace(delayer, delayed_count=delayer.delayed_count + 1)
        return bumped, Decision(False, reason, num_prefillable)

    if any(r[RecordField.IN_CHUNK] for r in rows):
        return allow("chunk")
    if num_prefillable == 0:
        return allow("none")
    if any(r[RecordField.WATERMARK] for r in rows):
        return allow("watermark")
    if num_prefillable < len(rows):
        return delay("mixed")
    if cfg.wait_for_fuller_batch and all(_underfull(r, cfg) for r in rows):
        return delay("fuller")
    return allow("all")


def _underfull(row: list[int], cfg: SchedulerConfig) -> bool:
    """A short wait would give this rank a fuller batch at little cost: it is busy
    decoding (an idle rank should never wait), its queue is drained (the batch is limited
    by arrivals, not by a budget that waiting would not lift), and it would admit fewer
    than both its free slots and its recent max prefill batch size."""
    num_new = row[RecordField.NUM_NEW]
    free_slots = cfg.max_running_requests - row[RecordField.NUM_RUNNING]
    return (
        row[RecordField.NUM_RUNNING] > 0
        and num_new == row[RecordField.QUEUE_LEN]
        and num_new < free_slots
        and num_new < row[RecordField.RECENT_MAX_BS]
    )


def note_prefill(delayer: DelayerState, cfg: SchedulerConfig, num_new: int) -> DelayerState:
    """Remember the batch size of a prefill pass that admitted new requests."""
    if num_new == 0:
        return delayer
    window = (delayer.recent_prefill_bs + (num_new,))[-cfg.recent_window :]
    return dataclasses.replace(delayer, recent_prefill_bs=window)
