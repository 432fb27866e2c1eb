"""Kernel and step benchmarks: `python -m mimo_fn.bench <what> [options]` (`--help` lists them).

One module per benchmark; timing.py is the one timing helper, results.py the one result format
(JSON rows, a table printed last), plot.py the one plot helper, workload.py the model slice and
chunked prefill several benchmarks share. The figures are on docs/benchmarks.md.
"""
