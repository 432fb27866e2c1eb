"""Run the test suite on a GPU machine within device calls of ~10 minutes, resuming where the last stopped.

    cp docs/gpu_tests.jsonl $OUT/ && python scripts/gpu_tests.py --budget 450 --record $OUT/gpu_tests.jsonl  # one call
    python scripts/gpu_tests.py --status --record docs/gpu_tests.jsonl       # per file: run on this code?
    python scripts/gpu_tests.py --shard 1/3 --junit $OUT/shard1.xml             # a fixed third of the files
    python scripts/gpu_tests.py --workers 4 --budget 450 --record $OUT/gpu_tests.jsonl  # 4 pytest-xdist workers
    python scripts/gpu_tests.py --list                                          # the shards, without running them

Every test runs with RuntimeWarnings as errors, slow ones included, in one pytest process, or with
--workers N in N pytest-xdist workers that share the GPU, a test file to a worker (--dist loadfile:
a file's module fixtures, e.g. its server process, start once; the longest files first, by the
record's earlier times), the files of ALONE after them, each worker's torch on its share of the
cores. Many tests are CPU-bound (server processes, gloo meshes, reference paths), and a GPU machine
has 16 cores or more where one pytest uses about one: workers cover more of the suite per device
call. xdist is not in the device's image: carry its wheels (pytest-xdist, execnet).

--record FILE keeps one JSON line per test run (code version, test id, outcome, seconds). A run
skips the tests FILE holds for this code (results.code_version: a hash of the code's files, so
docs/ may change), and --budget S stops starting tests once S seconds have passed since the script
started (imports and collection included), so that calls made one after another on the same code cover
the suite: copy FILE back from the device into the checkout between calls. Keep FILE under the device's
$OUT, so that what ran comes back even when the call's time limit kills the run, and leave the limit
room for the longest test past the budget (some take over a minute: a budget of the limit less
150 s). --status prints per test file what FILE holds for this code, and the files it holds
nothing for. A run the budget stopped exits with 2 (pytest's "interrupted"): more tests remain.

--shard i/n deals test files to n shards by their size in lines (a stand-in for their running
time that needs no earlier run), largest first, each to the lightest shard so far.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# With --workers these run after the parallel pass, in one process of their own: they measure the
# device's free memory (torch.cuda.mem_get_info), which other workers' allocations would move.
ALONE = {"test_rl_memory.py", "test_rl_vmm.py"}


def shards(n: int, files: list[Path]) -> list[list[Path]]:
    """files dealt into n shards of about equal total size."""
    out, load = [[] for _ in range(n)], [0] * n
    for f in sorted(files, key=lambda f: (-len(f.read_text().splitlines()), f.name)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += len(f.read_text().splitlines())
    return [sorted(s) for s in out]


def recorded(path: Path, code: str) -> dict[str, dict]:
    """test id -> its last row in the record for code version `code` (none where the file is missing)."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["code"] == code:
                rows[row["test"]] = row
    return rows


def longest_first(files: list[Path], path: Path | None) -> list[Path]:
    """files ordered by the seconds the record last took for each (any code version), longest first,
    those it has no time for ahead of all: pytest-xdist hands files out in this order, so the long
    ones start first instead of running alone at the end of the budget."""
    seconds: dict[str, dict[str, float]] = defaultdict(dict)
    if path is not None and path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            seconds[row["test"].split("::")[0]][row["test"]] = row["seconds"]  # its last run's
    known = {name: sum(tests.values()) for name, tests in seconds.items()}
    return sorted(files, key=lambda f: -known.get(f"tests/{f.name}", float("inf")))


class Recorder:
    """A pytest plugin (this module, loaded by `-p gpu_tests` in the pytest process, configured by
    the GPU_TESTS_* variables main sets): drops the tests already recorded for this code, appends
    each test's outcome as it ends, and stops the session once the budget is spent. Under xdist
    every worker drops the same tests (those of GPU_TESTS_DONE, the record as it was when the run
    began, so that all workers collect alike) and stops itself once the budget is spent; only the
    controller, which sees every worker's reports, writes rows."""

    def __init__(self, path: Path, code: str, budget: float | None, done: Path | None = None, writes: bool = True):
        self.path, self.code, self.budget, self.writes = path, code, budget, writes
        self.done = recorded(done or path, code)
        self.t0 = float(os.environ.get("GPU_TESTS_T0") or time.time())  # when main started
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}
        self.session = None

    def pytest_sessionstart(self, session):
        self.session = session

    @pytest.hookimpl(trylast=True)  # after -k / -m have deselected theirs
    def pytest_collection_modifyitems(self, config, items):
        kept = [it for it in items if it.nodeid not in self.done]
        dropped = [it for it in items if it.nodeid in self.done]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        print(f"\ngpu_tests: {len(dropped)} tests recorded for code {self.code} already, {len(kept)} to run", flush=True)

    def pytest_runtest_logreport(self, report):
        if not self.writes:
            return
        self.seconds[report.nodeid] += report.duration
        if report.failed:
            self.outcome[report.nodeid] = "error" if report.when != "call" else "failed"
        elif report.skipped:
            self.outcome.setdefault(report.nodeid, "skipped")
        if report.when == "teardown":
            row = {"code": self.code, "test": report.nodeid, "outcome": self.outcome.get(report.nodeid, "passed"),
                   "seconds": round(self.seconds[report.nodeid], 2)}
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.budget is not None and time.time() - self.t0 > self.budget:
            self.session.shouldstop = f"gpu_tests: the budget of {self.budget:.0f} s is spent"


