"""PrefillDelayer decision branches, the record, and flush_when_idle."""

import dataclasses

import pytest
import torch

from mimo_fn.sched import (
    DelayerState,
    FlushTimeoutError,
    RecordField as RF,
    Request,
    SchedulerConfig,
    decide,
    flush_when_idle,
    init_state,
    local_gather,
    make_record,
    plan_prefill,
    schedule_pass,
    submit,
)
from mimo_fn.sched.delayer import NUM_FIELDS, note_prefill
from mimo_fn.sched.simulate import fake_free_pages
from mimo_fn.sched.step import finish_pass

CFG = SchedulerConfig(num_pages=1024, page_size=16, max_delay_passes=3, max_running_requests=8, dp_size=2)


def rec(prefillable=1, watermark=0, in_chunk=0, running=0, recent=0, queue=1, new=1):
    row = [0] * NUM_FIELDS
    row[RF.PREFILLABLE], row[RF.WATERMARK], row[RF.IN_CHUNK] = prefillable, watermark, in_chunk
    row[RF.NUM_RUNNING], row[RF.RECENT_MAX_BS] = running, recent
    row[RF.QUEUE_LEN], row[RF.NUM_NEW] = queue, new
    return row


def idle():
    return rec(prefillable=0, queue=0, new=0)


def run(rows, cfg=CFG, count=0):
    return decide(torch.tensor(rows, dtype=torch.int64), DelayerState(delayed_count=count), cfg)


def test_all_prefillable_allows_and_resets():
    state, d = run([rec(), rec()], count=2)
    assert (d.allow, d.reason, d.num_prefillable, state.delayed_count) == (True, "all", 2, 0)


def test_none_prefillable_allows_without_delay():
    state, d = run([idle(), idle()], count=2)
    assert (d.allow, d.reason, state.delayed_count) == (True, "none", 0)


def test_mixed_delays_then_times_out():
    state = DelayerState()
    reasons = []
    for _ in range(CFG.max_delay_passes + 1):
        state, d = decide(torch.tensor([rec(), idle()]), state, CFG)
        reasons.append((d.allow, d.reason))
    assert reasons == [(False, "mixed")] * 3 + [(True, "timeout")]
    assert state.delayed_count == 0


def test_zero_max_delay_never_delays():
    cfg = dataclasses.replace(CFG, max_delay_passes=0)
    _, d = run([rec(), idle()], cfg)
    assert (d.allow, d.reason) == (True, "timeout")


def test_watermark_forces_allow():
    _, d = run([rec(watermark=1), idle()])
    assert (d.allow, d.reason) == (True, "watermark")


def test_chunk_in_progress_is_never_delayed():
    _, d = run([rec(in_chunk=1), idle(), idle()], count=1)
    assert (d.allow, d.reason) == (True, "chunk")


def test_fuller_batch_wait_is_bounded():
    # both ranks busy decoding (3 running), queue drained, 1 new < recent max 4
    rows = [rec(running=3, recent=4), rec(running=3, recent=4)]
    state, out = DelayerState(), []
    for _ in range(CFG.max_delay_passes + 1):
        state, d = decide(torch.tensor(rows), state, CFG)
        out.append(d.reason)
    assert out == ["fuller"] * 3 + ["timeout"]


@pytest.mark.parametrize(
    "other",
    [
        rec(running=0, recent=4),  # an idle rank never waits for a fuller batch
        rec(running=3, recent=4, queue=5, new=1),  # budget-limited: waiting gives nothing
        rec(running=3, recent=1),  # already as large as recently
        rec(running=7, recent=4),  # fills its last free slot
    ],
)
def test_fuller_batch_wait_only_when_every_rank_is_underfull(other):
    _, d = run([rec(running=3, recent=4), other])
    assert (d.allow, d.reason) == (True, "all")


def test_fuller_batch_wait_can_be_disabled():
    cfg = dataclasses.replace(CFG, wait_for_fuller_batch=False)
    _, d = run([rec(running=3, recent=4)] * 2, cfg)
    assert d.reason == "all"


