"""The one result format of the benchmarks: JSON rows, and the human table printed last.

Every row a run records is

    {"bench": "generate", "commit": "0fe495b", "code": "3f9c0a51d2e7", "device": "NVIDIA H200",
     "date": "2026-12-03 10:15 UTC", "command": "python -m mimo_fn.bench generate --batch 1 8",
     "params": {...}, "results": {...}}

("code": code_version(), a hash of the code's files, which names the code where git cannot.)

`params` are the run's options with the case's own parameters on top (e.g. "batch": 8 of
--batch 1 8), `results` the figures measured. With `--json FILE` (or `--output-file FILE`)
each row is appended to FILE as one line of JSON the moment it is recorded, so a run cut short
keeps what it measured; under torchrun only rank 0 writes. `python -m mimo_fn.bench table FILE`
prints rows as a markdown table, `python -m mimo_fn.bench plot FILE ...` plots them.
"""

import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_OWN = ("json",)  # options about where results go, not what was measured


@dataclass(frozen=True)
class Run:
    bench: str
    commit: str
    device: str
    date: str
    command: str
    params: dict = field(default_factory=dict)  # the run's options
    path: str | None = None  # --json FILE
    code: str = ""  # code_version()


REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("mimo_fn", "tests", "scripts", "examples")  # with pyproject.toml: what a run depends on


def code_version(root: Path = REPO) -> str:
    """A hash of the code's files (CODE_DIRS and pyproject.toml, caches left out): the same for
    the same code wherever it runs. It names a device's rows where git cannot: a device's copy of
    the tree need not carry its git history (one reported a stale head as "+dirty")."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml"] + sorted(p for d in CODE_DIRS for p in (root / d).rglob("*")
                                               if p.is_file() and "__pycache__" not in p.parts)
    for p in files:
        if p.exists():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit() -> str:
    """The checkout's short commit, "+dirty" when tracked files changed; "unknown" outside git."""
    root = REPO
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    """The GPU's name (x the world size under torchrun), or the CPU's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
    return f"{name} x {world}" if world > 1 else name


def command_line(bench: str, argv: list[str]) -> str:
    """How to run this again (where the rows went left out): torchrun's launcher where the run had
    several ranks."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--output-file"):
            skip = True
        elif not a.startswith(("--json=", "--output-file=")):
            kept.append(a)
    cmd = shlex.join(["-m", "mimo_fn.bench", bench, *kept])
    nproc = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    if nproc and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"torchrun --nproc-per-node {nproc} {cmd}"
    return f"python {cmd}"


def start(bench: str, args: Any, argv: list[str]) -> Run:
    params = {k: v for k, v in vars(args).items() if k not in _OWN}
    return Run(bench=bench, commit=git_commit(), code=code_version(), device=device_name(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=command_line(bench, argv),
               params=_plain(params), path=getattr(args, "json", None))


def _plain(v: Any) -> Any:
    """v as JSON: NaN and infinities as null, tuples as lists, anything else unknown as its str."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return _plain(v.item())
    return str(v)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def record(run: Run, results: dict, **params: Any) -> dict:
    """One row: the run's options with `params` on top, and `results`; appended to the run's
    --json file (rank 0 only). Returns the row."""
    row = {"bench": run.bench, "commit": run.commit, "code": run.code, "device": run.device, "date": run.date,
           "command": run.command, "params": {**run.params, **_plain(params)}, "results": _plain(results)}
    if run.path and _rank() == 0:
        with open(run.path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def read_rows(path: str) -> list[dict]:
    """The rows of a --json file (blank lines skipped); ValueError naming the line that is not a row."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON row ({e})") from None
            if not isinstance(row, dict) or not {"bench", "params", "results"} <= row.keys():
                raise ValueError(f"{path}:{i}: expected a row with bench, params and results")
            rows.append(row)
    return rows


def _cell(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if fmt and isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, fmt)
    return str(v)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], title: str | None = None) -> None:
    """A plain-text table: columns are (header, key, format spec); a key missing from a row
    prints "-". Every bench prints one last."""
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    if title:
        print(f"\n{title}")
    else:
        print()
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)), flush=True)
