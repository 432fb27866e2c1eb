"""A run's numbers from its per-request results, under SGLang bench_serving's field names.

Only requests that succeeded enter the latencies and token counts (as in SGLang); failed ones are
counted in `failed` and their first errors listed. Token counts are what the server reported it
ran (`prompt_tokens` / `completion_tokens`), falling back to the client's own count where a server
reports none. Percentiles are numpy's (linear interpolation), times in ms. A statistic over no
values (no request succeeded; no stream gave two chunks) is None, not a made-up 0.
"""

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from mimo_fn.bench_serving.protocol import RequestResult

MAX_ERRORS_SHOWN = 5


@dataclass(frozen=True)
class Metrics:
    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    std_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    std_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    std_itl_ms: float | None
    p95_itl_ms: float | None
    p99_itl_ms: float | None
    max_itl_ms: float | None
    mean_e2e_latency_ms: float | None
    median_e2e_latency_ms: float | None
    std_e2e_latency_ms: float | None
    p99_e2e_latency_ms: float | None
    concurrency: float          # sum of the requests' latencies over the run's duration: requests in flight on average


def _ms(fn, values: Sequence[float], *args) -> float | None:
    return float(fn(np.asarray(values, dtype=np.float64), *args)) * 1000.0 if len(values) else None


def compute_metrics(results: Sequence[RequestResult], duration: float) -> Metrics:
    """`duration`: seconds from the first request sent to the last answer in."""
    if duration <= 0:
        raise ValueError(f"a run's duration must be > 0 s, got {duration}")
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2e = [r.latency for r in ok]
    # a whole answer (not streamed) has no first-token time apart from its last: no TPOT
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1)
             for r in ok if r.output_tokens > 1 and r.first_token is not None]
    itls = [x for r in ok for x in r.itl]
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    return Metrics(
        completed=len(ok), failed=len(results) - len(ok), duration=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration, input_throughput=total_in / duration,
        output_throughput=total_out / duration, total_throughput=(total_in + total_out) / duration,
        mean_ttft_ms=_ms(np.mean, ttfts), median_ttft_ms=_ms(np.median, ttfts),
        std_ttft_ms=_ms(np.std, ttfts), p99_ttft_ms=_ms(np.percentile, ttfts, 99),
        mean_tpot_ms=_ms(np.mean, tpots), median_tpot_ms=_ms(np.median, tpots),
        std_tpot_ms=_ms(np.std, tpots), p99_tpot_ms=_ms(np.percentile, tpots, 99),
        mean_itl_ms=_ms(np.mean, itls), median_itl_ms=_ms(np.median, itls), std_itl_ms=_ms(np.std, itls),
        p95_itl_ms=_ms(np.percentile, itls, 95), p99_itl_ms=_ms(np.percentile, itls, 99), max_itl_ms=_ms(np.max, itls),
        mean_e2e_latency_ms=_ms(np.mean, e2e), median_e2e_latency_ms=_ms(np.median, e2e),
        std_e2e_latency_ms=_ms(np.std, e2e), p99_e2e_latency_ms=_ms(np.percentile, e2e, 99),
        concurrency=sum(e2e) / duration,
    )


def first_errors(results: Sequence[RequestResult], limit: int = MAX_ERRORS_SHOWN) -> list[str]:
    return [f"request {r.index}: {' '.join(r.error.split())}" for r in results if not r.success][:limit]


def report_row(run_args: dict, metrics: Metrics, results: Sequence[RequestResult],
               accept_length: float | None, details: bool = False) -> dict:
    """The JSONL row: the run's arguments, then SGLang's result fields, `accept_length`, and
    `first_errors`; with `details`, SGLang's per-request arrays as well."""
    row = {**run_args, **asdict(metrics), "accept_length": accept_length, "first_errors": first_errors(results)}
    if details:
        row.update(
            input_lens=[r.input_tokens for r in results],
            output_lens=[r.output_tokens if r.success else 0 for r in results],
            ttfts=[r.ttft if r.success else 0.0 for r in results],
            itls=[r.itl for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    return row


def format_report(row: dict) -> str:
    """The stdout table (SGLang's layout, with the failures and the first errors added)."""

    def line(label: str, value) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40} {'n/a' if value is None else value:<10}"

    out = ["{:=^50}".format(" Serving Benchmark Result ")]
    out += [
        line("Backend:", row["backend"]),
        line("Traffic request rate:", row["request_rate"]),
        line("Max request concurrency:", row["max_concurrency"] or "not set"),
        line("Successful requests:", row["completed"]),
        line("Failed requests:", row["failed"]),
        line("Benchmark duration (s):", row["duration"]),
        line("Total input tokens:", row["total_input_tokens"]),
        line("Total generated tokens:", row["total_output_tokens"]),
        line("Request throughput (req/s):", row["request_throughput"]),
        line("Input token throughput (tok/s):", row["input_throughput"]),
        line("Output token throughput (tok/s):", row["output_throughput"]),
        line("Total token throughput (tok/s):", row["total_throughput"]),
        line("Concurrency:", row["concurrency"]),
    ]
    if row["accept_length"] is not None:
        out.append(line("Accept length:", row["accept_length"]))
    sections = [
        ("End-to-End Latency", [("Mean E2E Latency (ms):", "mean_e2e_latency_ms"),
                                ("Median E2E Latency (ms):", "median_e2e_latency_ms"),
                                ("P99 E2E Latency (ms):", "p99_e2e_latency_ms")]),
        ("Time to First Token", [("Mean TTFT (ms):", "mean_ttft_ms"), ("Median TTFT (ms):", "median_ttft_ms"),
                                 ("P99 TTFT (ms):", "p99_ttft_ms")]),
        ("Time per Output Token (excl. 1st token)", [("Mean TPOT (ms):", "mean_tpot_ms"),
                                                     ("P99 TPOT (ms):", "p99_tpot_ms")]),
        ("Inter-Token Latency", [("Mean ITL (ms):", "mean_itl_ms"), ("Median ITL (ms):", "median_itl_ms"),
                                 ("P99 ITL (ms):", "p99_itl_ms"), ("Max ITL (ms):", "max_itl_ms")]),
    ]
    for title, items in sections:
        out.append("{:-^50}".format(title))
        out += [line(label, row[key]) for label, key in items]
    if row["first_errors"]:
        out.append("{:-^50}".format("First errors"))
        out += [e if len(e) <= 200 else e[:200] + "..." for e in row["first_errors"]]
    out.append("=" * 50)
    return "\n".join(out)