def test_record_reflects_the_whole_state():
    cfg = dataclasses.replace(CFG, token_usage_low_watermark=0.5)
    state = submit(init_state(), cfg, [Request(i, 100, 4) for i in range(3)])
    state, _ = schedule_pass(state, cfg, 1024, local_gather)  # admits all 3, notes bs 3
    state = submit(state, cfg, [Request(9, 200, 4), Request(10, 16000, 4)])  # 1001 pages: no room
    free = fake_free_pages(state, cfg)  # 3 * 7 pages held
    plan = plan_prefill(state, cfg, free)
    row = make_record(state, cfg, plan, free).tolist()
    assert row[RF.PREFILLABLE] == 1 and row[RF.IN_CHUNK] == 0
    assert row[RF.NUM_RUNNING] == 3 and row[RF.QUEUE_LEN] == 2 and row[RF.NUM_NEW] == 1
    assert row[RF.RECENT_MAX_BS] == 3
    assert row[RF.WATERMARK] == 1  # usage 21 / 1024 pages < 0.5
    assert make_record(state, cfg, plan, free_pages=100).tolist()[RF.WATERMARK] == 0
    empty = plan_prefill(init_state(), cfg, 1024)
    assert make_record(init_state(), cfg, empty, 1024).tolist()[RF.WATERMARK] == 0  # not prefillable


def test_recent_batch_window_forgets():
    cfg = dataclasses.replace(CFG, recent_window=2)
    state = DelayerState()
    for bs in (9, 0, 1, 2):
        state = note_prefill(state, cfg, bs)
    assert state.recent_prefill_bs == (1, 2)


def test_same_decision_from_every_rank_view():
    rows = torch.tensor([rec(running=2), idle(), rec(new=3, queue=3)])
    assert len({decide(rows, DelayerState(delayed_count=1), CFG) for _ in range(3)}) == 1


# ---- flush_when_idle ----


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0  # every poll costs one second
        return self.t


def busy_state(cfg, max_new=3):
    state = submit(init_state(), cfg, [Request(0, 10, max_new)])
    state, _ = schedule_pass(state, cfg, 1024, local_gather)
    return state


def one_pass(cfg):
    def step(state):
        state, plan = schedule_pass(state, cfg, fake_free_pages(state, cfg), local_gather)
        return finish_pass(state, plan)[0]

    return step


def test_flush_when_idle_flushes_at_once_when_idle():
    flushed = []
    flush_when_idle(init_state(), lambda: flushed.append(1), step=None, timeout_s=0)
    assert flushed == [1]


def test_flush_waits_for_running_requests_to_drain():
    cfg = dataclasses.replace(CFG, dp_size=1)
    flushed, polls = [], []

    def step(state):
        polls.append(state.num_in_flight)
        assert not flushed, "flushed under running requests"
        return one_pass(cfg)(state)

    state = flush_when_idle(busy_state(cfg), lambda: flushed.append(1), step, timeout_s=10, clock=FakeClock())
    assert flushed == [1] and polls == [1, 1, 1] and state.running == ()


def test_flush_times_out_without_flushing():
    cfg = dataclasses.replace(CFG, dp_size=1)
    flushed = []
    with pytest.raises(FlushTimeoutError, match="1 running"):
        state = busy_state(cfg, max_new=50)
        flush_when_idle(state, lambda: flushed.append(1), one_pass(cfg), 5, clock=FakeClock())
    assert flushed == []


def test_flush_uses_the_supplied_idle_test():
    cfg = dataclasses.replace(CFG, dp_size=1)
    group_busy = iter([False, False, True])  # e.g. another DP rank still drains
    steps = []
    step = lambda s: steps.append(1) or s  # noqa: E731
    flush_when_idle(init_state(), lambda: None, step, 10, idle=lambda s: next(group_busy))
    assert len(steps) == 2
