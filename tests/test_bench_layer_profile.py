"""Per-kernel profiles (mimo_fn.bench.layer_profile) and `python -m mimo_fn.bench prefill
--profile-layers` on the tiny model: kernels by name, by record_function range, the table, and the
per-layer-type report with its JSON rows. On the CPU a "kernel" is a torch op (its self time), so
the code path the GPU run takes is the one tested here, the launch-to-kernel link aside."""

import json

import pytest
import torch
from torch.profiler import record_function

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.bench import cli, layer_profile, prefill, results
from mimo_fn.bench.workload import timed_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def one_thread():
    """Torch on one thread: the ops are tiny, and on a loaded machine threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mats(n=3, size=96):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(size, size, generator=g).to(DEVICE) for _ in range(n)]


def test_kernel_ms_names_the_ops_of_two_matmuls(one_thread):
    a, b, c = _mats()
    rows = layer_profile.kernel_ms(lambda: (a @ b) @ c, warmup=1, iters=2)
    assert rows and all(ms >= 0 for _, _, ms in rows)
    assert [ms for _, _, ms in rows] == sorted((ms for _, _, ms in rows), reverse=True)
    assert sum(ms for _, _, ms in rows) > 0
    if DEVICE == "cpu":
        calls = {name: n for name, n, _ in rows}
        assert calls["aten::mm"] == 2 and calls["aten::matmul"] == 2  # per call of fn, not per profile
    else:  # the GEMM kernels, two a call
        assert sum(n for _, n, _ in rows) >= 2
    with pytest.raises(ValueError, match="expected warmup >= 0 and iters >= 1"):
        layer_profile.kernel_ms(lambda: None, iters=0)


def test_ranged_kernel_ms_splits_by_range_and_averages_a_group(one_thread):
    a, b, c = _mats()

    def fn():
        with record_function("one"):
            a @ b
        for name in ("two_a", "two_b"):  # two ranges of one group, each with two GEMMs and an add
            with record_function(name):
                (a @ b) @ c + a
        return a @ c  # in no range: counted nowhere

    prof = layer_profile.ranged_kernel_ms(fn, {"one": ["one"], "two": ["two_a", "two_b"]}, warmup=1, iters=2)
    one, two = prof["one"], prof["two"]
    assert (one.num_ranges, two.num_ranges) == (1, 2)
    assert one.busy_ms > 0 and two.busy_ms > 0 and two.span_ms >= 0
    assert two.busy_ms == pytest.approx(sum(ms for _, _, ms in two.rows))
    if DEVICE == "cpu":
        assert {n: c for n, c, _ in one.rows}["aten::mm"] == 1
        calls = {n: c for n, c, _ in two.rows}
        assert calls["aten::mm"] == 2 and calls["aten::add"] == 1  # per range, not per group
    with pytest.raises(ValueError, match="range 'three' of group 'x' never opened"):
        layer_profile.ranged_kernel_ms(fn, {"x": ["three"]}, warmup=0, iters=1)


def test_format_table_totals_shares_and_folds_the_tail():
    rows = [("k" * 80, 2, 3.0), ("b", 1, 1.0)]
    text = layer_profile.format_table(rows, "title")
    lines = text.splitlines()
    assert lines[0] == "title" and lines[1].split() == ["kernel", "calls", "ms", "share"]
    assert lines[2].startswith("k" * 60 + " ") and lines[2].split()[1:] == ["2", "3.000", "75.0%"]
    assert lines[-1].split() == ["total", "3", "4.000", "100.0%"]
    folded = layer_profile.format_table([(f"k{i}", 1, 1.0) for i in range(5)], "t", max_rows=3).splitlines()
    assert folded[-3].split() == ["(3", "others)", "3", "3.000", "60.0%"] and folded[-1].split()[1:3] == ["5", "5.000"]


def test_layer_ranges_are_off_unless_asked_and_change_no_logits(one_thread):
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=0, dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16, device=DEVICE)
    assert not options.current().layer_ranges
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, plain, _ = timed_prefill(cfg, params, [20], 8)
    assert not any(layer_profile._is_range(ev) and ev.name.startswith("layer") for ev in prof.events())
    with options.override(layer_ranges=True), profile(activities=[ProfilerActivity.CPU]) as prof:
        _, ranged, _ = timed_prefill(cfg, params, [20], 8)
    opened = [ev.name for ev in prof.events() if layer_profile._is_range(ev)]  # torch 2.11 has no activity_type
    assert sorted(set(opened)) == [f"layer{i}" for i in range(cfg.num_layers)] and len(opened) == 3 * cfg.num_layers
    assert torch.equal(plain, ranged)


def test_profile_layers_prints_a_table_per_moe_layer_type(tmp_path, one_thread):
    """What main runs per weight format with --profile-layers, from the bench's own parser, on the tiny
    model (layers: full dense, SWA MoE x2, full MoE); main itself needs a GPU and the slice."""
    argv = ["--profile-layers", "--chunk", "16", "--extrapolate-isl", "40", "--json", str(tmp_path / "rows.jsonl")]
    args = cli.bench_parser("prefill").parse_args(argv)
    assert args.profile_layers
    args.mesh = None  # main's init_mesh(): one device
    run = results.start("prefill", args, argv)
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=0, dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16, device=DEVICE)
    text = prefill.layer_report(args, run, cfg, params, "fp32")
    print(text)
    swa, full = text.split("\n\n")
    assert swa.startswith("[fp32] one SWA MoE layer (mean of layers 1, 2), 1 x 40 tokens in chunks of 16")
    assert full.startswith("[fp32] one full MoE layer (layer 3), 1 x 40 tokens in chunks of 16")
    for table in (swa, full):
        total = next(line for line in table.splitlines() if line.startswith("total")).split()
        assert float(total[2]) > 0 and total[3] == "100.0%" and int(total[1]) > 0
        assert "under the profiler: kernels" in table and "without it:" in table
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["params"]["layer_type"] for r in rows] == ["SWA MoE layer", "full MoE layer"]
    for r in rows:
        res = r["results"]
        assert r["params"]["isl"] == 40 and res["busy_ms"] > 0 and res["span_ms"] > 0
        assert res["busy_ms"] == pytest.approx(sum(res["kernels_ms"].values()))
