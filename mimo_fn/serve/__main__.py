"""python -m mimo_fn.serve [flags]: see mimo_fn.serve.args (or --help)."""

import logging
import os
import sys


def main(argv: list[str] | None = None) -> None:
    from mimo_fn.serve.args import parse_args

    args = parse_args(argv)  # before torch and triton load: --help and bad flags answer at once
    if args.triton_cache_dir:  # before anything compiles a kernel
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(args.triton_cache_dir)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"[%(asctime)s rank {rank}] %(levelname)s %(name)s: %(message)s")
    from mimo_fn.serve.launch import serve

    serve(args)


if __name__ == "__main__":
    main()
