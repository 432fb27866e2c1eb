"""The benchmarks' entry point (`python -m mimo_fn.bench`) and scripts/ as a user meets them.

Every benchmark and script answers --help with each option's help and default; one that needs a
GPU, run without one, exits non-zero with one line and no traceback; a CPU benchmark records its
results as JSON rows that `table` prints. The subprocesses (what a user types) start together in
one fixture; the per-benchmark checks use the parsers in-process.
"""

import json
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mimo_fn.bench import cli, results, timing

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
GPU_SCRIPTS = [p for p in SCRIPTS if p.name.startswith("check_")]  # the others run on the CPU (gpu_tests.py runs pytest)
BENCHES = [name for name in cli.BENCHES if name not in ("table", "plot")]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")  # no GPU, whatever the machine has
    env.pop("WORLD_SIZE", None)
    return env


# what a user types, as subprocesses; the rest of the benchmarks and scripts run in-process below
COMMANDS = {
    "top help": [sys.executable, "-m", "mimo_fn.bench", "--help"],
    "attention help": [sys.executable, "-m", "mimo_fn.bench", "attention", "--help"],
    "attention without a GPU": [sys.executable, "-m", "mimo_fn.bench", "attention", "--tokens", "128"],
    "prefill.py help": [sys.executable, str(ROOT / "scripts" / "prefill.py"), "--help"],
    "check_gpu_engine.py without a GPU": [sys.executable, str(ROOT / "scripts" / "check_gpu_engine.py")],
}


@pytest.fixture(scope="module")
def ran() -> dict:
    """Every command of COMMANDS, started at once: name -> (exit code, stdout, stderr)."""
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, cmd in COMMANDS.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _one_line_gpu_error(rc: int, stdout: str, stderr: str) -> None:
    assert rc != 0, stdout + stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], stderr


def test_top_level_help_lists_every_benchmark(ran, capsys):
    rc, stdout, _ = ran["top help"]
    assert rc == 0
    for name in cli.BENCHES:
        assert f"  {name} " in stdout, name
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2 and capsys.readouterr().out.startswith("usage: python -m mimo_fn.bench <what>")
    with pytest.raises(SystemExit) as e:
        cli.main(["nonesuch"])
    assert e.value.code == 2 and "unknown benchmark 'nonesuch'" in capsys.readouterr().err


def test_subcommand_help_runs_as_a_user_types_it(ran):
    rc, stdout, stderr = ran["attention help"]
    assert rc == 0, stderr
    assert stdout.startswith("usage: python -m mimo_fn.bench attention")
    for opt in ("--tokens", "--page-size", "--sweep", "--json"):
        assert opt in stdout
    assert "(default: [8192, 32768, 65536])" in " ".join(stdout.split())


def test_gpu_only_bench_without_a_gpu_says_so_in_one_line(ran):
    _one_line_gpu_error(*ran["attention without a GPU"])
    _one_line_gpu_error(*ran["check_gpu_engine.py without a GPU"])


def _run_script(path: Path, argv: list[str]):
    """The script's __main__ in this process; returns its SystemExit code."""
    sys_argv = sys.argv
    sys.argv = [path.name, *argv]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = sys_argv
    return e.value.code


def _options_section(text: str) -> list[str]:
    """The option strings listed under "options:" of a --help text."""
    body = text.split("\noptions:\n", 1)[1]
    return [w.rstrip(",") for line in body.splitlines() for w in line.split()[:3] if w.startswith("--")]


