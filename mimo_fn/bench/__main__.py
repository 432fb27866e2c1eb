"""python -m mimo_fn.bench <what> [options]: see mimo_fn.bench.cli."""

from mimo_fn.bench.cli import main

main()
