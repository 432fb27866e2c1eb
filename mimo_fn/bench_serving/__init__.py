"""Serving benchmark over HTTP: `python -m mimo_fn.bench_serving` (flags: `--help`).

workload.py  what is sent (random text, random ids, a jsonl file) and when (Poisson arrivals)
protocol.py  one timed request over SGLang's /generate or OpenAI's /v1/completions; flush, server info
runner.py    warm-ups, flush, the timed run under a concurrency cap, progress bar
metrics.py   the report: SGLang bench_serving's fields from the per-request results
plot.py      --plot: TTFT and E2E latency distributions
"""