@pytest.mark.parametrize("script", [p.name for p in SCRIPTS])
def test_script_help_names_its_options_with_defaults(ran, script, capsys):
    if script == "prefill.py":  # as a subprocess too
        rc, stdout, stderr = ran["prefill.py help"]
        assert rc == 0 and stdout.startswith("usage: prefill.py"), stderr
    assert _run_script(ROOT / "scripts" / script, ["--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {script}")
    options = [o for o in _options_section(text) if o != "--help"]
    assert options, text
    assert " ".join(text.split()).count("(default:") >= len(options), f"{script}: an option shows no default"


@pytest.mark.parametrize("script", [p.name for p in GPU_SCRIPTS])
def test_gpu_script_without_a_gpu_says_so_in_one_line(script, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = _run_script(ROOT / "scripts" / script, [])
    assert code == f"{script}: needs a CUDA GPU (none is visible to torch)" or (
        code == f"{script}: needs a CUDA GPU per rank (none is visible to torch)")


def test_bench_with_device_cuda_without_a_gpu_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--device", "cuda"])
    assert str(e.value.code).startswith("--device cuda needs a CUDA GPU") and "\n" not in str(e.value.code)


@pytest.mark.parametrize("name", list(cli.BENCHES))
def test_every_option_has_help_and_a_shown_default(name):
    mod = cli.module(name)
    ap = cli.bench_parser(name, mod)
    text = ap.format_help()
    assert text.startswith(f"usage: python -m mimo_fn.bench {name}")
    assert mod.__doc__ and mod.__doc__.strip().splitlines()[0] in text
    optional = [a for a in ap._actions if a.option_strings and a.dest != "help"]
    for action in optional:
        assert action.help and action.help.strip(), f"{name} {action.option_strings} has no help"
        assert action.option_strings[0] in text
    # a required option has no default to show (it printed "(default: None)")
    assert text.count("(default:") >= len([a for a in optional if not a.required]), \
        f"{name}: an option does not show its default"
    if name not in ("table", "plot"):
        assert "--json" in text and "--output-file" in text
        assert isinstance(mod.NEEDS_CUDA, bool)


@pytest.mark.parametrize("name", [n for n in BENCHES if cli.module(n).NEEDS_CUDA])
def test_gpu_only_benches_stop_before_any_work(name, monkeypatch):
    """In-process, for every GPU-only benchmark: SystemExit with one line naming it, raised after
    the options are parsed (so --help still works) and before its main runs."""
    mod = cli.module(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mod, "main", lambda *a: pytest.fail(f"{name}: main ran without a GPU"))
    required = {"mesh-decode": ["--dp", "1", "--tp", "1", "--ep", "1"],
                "mesh-generate": ["--dp", "1", "--tp", "1", "--ep", "1"]}.get(name, [])
    with pytest.raises(SystemExit) as e:
        cli.main([name, *required])
    msg = str(e.value.code)
    assert msg.endswith("needs a CUDA GPU (none is visible to torch)") and name in msg and "\n" not in msg


def test_a_cpu_bench_records_json_rows_and_prints_a_table(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("")  # rows are appended to what is there
    cli.main(["host", "--batch", "1", "3", "--steps", "4", "--prompt", "8", "--repeats", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-3].split() == ["B", "ms", "per", "step", "best", "s"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["params"]["batch"] for r in rows] == [1, 3]
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"  # where the bench ran
    for r in rows:
        assert set(r) == {"bench", "commit", "code", "device", "date", "command", "params", "results"}
        assert r["bench"] == "host" and r["commit"] and len(r["code"]) == 12 and r["device"].startswith(machine)
        assert r["command"] == "python -m mimo_fn.bench host --batch 1 3 --steps 4 --prompt 8 --repeats 1"
        assert r["params"]["steps"] == 4 and r["params"]["prompt"] == 8
        assert 0 < r["results"]["ms_per_step"] < 60_000
        assert r["results"]["seconds"] == pytest.approx(r["results"]["ms_per_step"] * 4 / 1e3)

    cli.main(["table", str(path)])
    md = capsys.readouterr().out.splitlines()
    assert md[0] == "| batch | ms_per_step | seconds |" and md[1] == "|---|---|---|"
    assert md[2].startswith("| 1 |") and md[3].startswith("| 3 |")
    assert "`python -m mimo_fn.bench host --batch 1 3" in md[5]


def test_host_bench_times_verify_steps_with_drafts(tmp_path):
    """--drafts K: every step verifies K random drafts against random logits, which keep almost
    none: about one verify step a new token, and ms per step is per verify step."""
    path = tmp_path / "rows.jsonl"
    cli.main(["host", "--batch", "2", "--steps", "12", "--prompt", "8", "--repeats", "1", "--drafts", "3",
              "--json", str(path)])
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["params"]["drafts"] == 3
    steps = row["results"]["seconds"] * 1e3 / row["results"]["ms_per_step"]
    assert 3 < round(steps) <= 12  # spec_stats' verify steps: each keeps at least one token, at most 4


def test_serve_bare_runs_several_cases_in_one_process(tmp_path):
    """serve-bare's per-case lists (one value stands for all), each case a row; a mismatch is named."""
    path = tmp_path / "rows.jsonl"
    cli.main(["serve-bare", "--device", "cpu", "--num-prompts", "2", "3", "--input-len", "24", "--output-len", "2",
              "--repeats", "1", "--max-running-requests", "2", "--json", str(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["params"]["num_prompts"], r["params"]["input_len"], r["params"]["max_running"]) for r in rows] == [
        (2, 24, 2), (3, 24, 2)]
    for r in rows:
        assert r["results"]["input_tok_s"] == pytest.approx(r["params"]["num_prompts"] * 24 / r["results"]["seconds"])
    with pytest.raises(ValueError, match="expected one or 3 each"):
        cli.main(["serve-bare", "--device", "cpu", "--num-prompts", "1", "2", "3", "--input-len", "8", "9"])


def test_read_rows_names_a_bad_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"bench": "x", "params": {}, "results": {}}\n\nnot json\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:3: not a JSON row"):
        results.read_rows(str(path))
    path.write_text('{"bench": "x"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: expected a row with bench, params and results"):
        results.read_rows(str(path))


def test_rows_hold_plain_json(tmp_path):
    run = results.Run("x", "abc", "cpu", "2026-01-01 00:00 UTC", "python -m mimo_fn.bench x", {"a": 1},
                      str(tmp_path / "r.jsonl"))
    row = results.record(run, {"nan": float("nan"), "t": torch.tensor(2.5), "dtype": torch.bfloat16}, a=2, b=(1, 2))
    assert row["params"] == {"a": 2, "b": [1, 2]}
    assert row["results"] == {"nan": None, "t": 2.5, "dtype": "torch.bfloat16"}
    assert json.loads((tmp_path / "r.jsonl").read_text()) == row


def test_time_ms_on_the_cpu():
    ms = timing.time_ms(lambda: time.sleep(0.003), iters=5, warmup_iters=1, device="cpu")
    assert 3 <= ms < 1000
    calls = []
    ms = timing.time_ms(lambda: calls.append(time.sleep(0.001)), warmup_ms=2, rep_ms=10, stat="min", device="cpu")
    assert 1 <= ms < 1000 and len(calls) >= 2  # sized from the first call: some warm-up and repetitions
    with pytest.raises(ValueError, match="stat must be one of"):
        timing.time_ms(lambda: None, iters=1, stat="p99", device="cpu")
    seconds, out = timing.wall_s(lambda: (time.sleep(0.002), 7)[1])
    assert out == 7 and seconds >= 0.002


def test_plot_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"bench": "host", "commit": "c", "device": "cpu", "date": "d", "command": "x",
                                "params": {"batch": 1}, "results": {"ms": 1.0}}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", str(path), "--bench", "host", "--x", "batch", "--y", "ms", "--out", str(tmp_path / "p.png")])
    assert str(e.value.code) == "plotting needs matplotlib, which is not installed (pip install matplotlib)"


def test_scripts_have_no_path_preamble():
    for p in SCRIPTS:
        assert "sys.path.insert(0, str(Path(__file__)" not in p.read_text(), p.name
    assert not list((ROOT / "scripts").glob("bench_*.py"))

