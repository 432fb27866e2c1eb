"""PrefillAdder, state transitions and config validation: one test per decision branch."""

import dataclasses

import pytest

from mimo_fn.sched import (
    Chunk,
    Request,
    SchedulerConfig,
    apply_prefill,
    finish_pass,
    init_state,
    let_go,
    plan_prefill,
    submit,
)
from mimo_fn.sched.state import reserved_tokens
from mimo_fn.sched.step import PassPlan
from mimo_fn.sched.delayer import Decision


def cfg_(**kw) -> SchedulerConfig:
    base = dict(num_pages=1024, page_size=16, chunk_size=1024, max_prefill_tokens=4096)
    return SchedulerConfig(**{**base, **kw})


def queued(cfg, *lens, max_new=8):
    return submit(init_state(), cfg, [Request(i, n, max_new) for i, n in enumerate(lens)])


def test_fits_admits_all_in_order():
    cfg = cfg_()
    plan = plan_prefill(queued(cfg, 100, 200), cfg, free_pages=1024)
    assert plan.chunks == (Chunk(0, 0, 100), Chunk(1, 0, 200))
    assert (plan.num_new, plan.truncated, plan.stop) == (2, None, "empty")


def test_truncates_long_request_to_chunk_and_stops():
    cfg = cfg_()
    plan = plan_prefill(queued(cfg, 3000, 10), cfg, free_pages=1024)
    assert plan.chunks == (Chunk(0, 0, 1024),)
    assert (plan.truncated, plan.stop) == (0, "chunk")
    state = apply_prefill(queued(cfg, 3000, 10), plan)
    assert state.chunked.rid == 0 and state.chunked.prefilled == 1024
    assert [r.rid for r in state.waiting] == [1]


def test_truncation_is_page_aligned():
    cfg = cfg_()  # 1024 tokens per pass, page 16
    plan = plan_prefill(queued(cfg, 100, 5000), cfg, free_pages=1024)
    # 924 tokens left; floor to a page multiple: 912 = 57 pages
    assert plan.chunks == (Chunk(0, 0, 100), Chunk(1, 0, 912))
    assert plan.chunks[1].num_tokens % cfg.page_size == 0


def test_budget_exhausted_below_one_page_stops():
    cfg = cfg_()
    plan = plan_prefill(queued(cfg, 1020, 50), cfg, free_pages=1024)
    # 4 tokens left: not a page, so the 50-token request is not split to a sliver
    assert plan.chunks == (Chunk(0, 0, 1020),)
    assert plan.stop == "tokens"


def test_max_prefill_tokens_is_a_budget_too():
    cfg = cfg_(chunk_size=8192, max_prefill_tokens=512)
    plan = plan_prefill(queued(cfg, 300, 300), cfg, free_pages=1024)
    assert plan.chunks == (Chunk(0, 0, 300), Chunk(1, 0, 208))
    assert plan.num_tokens <= cfg.max_prefill_tokens


def test_chunk_is_split_across_dp_ranks():
    cfg = SchedulerConfig(num_pages=8192, page_size=16, dp_size=2)  # default global chunk 32768
    assert cfg.rank_chunk_size == 16384
    plan = plan_prefill(queued(cfg, 65536), cfg, free_pages=8192)
    assert plan.chunks == (Chunk(0, 0, 16384),)


def test_chunked_request_continues_first():
    # lof would put the long-output newcomer first; the chunked one still goes first.
    cfg = cfg_(policy="lof")
    state = queued(cfg, 3000)
    state = apply_prefill(state, plan_prefill(state, cfg, 1024))
    state = submit(state, cfg, [Request(7, 50, 500)])
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks[0] == Chunk(0, 1024, 1024)
    assert (plan.truncated, plan.num_new) == (0, 0)
    # the last chunk finishes it, then admissions resume in the same pass
    state = apply_prefill(state, plan)
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks == (Chunk(0, 2048, 952), Chunk(7, 0, 50))
    state = apply_prefill(state, plan)
    assert state.chunked is None and [r.rid for r in state.running] == [0, 7]


