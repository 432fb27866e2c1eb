"""scripts/gpu_tests.py's record: what ran on a code version is kept, skipped by the next call, and
a budget stops a run between tests (the resumable GPU suite of issue 43)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the plugin first, then what the environment has (on the device: where the carried wheels are)
SCRIPTS_PATH = os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))
SPEC = importlib.util.spec_from_file_location("gpu_tests", ROOT / "scripts" / "gpu_tests.py")
gpu_tests = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_tests)

TESTS = """
import time, pytest
def test_a(): time.sleep(0.2)
def test_b(): pytest.skip("no")
def test_c(): assert 1 == 2
"""


def _pytest(tmp_path: Path, record: Path, budget: str = "") -> tuple[int, list[dict]]:
    # none of the GPU_TESTS_* of a gpu_tests.py run this test may itself be part of (its record, start time)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TESTS_")}
    env.update(GPU_TESTS_RECORD=str(record), GPU_TESTS_CODE="c1", GPU_TESTS_BUDGET=budget, PYTHONPATH=SCRIPTS_PATH)
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_tests",
                          "test_three.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return rc, rows


def test_a_run_records_each_outcome_and_the_next_skips_them(tmp_path):
    (tmp_path / "test_three.py").write_text(TESTS)
    record = tmp_path / "record.jsonl"
    rc, rows = _pytest(tmp_path, record)
    assert rc == 1
    assert [(r["test"], r["outcome"], r["code"]) for r in rows] == [
        ("test_three.py::test_a", "passed", "c1"), ("test_three.py::test_b", "skipped", "c1"),
        ("test_three.py::test_c", "failed", "c1")]
    assert rows[0]["seconds"] >= 0.2
    rc, again = _pytest(tmp_path, record)
    assert rc == 5 and again == rows  # nothing left at c1: no test ran, nothing appended
    assert set(gpu_tests.recorded(record, "c1")) == {r["test"] for r in rows}
    assert gpu_tests.recorded(record, "c2") == {}  # other code runs everything again


def test_a_spent_budget_stops_between_tests(tmp_path):
    (tmp_path / "test_three.py").write_text(TESTS)
    record = tmp_path / "record.jsonl"
    rc, rows = _pytest(tmp_path, record, budget="0")
    assert rc == 2 and [r["test"] for r in rows] == ["test_three.py::test_a"]  # interrupted after the first
    rc, rows = _pytest(tmp_path, record, budget="0")
    assert rc == 2 and [r["test"] for r in rows] == ["test_three.py::test_a", "test_three.py::test_b"]


def test_workers_record_each_test_once_and_the_next_run_skips_them(tmp_path):
    """--workers: under pytest-xdist the controller writes the rows (the workers' own reports would
    double them), and every worker leaves out what the record held when the run began."""
    pytest.importorskip("xdist")
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(TESTS)
    record = tmp_path / "record.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TESTS_")}
    env.update(GPU_TESTS_RECORD=str(record), GPU_TESTS_CODE="c1", GPU_TESTS_BUDGET="0", GPU_TESTS_DONE=str(record),
               PYTHONPATH=SCRIPTS_PATH)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_tests", "-n", "2",
           "--dist", "loadfile", "test_one.py", "test_two.py"]
    rc = subprocess.call(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)  # spent: each worker stops after one
    assert rc == 2 and sorted(json.loads(line)["test"] for line in record.read_text().splitlines()) == [
        "test_one.py::test_a", "test_two.py::test_a"]
    env["GPU_TESTS_BUDGET"] = ""
    rc = subprocess.call(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert rc == 1 and sorted((r["test"], r["outcome"]) for r in rows) == sorted(
        (f"{f}::{t}", o) for f in ("test_one.py", "test_two.py")
        for t, o in (("test_a", "passed"), ("test_b", "skipped"), ("test_c", "failed")))
    rc = subprocess.call(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    assert rc == 5 and len(record.read_text().splitlines()) == 6  # all recorded: nothing ran again


def test_status_names_the_files_not_run(tmp_path, capsys):
    record = tmp_path / "record.jsonl"
    record.write_text(json.dumps({"code": "c1", "test": "tests/test_flops.py::x", "outcome": "passed",
                                  "seconds": 1.5}) + "\n")
    assert gpu_tests.status(record, "c1") == 1  # the other files have not run
    out = capsys.readouterr().out
    assert "| tests/test_flops.py | 1 | 0 | 0 | 2 |" in out and "| tests/test_options.py | not run |" in out


def test_the_code_version_follows_the_code_not_the_docs(tmp_path):
    from mimo_fn.bench.results import code_version

    for d in ("mimo_fn", "tests", "scripts", "examples", "docs"):
        (tmp_path / d).mkdir()
    (tmp_path / "pyproject.toml").write_text("[project]")
    (tmp_path / "mimo_fn" / "a.py").write_text("x = 1")
    v = code_version(tmp_path)
    (tmp_path / "docs" / "gpu_tests.jsonl").write_text("{}")
    (tmp_path / "mimo_fn" / "__pycache__").mkdir()
    (tmp_path / "mimo_fn" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    assert code_version(tmp_path) == v
    (tmp_path / "mimo_fn" / "a.py").write_text("x = 2")
    assert code_version(tmp_path) != v


def test_workers_get_the_longest_files_first(tmp_path):
    """Under --workers the files go out by the record's last seconds for each (any code), longest
    first, and the files it has no time for before them."""
    record = tmp_path / "record.jsonl"
    rows = [("tests/test_a.py::x", "c0", 5.0), ("tests/test_b.py::x", "c0", 1.0), ("tests/test_b.py::y", "c1", 9.0),
            ("tests/test_a.py::x", "c1", 2.0)]  # b: 1 + 9 = 10 s, a: its last run's 2 s
    record.write_text("".join(json.dumps({"test": t, "code": c, "outcome": "passed", "seconds": sec}) + "\n"
                              for t, c, sec in rows))
    files = [ROOT / "tests" / n for n in ("test_a.py", "test_b.py", "test_new.py")]
    assert [f.name for f in gpu_tests.longest_first(files, record)] == ["test_new.py", "test_b.py", "test_a.py"]
    assert gpu_tests.longest_first(files, None) == files
