"""python -m mimo_fn.bench_serving: the serving benchmark's command line.

Flags follow SGLang's bench_serving; the exit code is 0 only if every timed request succeeded
(1 if any failed, a warm-up failed or the cache flush did not happen; 2 for bad arguments).
"""

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx

from mimo_fn.bench_serving.metrics import compute_metrics, format_report, report_row
from mimo_fn.bench_serving.protocol import BACKENDS, Api, FlushFailed, first_model_id, make_client
from mimo_fn.bench_serving.runner import RunConfig, WarmupFailed, run
from mimo_fn.bench_serving.workload import (
    arrival_times, jsonl_requests, load_tokenizer, random_ids_requests, random_text_requests, special_ids,
)
from mimo_fn.cli_help import HelpFormatter

DATASETS = ("random", "random-ids", "jsonl")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mimo_fn.bench_serving", formatter_class=HelpFormatter,
        description="Serving benchmark over HTTP: throughput, TTFT, ITL, TPOT and E2E latency of a "
                    "mimo_fn, SGLang or OpenAI-compatible server.",
    )
    a = p.add_argument
    a("--backend", choices=BACKENDS, default="mimo_fn",
      help="mimo_fn / sglang: SGLang's POST /generate; openai: POST /v1/completions")
    a("--base-url", default=None, help="the server, e.g. http://127.0.0.1:30000 (default: --host and --port)")
    a("--host", default="127.0.0.1", help="the server's host, without --base-url")
    a("--port", type=int, default=30000, help="the server's port, without --base-url")
    a("--model", default=None, help="the OpenAI `model` field (default: the first of GET /v1/models); "
                                   "also the tokenizer when --tokenizer is not given")
    a("--tokenizer", default=None,
      help="tokenizer for `random` text prompts: a model directory, a hub id or a tokenizer.json "
           "(default: --model, else the server's tokenizer_path from GET /get_model_info)")
    a("--dataset-name", choices=DATASETS, default="random",
      help="random: random ids decoded to text; random-ids: random ids sent as ids (no tokenizer); "
           "jsonl: prompts from --dataset-path")
    a("--dataset-path", default=None,
      help="jsonl: one object a line, {'prompt': text or ids} / {'text': ...} / {'input_ids': [...]} / "
           "{'conversations' or 'messages': [turns]}, optional 'output_len'")
    a("--num-prompts", type=int, default=1000, help="requests in the timed run")
    a("--random-input-len", type=int, default=1024, help="random / random-ids: prompt tokens (the longest)")
    a("--random-output-len", type=int, default=1024, help="random / random-ids: new tokens (the most)")
    a("--random-range-ratio", type=float, default=0.0,
      help="lengths are uniform in [len * ratio, len]; 1 makes every prompt exactly --random-input-len")
    a("--vocab-size", type=int, default=None,
      help="random-ids draws ids below this (default: the tokenizer's size, else the server's vocab_size)")
    a("--jsonl-output-len", type=int, default=256, help="jsonl: output length of lines without one")
    a("--apply-chat-template", action="store_true", help="jsonl: wrap text prompts in the tokenizer's chat template")
    a("--request-rate", type=float, default=float("inf"),
      help="requests per second, Poisson arrivals; inf sends them all at once")
    a("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    a("--seed", type=int, default=1, help="seed of the prompts, their lengths and the arrival times")
    a("--warmup-requests", type=int, default=1,
      help="requests sent before the timed run (copies of the first, at most 32 new tokens)")
    a("--flush-cache", action="store_true", help="POST /flush_cache after the warm-ups, before the timed run")
    a("--flush-timeout", type=float, default=300.0, help="seconds the flush may wait for the server to go idle")
    a("--disable-stream", action="store_true", help="ask for whole answers (TTFT is then the latency)")
    a("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    a("--extra-request-body", default=None, help="JSON object merged into every request's payload")
    a("--request-timeout", type=float, default=None, help="seconds before a request counts as failed (default: none)")
    a("--output-file", default=None, help="append the result row (JSON) to this JSONL file")
    a("--output-details", action="store_true",
      help="add SGLang's per-request arrays (input_lens, output_lens, ttfts, itls, generated_texts, errors) to the row")
    a("--request-log", default=None,
      help="write one JSON line per request: its send, first-token and end times (s from the run's "
           "start), token counts, chunk arrivals, error")
    a("--plot", default=None, metavar="OUT.png", help="plot the TTFT and E2E latency distributions")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _server_info(base_url: str, path: str) -> dict:
    try:
        resp = httpx.get(base_url + path, timeout=30.0, trust_env=False)
        return resp.json() if resp.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _tokenizer(args, base_url: str, required: bool):
    path = args.tokenizer or args.model
    if path is None:
        served = _server_info(base_url, "/get_model_info").get("tokenizer_path")
        path = served if isinstance(served, str) and Path(served).exists() else None
    if path is None:
        if required:
            raise ValueError(f"--dataset-name {args.dataset_name} needs a tokenizer: pass --tokenizer PATH")
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load the tokenizer {path!r}: {e}") from None


def build_requests(args, base_url: str):
    if args.dataset_name == "random":
        tok = _tokenizer(args, base_url, required=True)
        return random_text_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                    args.random_range_ratio, tok, args.seed)
    if args.dataset_name == "random-ids":
        tok = _tokenizer(args, base_url, required=False) if (args.tokenizer and not args.vocab_size) else None
        vocab = args.vocab_size or (len(tok) if tok is not None else None)
        if vocab is None:
            vocab = _server_info(base_url, "/get_model_info").get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError("--dataset-name random-ids needs the vocabulary size: pass --vocab-size N "
                             "(or --tokenizer; the server's GET /get_model_info reports no vocab_size)")
        return random_ids_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                   args.random_range_ratio, vocab, args.seed,
                                   exclude_ids=special_ids(tok) if tok is not None else ())
    if args.dataset_path is None:
        raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
    tok = _tokenizer(args, base_url, required=args.apply_chat_template) if (args.tokenizer or args.apply_chat_template) else None
    if args.jsonl_output_len < 1:
        raise ValueError(f"--jsonl-output-len must be >= 1, got {args.jsonl_output_len}")
    return jsonl_requests(args.dataset_path, args.num_prompts, args.jsonl_output_len, tok, args.apply_chat_template)