def test_copies_of_a_prompt_take_its_kv_without_budget():
    """Rule 5: requests with one prompt_key copy the one that holds the whole prompt and has
    decoded nothing: no input budget, but a slot and their footprint; a key whose holder has
    decoded runs again, and -1 never copies."""
    cfg = cfg_(max_running_requests=4)
    reqs = [Request(0, 2500, 8, prompt_key=0), Request(1, 2500, 8, prompt_key=0), Request(2, 40, 8),
            Request(3, 2500, 8, prompt_key=0), Request(4, 40, 8, prompt_key=4), Request(5, 40, 8, prompt_key=4),
            Request(6, 2500, 8, prompt_key=0)]
    state = submit(init_state(), cfg, reqs)
    for _ in range(2):  # the prompt's first two chunks: the copies wait behind it
        plan = plan_prefill(state, cfg, free_pages=1024)
        assert [c.rid for c in plan.chunks] == [0] and plan.stop == "chunk"
        state = apply_prefill(state, plan)
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks == (Chunk(0, 2048, 452), Chunk(1, 0, 2500, 0), Chunk(2, 0, 40), Chunk(3, 0, 2500, 0))
    assert plan.num_tokens == 452 + 40 and plan.stop == "slots" and plan.num_new == 3
    # a copy's footprint (2508 tokens, page-rounded) less the prompt's 156 whole pages it shares, rid 2's,
    # and the page of the prompt's last 4 tokens for holding it (rid 6 still waits)
    assert plan.kv_reserved == 2 * (2512 - 2496) + 48 + 16
    unshared = plan_prefill(dataclasses.replace(state, chunked=state.chunked), cfg_(max_running_requests=4,
                                                                                   copies_share_pages=False), 1024)
    assert unshared.chunks == plan.chunks and unshared.kv_reserved == 2 * 2512 + 48 + 16
    assert plan.hold == ((0, 0),) and plan.unhold == ()  # rid 6 still waits for the prompt: hold it
    state = apply_prefill(state, plan)
    assert [r.rid for r in state.running] == [0, 1, 2, 3] and state.chunked is None and state.held == ((0, 0),)
    # 1 and 2 finished, 0 and 3 decoded a token: 4 runs, 5 copies it, 6 copies the held prompt
    held = {r.rid: r for r in state.running}
    state = dataclasses.replace(state, running=(held[0].advance_decode(), held[3].advance_decode()))
    plan = plan_prefill(state, cfg_(max_running_requests=5), free_pages=1024)
    assert plan.chunks == (Chunk(4, 0, 40), Chunk(5, 0, 40, 4), Chunk(6, 0, 2500, 0))
    assert plan.hold == () and plan.unhold == (0,)  # no copy waits after this pass
    assert apply_prefill(state, plan).held == ()
    # not held (SchedulerConfig.hold_prompts=False): a copy takes an undecoded request's KV, else runs
    unheld = cfg_(max_running_requests=5, hold_prompts=False)
    state, keys = let_go(state)
    assert keys == (0,) and state.held == ()
    plan = plan_prefill(dataclasses.replace(state, running=(held[0].advance_decode(), held[3])), unheld, 1024)
    assert plan.chunks[2] == Chunk(6, 0, 2500, 3) and plan.hold == ()
    plan = plan_prefill(state, unheld, free_pages=1024)
    assert plan.chunks == (Chunk(4, 0, 40), Chunk(5, 0, 40, 4), Chunk(6, 0, 976)) and plan.truncated == 6


def test_prompts_fork_a_held_prefix_and_prefill_the_rest():
    """Rule 6: a prefix request (prefix_only) is prefilled over passes like any other, and the
    requests that begin with it wait ("prefix") until it is held; then each forks it (its chunk
    starts at prefix_len, names the prefix, and reserves its footprint less the prefix's pages)
    and the plan lets the prefix go once none waits. A request whose prefix is neither held nor
    planned (let go) prefills its whole prompt."""
    cfg = cfg_(max_running_requests=3)
    reqs = [Request(9, 1600, 1, prefix_only=True), Request(0, 1700, 8, prefix_key=9, prefix_len=1600),
            Request(1, 40, 8), Request(2, 1650, 8, prefix_key=9, prefix_len=1600),
            Request(3, 1610, 8, prefix_key=9, prefix_len=1600)]
    state = submit(init_state(), cfg, reqs)
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks == (Chunk(9, 0, 1024),) and plan.stop == "chunk"
    state = apply_prefill(state, plan)
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks == (Chunk(9, 1024, 576),) and plan.stop == "prefix" and plan.num_tokens == 576
    state = apply_prefill(state, plan)
    assert state.held == ((9, 9),) and not state.running and state.chunked is None
    plan = plan_prefill(state, cfg, free_pages=1024 - 100)
    assert plan.chunks == (Chunk(0, 1600, 100, prefix=9), Chunk(1, 0, 40), Chunk(2, 1600, 50, prefix=9))
    assert plan.stop == "slots" and plan.num_tokens == 190 and plan.unhold == ()
    assert plan.kv_reserved == (1712 - 1600) + 48 + (1664 - 1600)  # prefix pages held in common
    state = apply_prefill(state, plan)
    assert [(r.rid, r.prefilled) for r in state.running] == [(0, 1700), (1, 40), (2, 1650)]
    state = dataclasses.replace(state, running=())  # they finished
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert plan.chunks == (Chunk(3, 1600, 10, prefix=9),) and plan.unhold == (9,)
    assert apply_prefill(state, plan).held == ()
    plan = plan_prefill(let_go(state)[0], cfg, free_pages=1024)
    assert plan.chunks == (Chunk(3, 0, 1024),) and plan.truncated == 3
    with pytest.raises(ValueError, match="prefix_len must be in"):
        Request(4, 100, 8, prefix_key=9, prefix_len=100)


