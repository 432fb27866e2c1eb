"""Run the test suite on a GPU machine in shards that each fit one device call (~9 minutes).

    python scripts/gpu_tests.py --shard 1/3 --junit $OUT/shard1.xml
    python scripts/gpu_tests.py --list            # the shards, without running them

Test files are dealt to shards by their size in lines (a stand-in for their running time that
needs no earlier run), largest first, each to the lightest shard so far; a shard runs its files in
one pytest process with RuntimeWarnings as errors, and ends with pytest's summary line. Every file
of tests/ belongs to exactly one shard, so running 1/n .. n/n at one commit covers the suite.
"""

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shards(n: int, files: list[Path]) -> list[list[Path]]:
    """files dealt into n shards of about equal total size."""
    out, load = [[] for _ in range(n)], [0] * n
    for f in sorted(files, key=lambda f: (-len(f.read_text().splitlines()), f.name)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += len(f.read_text().splitlines())
    return [sorted(s) for s in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="1/1", help="i/n: run the i-th of n shards (default: %(default)s, all)")
    ap.add_argument("--list", action="store_true", help="print every shard's files and exit (default: off, run the shard)")
    ap.add_argument("--junit", default=None, help="also write pytest's JUnit XML here (default: none)")
    ap.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = ap.parse_args()
    try:
        i, n = (int(x) for x in args.shard.split("/"))
    except ValueError:
        ap.error(f"--shard {args.shard!r}: expected i/n, e.g. 2/3")
    if not 1 <= i <= n:
        ap.error(f"--shard {args.shard}: expected 1 <= i <= n")
    groups = shards(n, list((ROOT / "tests").glob("test_*.py")))
    if args.list:
        for k, g in enumerate(groups, 1):
            print(f"{k}/{n}: " + " ".join(f.name for f in g))
        return 0
    cmd = [sys.executable, "-m", "pytest", "-q", "-W", "error::RuntimeWarning", "-p", "no:cacheprovider", "-rfEs",
           *map(str, groups[i - 1]), *args.pytest_args]
    if args.junit:
        cmd.append(f"--junitxml={args.junit}")
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
