"""The one plot helper of the benchmarks (matplotlib, optional), and `python -m mimo_fn.bench plot`.

    python -m mimo_fn.bench plot rows.jsonl --bench prefill --x tokens --y tok_s --by dtype --out prefill.png

plots one figure from --json rows: --y (a result) against --x (a parameter or a result), one
line per value of --by, for the rows of one benchmark (and, with --where KEY=VALUE, those rows
only). matplotlib is not a dependency of mimo_fn: without it this exits with one line saying so.
"""

from mimo_fn.bench.results import read_rows

NEEDS_CUDA = False


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; SystemExit with one line where it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plotting needs matplotlib, which is not installed (pip install matplotlib)") from None
    return plt


def line_plot(path: str, panels: list[dict], title: str) -> None:
    """Panels side by side, each {"xlabel", "ylabel", "series": {label: (xs, ys)}, "logx": base or
    None}; written to `path` (PNG)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for label, (xs, ys) in panel["series"].items():
            ax.plot(xs, ys, "o-", label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=panel["logx"])
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(ap) -> None:
    ap.add_argument("file", help="a --json file of benchmark rows")
    ap.add_argument("--bench", required=True, help="the benchmark whose rows to plot (e.g. prefill)")
    ap.add_argument("--x", required=True, help="x axis: a key of the rows' params or results")
    ap.add_argument("--y", required=True, help="y axis: a key of the rows' results")
    ap.add_argument("--by", default=None, help="one line per value of this params key (default: one line)")
    ap.add_argument("--where", nargs="*", default=[], metavar="KEY=VALUE",
                    help="only rows whose params (or results) KEY prints as VALUE")
    ap.add_argument("--logx", type=int, default=None, help="log-scale x with this base (e.g. 2)")
    ap.add_argument("--out", required=True, help="the PNG to write")


def _get(row: dict, key: str):
    return row["params"].get(key, row["results"].get(key))


def main(args) -> None:
    pyplot()  # before reading anything: say at once if matplotlib is missing
    wanted = {}
    for cond in args.where:
        if "=" not in cond:
            raise SystemExit(f"--where: expected KEY=VALUE, got {cond!r}")
        k, v = cond.split("=", 1)
        wanted[k] = v
    try:
        rows = [r for r in read_rows(args.file) if r["bench"] == args.bench]
    except (OSError, ValueError) as e:
        raise SystemExit(f"plot: {e}") from None
    rows = [r for r in rows if r["results"].get(args.y) is not None and _get(r, args.x) is not None
            and all(str(_get(r, k)) == v for k, v in wanted.items())]
    if not rows:
        raise SystemExit(f"plot: no {args.bench} rows in {args.file} with {args.x} and {args.y}"
                         + (f" where {' '.join(args.where)}" if args.where else ""))
    series: dict[str, tuple[list, list]] = {}
    for r in sorted(rows, key=lambda r: _get(r, args.x)):
        label = f"{args.by}={r['params'].get(args.by)}" if args.by else args.y
        xs, ys = series.setdefault(label, ([], []))
        xs.append(_get(r, args.x))
        ys.append(r["results"][args.y])
    first = rows[0]
    line_plot(args.out, [{"xlabel": args.x, "ylabel": args.y, "series": series, "logx": args.logx}],
              f"{args.bench}, {first['device']}, {first['date']} ({first['commit']})")
    print(f"wrote {args.out} ({len(rows)} rows)")