def test_stops_at_first_request_that_does_not_fit():
    cfg = cfg_(num_pages=256)
    # free 64 pages = 1024 tokens: request 1 (2000 + 8) cannot fit, request 2 could.
    plan = plan_prefill(queued(cfg, 100, 2000, 10), cfg, free_pages=64)
    assert plan.chunks == (Chunk(0, 0, 100),)
    assert plan.stop == "kv"


def test_kv_reserves_remaining_max_new_tokens_of_running():
    cfg = cfg_(num_pages=128)
    state = submit(init_state(), cfg, [Request(0, 16, 1000)])  # footprint 1016 -> 64 pages
    state = apply_prefill(state, plan_prefill(state, cfg, 128))
    held = 1  # 16 tokens prefilled = 1 page; 63 pages still reserved for its decode
    assert reserved_tokens(state, cfg) == 63 * 16
    state = submit(state, cfg, [Request(1, 1000, 40)])  # needs 65 pages: 127 free, 63 promised
    plan = plan_prefill(state, cfg, free_pages=128 - held)
    assert plan.chunks == () and plan.stop == "kv"
    assert plan.kv_budget == 64 * 16
    state = submit(dataclasses.replace(state, waiting=()), cfg, [Request(2, 1000, 8)])
    plan = plan_prefill(state, cfg, free_pages=128 - held)
    assert plan.chunks == (Chunk(2, 0, 1000),) and plan.kv_reserved == 63 * 16


def test_chunked_request_does_not_need_kv_again():
    cfg = cfg_(num_pages=256)
    state = queued(cfg, 3000)
    state = apply_prefill(state, plan_prefill(state, cfg, 256))
    # free pages = 256 - 64 held; everything left is the chunked request's reservation
    plan = plan_prefill(state, cfg, free_pages=256 - 64)
    assert plan.chunks == (Chunk(0, 1024, 1024),)


def test_kv_budget_is_never_negative():
    cfg = cfg_(num_pages=128)
    state = submit(init_state(), cfg, [Request(0, 16, 1000)])
    state = apply_prefill(state, plan_prefill(state, cfg, 128))
    plan = plan_prefill(submit(state, cfg, [Request(1, 1, 1)]), cfg, free_pages=10)
    assert plan.kv_budget == 0 and plan.chunks == ()


def test_slots_limit():
    cfg = cfg_(max_running_requests=2)
    plan = plan_prefill(queued(cfg, 10, 10, 10), cfg, free_pages=1024)
    assert len(plan.chunks) == 2 and plan.stop == "slots"


def test_fcfs_uses_arrival_then_submission_order():
    cfg = cfg_()
    state = submit(init_state(), cfg, [Request(5, 10, 1)])
    state = dataclasses.replace(state, pass_id=3)
    state = submit(state, cfg, [Request(1, 10, 1), Request(9, 10, 1)])
    plan = plan_prefill(state, cfg, free_pages=1024)
    assert [c.rid for c in plan.chunks] == [5, 1, 9]


def test_finish_pass_decodes_and_retires():
    cfg = cfg_()
    state = queued(cfg, 10, 10, max_new=2)
    state = apply_prefill(state, plan_prefill(state, cfg, 1024))
    plan = PassPlan((), (0, 1), Decision(True, "none", 0), plan_prefill(state, cfg, 1024))
    state, done = finish_pass(state, plan, finished=[1])  # rid 1 hit EOS
    assert [r.rid for r in done] == [1] and state.running[0].generated == 1
    state, done = finish_pass(state, plan)
    assert [r.rid for r in done] == [0] and state.running == () and state.pass_id == 2


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(num_pages=0), "num_pages"),
        (dict(page_size=0), "page_size"),
        (dict(chunk_size=64, dp_size=8), "chunk_size"),
        (dict(max_prefill_tokens=8), "max_prefill_tokens"),
        (dict(max_running_requests=0), "max_running_requests"),
        (dict(max_delay_passes=-1), "max_delay_passes"),
        (dict(policy="lpm"), "policy"),
        (dict(token_usage_low_watermark=1.5), "token_usage_low_watermark"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        cfg_(**kw)


def test_submit_rejects_requests_that_can_never_fit_and_duplicates():
    cfg = cfg_(num_pages=16)  # 256 tokens
    with pytest.raises(ValueError, match="num_pages"):
        submit(init_state(), cfg, [Request(0, 250, 10)])
    state = submit(init_state(), cfg, [Request(0, 10, 10)])
    with pytest.raises(ValueError, match="rid"):
        submit(state, cfg, [Request(0, 10, 10)])
    with pytest.raises(ValueError, match="input_len"):
        Request(1, 0, 10)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(1, 10, 0)