def pytest_configure(config):
    """The pytest side: registers a Recorder when main asked for one (an xdist worker's writes nothing)."""
    if os.environ.get("GPU_TESTS_RECORD"):
        budget, done = os.environ.get("GPU_TESTS_BUDGET"), os.environ.get("GPU_TESTS_DONE")
        config.pluginmanager.register(Recorder(Path(os.environ["GPU_TESTS_RECORD"]), os.environ["GPU_TESTS_CODE"],
                                               float(budget) if budget else None, Path(done) if done else None,
                                               writes=not hasattr(config, "workerinput")), "gpu_tests_recorder")


def status(path: Path, code: str) -> int:
    """Per test file: the record's outcomes for this code; 1 while a file has none or a test failed."""
    rows = recorded(path, code)
    by_file: dict[str, Counter] = defaultdict(Counter)
    seconds: dict[str, float] = defaultdict(float)
    for test, row in rows.items():
        name = test.split("::")[0]
        by_file[name][row["outcome"]] += 1
        seconds[name] += row["seconds"]
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py"))
    print(f"| file | passed | failed | skipped | seconds |  (record {path}, code {code})")
    for name in files:
        c = by_file.get(name)
        print(f"| {name} | " + (f"{c['passed']} | {c['failed'] + c['error']} | {c['skipped']} | {seconds[name]:.0f} |"
                                if c else "not run | | | |"))
    bad = [n for n in files if n not in by_file or by_file[n]["failed"] + by_file[n]["error"]]
    print(f"{len(files) - len(bad)} of {len(files)} files run with no failure on code {code}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="1/1", help="i/n: run the i-th of n shards (default: %(default)s, all)")
    ap.add_argument("--list", action="store_true", help="print every shard's files and exit (default: off, run the shard)")
    ap.add_argument("--record", default=None, type=Path,
                    help="JSONL of test outcomes: skip what it holds for this code, append what runs (default: none)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no new test starts (default: none, run them all)")
    ap.add_argument("--status", action="store_true", help="print what --record holds for this code and exit (default: off, run tests)")
    ap.add_argument("--junit", default=None, help="also write pytest's JUnit XML here (default: none)")
    ap.add_argument("--workers", type=int, default=0,
                    help="run the tests in this many pytest-xdist workers, a file to each (default: 0, one process)")
    ap.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = ap.parse_args()
    t0 = time.time()
    try:
        i, n = (int(x) for x in args.shard.split("/"))
    except ValueError:
        ap.error(f"--shard {args.shard!r}: expected i/n, e.g. 2/3")
    if not 1 <= i <= n:
        ap.error(f"--shard {args.shard}: expected 1 <= i <= n")
    if (args.status or args.budget is not None) and args.record is None:
        ap.error("--status and --budget need --record FILE (where the outcomes are kept between calls)")
    from mimo_fn.bench.results import code_version  # here, not at the top: pytest imports this module too

    code = code_version()
    if args.status:
        return status(args.record, code)
    groups = shards(n, list((ROOT / "tests").glob("test_*.py")))
    if args.list:
        for k, g in enumerate(groups, 1):
            print(f"{k}/{n}: " + " ".join(f.name for f in g))
        return 0
    files = groups[i - 1]
    passes = [files]  # each a pytest process, one after the other
    if args.workers:
        if importlib.util.find_spec("xdist") is None:
            ap.error("--workers needs pytest-xdist (pip install pytest-xdist; on the device carry its wheel and execnet's)")
        files = longest_first(files, args.record)
        passes = [[f for f in files if f.name not in ALONE], [f for f in files if f.name in ALONE]]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if args.record is not None:  # the Recorder runs in pytest's process: this module, found on PYTHONPATH
            args.record.parent.mkdir(parents=True, exist_ok=True)
            done = Path(tmp) / "done.jsonl"  # the record as it is now: what every worker leaves out
            done.write_text(args.record.read_text() if args.record.exists() else "")
            print(f"gpu_tests: {len(recorded(done, code))} tests recorded for code {code} already", flush=True)
            env.update(GPU_TESTS_RECORD=str(args.record.resolve()), GPU_TESTS_CODE=code, GPU_TESTS_T0=repr(t0),
                       GPU_TESTS_DONE=str(done), GPU_TESTS_BUDGET="" if args.budget is None else str(args.budget),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), env.get("PYTHONPATH")])))
        rcs = []
        for k, group in enumerate(p for p in passes if p):
            cmd = [sys.executable, "-m", "pytest", "-q", "-W", "error::RuntimeWarning", "-p", "no:cacheprovider",
                   "-rfEs", *map(str, group), *args.pytest_args]
            if args.record is not None:
                cmd[3:3] = ["-p", "gpu_tests"]
            if args.junit:
                cmd.append(f"--junitxml={args.junit}" if k == 0 else f"--junitxml={args.junit}.alone.xml")
            run_env = env
            if args.workers and group is passes[0]:
                cmd += ["-n", str(args.workers), "--dist", "loadfile"]
                # each worker's torch would take every core for its CPU ops: N workers so oversubscribe
                # the machine that CPU-bound tests ran 30x slower than alone (a sampling test: 254 s on
                # a 16-core GPU machine in 4 workers, 8 s on 2 cores alone)
                threads = str(max(1, (os.cpu_count() or 1) // args.workers))
                run_env = {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", threads)}
            rcs.append(subprocess.call(cmd, cwd=ROOT, env=run_env))
            if rcs[-1] == 2:  # the budget is spent (or the run was interrupted): no next pass
                break
        # pytest's worst: 2 interrupted over 1 failed over 5 nothing ran over 0
        return next((rc for rc in (2, 1, 3, 4) if rc in rcs), 5 if all(rc == 5 for rc in rcs) else 0)


if __name__ == "__main__":
    sys.exit(main())
