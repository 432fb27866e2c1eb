"""`python -m mimo_fn.bench table FILE`: --json rows as markdown, for docs/benchmarks.md.

    python -m mimo_fn.bench table rows.jsonl [--bench generate] [--params batch sampling] [--results off_ms on_ms]

One table per benchmark and command: the parameters that vary between its rows (or --params),
the figures (or --results), and under it the command, device, date and commit it came from.
"""

from mimo_fn.bench.results import read_rows

NEEDS_CUDA = False


def add_args(ap) -> None:
    ap.add_argument("file", help="a --json file of benchmark rows")
    ap.add_argument("--bench", default=None, help="only this benchmark's rows (default: all)")
    ap.add_argument("--params", nargs="*", default=None, help="parameter columns (default: those that vary)")
    ap.add_argument("--results", nargs="*", default=None, help="result columns (default: every result key)")
    ap.add_argument("--digits", type=int, default=3, help="significant digits of floats")


def _fmt(v, digits: int) -> str:
    if isinstance(v, float):
        return f"{v:,.{digits}g}" if abs(v) < 1e15 else f"{v:.{digits}e}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,d}"
    return "-" if v is None else str(v)


def main(args) -> None:
    try:
        rows = read_rows(args.file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"table: {e}") from None
    rows = [r for r in rows if args.bench in (None, r["bench"])]
    if not rows:
        raise SystemExit(f"table: no rows{f' of {args.bench}' if args.bench else ''} in {args.file}")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["bench"], r["command"], r["date"]), []).append(r)
    for (bench, command, date), group in groups.items():
        params = args.params
        if params is None:  # the parameters that differ between the rows, in first-seen order
            keys = list(dict.fromkeys(k for r in group for k in r["params"]))
            params = [k for k in keys if len({repr(r["params"].get(k)) for r in group}) > 1]
        res = args.results or list(dict.fromkeys(k for r in group for k in r["results"]))
        print(f"| {' | '.join(params + res)} |")
        print(f"|{'---|' * len(params + res)}")
        for r in group:
            cells = [_fmt(r["params"].get(k), args.digits) for k in params]
            cells += [_fmt(r["results"].get(k), args.digits) for k in res]
            print(f"| {' | '.join(cells)} |")
        print(f"\n`{command}` ({bench}; {group[0]['device']}, {date}, {group[0]['commit']})\n")
