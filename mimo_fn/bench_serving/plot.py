"""`--plot out.png`: the distributions of TTFT and end-to-end latency over the requests that
succeeded, each with its mean, median and P99 marked (matplotlib, imported only here)."""

from typing import Sequence

import numpy as np

from mimo_fn.bench_serving.protocol import RequestResult


def plot_latencies(results: Sequence[RequestResult], path: str, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or mimo_fn's [bench] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, values in (
        (axes[0], "TTFT", [r.ttft * 1000 for r in ok]),
        (axes[1], "E2E latency", [r.latency * 1000 for r in ok]),
    ):
        ax.set_title(f"{name} ({len(values)} requests)")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if not values:
            ax.text(0.5, 0.5, "no request succeeded", ha="center", va="center", transform=ax.transAxes)
            continue
        v = np.asarray(values)
        ax.hist(v, bins=min(50, max(5, len(v) // 2)), color="tab:blue", alpha=0.8)
        for stat, value, style in (("mean", v.mean(), "-"), ("median", np.median(v), "--"),
                                   ("P99", np.percentile(v, 99), ":")):
            ax.axvline(value, color="black", linestyle=style, label=f"{stat} {value:.1f} ms")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