def _extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-request-body is not valid JSON ({e.msg})") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    return body


async def _main(args) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or mimo_fn's [bench] extra)")
    requests = build_requests(args, base_url)
    model = args.model
    if args.backend == "openai" and model is None:
        async with make_client() as client:
            model = await first_model_id(client, base_url)
        if model is None:
            raise ValueError("--backend openai needs --model (GET /v1/models gave none)")
    api = Api(args.backend, base_url, model=model, stream=not args.disable_stream,
              ignore_eos=not args.disable_ignore_eos, extra_body=_extra_body(args.extra_request_body))
    cfg = RunConfig(
        api=api, requests=tuple(requests), arrivals=tuple(arrival_times(len(requests), args.request_rate, args.seed)),
        max_concurrency=args.max_concurrency, warmup_requests=args.warmup_requests,
        flush_cache=args.flush_cache, flush_timeout=args.flush_timeout,
        request_timeout=args.request_timeout, disable_tqdm=args.disable_tqdm,
    )
    print(f"#Prompts: {len(requests)}, #input tokens (client count): {sum(r.prompt_len for r in requests)}, "
          f"#output tokens asked: {sum(r.output_len for r in requests)}", flush=True)
    try:
        out = await run(cfg)
    except (WarmupFailed, FlushFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    metrics = compute_metrics(out.results, out.duration)
    run_args = {
        "backend": args.backend, "dataset_name": args.dataset_name, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "num_prompts": len(requests),
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "warmup_requests": args.warmup_requests,
        "flush_cache": args.flush_cache, "stream": not args.disable_stream, "seed": args.seed,
    }
    row = report_row(run_args, metrics, out.results, out.accept_length, details=args.output_details)
    print(format_report(row), flush=True)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(row) + "\n")
    if args.request_log:
        with open(args.request_log, "w") as f:
            for r in out.results:
                f.write(json.dumps(r.to_json()) + "\n")
    if args.plot:
        from mimo_fn.bench_serving.plot import plot_latencies

        plot_latencies(out.results, args.plot, title=f"{args.backend} {args.dataset_name}: {len(requests)} "
                                                      f"requests, concurrency {args.max_concurrency or 'unbounded'}")
    return 0 if metrics.failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
