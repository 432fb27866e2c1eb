"""python -m mimo_fn.eval_gsm8k: few-shot GSM8K accuracy of a running server, over HTTP.

The prompt and the scoring are those of the standard GSM8K scripts (SGLang's few_shot_gsm8k and
benchmark/gsm8k), so accuracies compare with numbers measured by them:
- the first `--num-shots` lines of the file, with their answers, as "Question: q\\nAnswer: a",
  separated by blank lines, then "Question: q\\nAnswer:" for the question asked. The questions are
  the file's first `--num-questions` lines, the shots among them, as those scripts take them;
- greedy decoding, stopped at "Question", "Assistant:" or "<|separator|>";
- the answer is the last run of digits in the output once commas are dropped ("1,234.5" gives 5,
  "-3" gives 3: the scripts' rule, kept so that numbers compare), and the label the same taken
  from the reference answer (GSM8K's "#### N" ends it). An output with no digits is invalid.
A request that fails is an API error: it counts as wrong and in `API errors`, and the exit code is
1 if any request of any run failed.
"""

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from tqdm import tqdm

from mimo_fn.bench_serving.protocol import (
    BACKENDS, Api, FlushFailed, RequestResult, accept_length, first_model_id, flush_cache, make_client, send_request,
)
from mimo_fn.bench_serving.workload import BenchRequest
from mimo_fn.cli_help import HelpFormatter

STOP = ("Question", "Assistant:", "<|separator|>")


@dataclass(frozen=True)
class Example:
    question: str
    answer: str    # the reference solution, ending in "#### N"
    label: int


@dataclass(frozen=True)
class Score:
    accuracy: float
    invalid: float
    num_correct: int
    num_invalid: int


@dataclass(frozen=True)
class EvalRun:
    score: Score
    api_errors: int
    latency: float               # s, wall time of the run
    output_throughput: float     # completion tokens per second
    accept_length: float | None  # the server's mean speculative acceptance length, if it reports one
    preds: list[int | None]
    results: list[RequestResult]


def extract_answer(text: str) -> int | None:
    """The last run of digits in `text` once commas are removed; None if there is none."""
    numbers = re.findall(r"\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def load_gsm8k(path: str) -> list[Example]:
    """GSM8K's jsonl: {"question": str, "answer": str} a line (blank lines skipped)."""
    out: list[Example] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) \
                    or not isinstance(obj.get("answer"), str):
                raise ValueError(f"{where}: expected an object with string fields 'question' and 'answer'")
            label = extract_answer(obj["answer"])
            if label is None:
                raise ValueError(f"{where}: the answer has no number to score against (GSM8K's end in '#### N')")
            out.append(Example(obj["question"], obj["answer"], label))
    if not out:
        raise ValueError(f"{path}: no questions")
    return out


def format_example(ex: Example, include_answer: bool) -> str:
    text = "Question: " + ex.question + "\nAnswer:"
    return text + " " + ex.answer if include_answer else text


def build_prompts(examples: Sequence[Example], num_shots: int, num_questions: int) -> tuple[list[str], list[int]]:
    """The prompts of the first `num_questions` examples, each after the `num_shots` first ones
    with their answers; and their labels."""
    if num_shots < 0:
        raise ValueError(f"--num-shots must be >= 0, got {num_shots}")
    if num_shots > len(examples):
        raise ValueError(f"--num-shots {num_shots} is more than the file's {len(examples)} examples")
    if num_questions < 1:
        raise ValueError(f"--num-questions must be >= 1, got {num_questions}")
    shots = "".join(format_example(ex, True) + "\n\n" for ex in examples[:num_shots])
    asked = examples[:num_questions]
    return [shots + format_example(ex, False) for ex in asked], [ex.label for ex in asked]


def score(preds: Sequence[int | None], labels: Sequence[int]) -> Score:
    if len(preds) != len(labels) or not labels:
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    correct = sum(p is not None and p == y for p, y in zip(preds, labels))
    invalid = sum(p is None for p in preds)
    return Score(correct / len(labels), invalid / len(labels), correct, invalid)


async def run_eval(api: Api, prompts: Sequence[str], labels: Sequence[int], max_new_tokens: int, parallel: int,
                   request_timeout: float | None = None, disable_tqdm: bool = False) -> EvalRun:
    if parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {parallel}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    sem = asyncio.Semaphore(parallel)
    bar = tqdm(total=len(prompts), desc="questions", file=sys.stderr, disable=disable_tqdm)
    async with make_client(max_connections=parallel + 4) as client:

        async def one(i: int, prompt: str) -> RequestResult:
            async with sem:
                res = await send_request(client, api, BenchRequest(prompt, 0, max_new_tokens), i, t0, request_timeout)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        results = list(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
        latency = time.perf_counter() - t0
        bar.close()
        accept = await accept_length(client, api.base_url)
    preds = [extract_answer(r.generated_text) if r.success else None for r in results]
    tokens = sum(r.output_tokens for r in results if r.success)
    return EvalRun(score(preds, labels), sum(not r.success for r in results), latency, tokens / latency, accept,
                   preds, results)


def format_run(run: EvalRun) -> str:
    accept = "n/a" if run.accept_length is None else f"{run.accept_length:.3f}"
    return "\n".join([
        f"Accuracy: {run.score.accuracy:.3f}",
        f"Invalid: {run.score.invalid:.3f}",
        f"API errors: {run.api_errors}",
        f"Latency: {run.latency:.3f} s",
        f"Output throughput: {run.output_throughput:.3f} token/s",
        f"Accept length: {accept}",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mimo_fn.eval_gsm8k", formatter_class=HelpFormatter,
                                description="Few-shot GSM8K accuracy of a running server (greedy by default).")
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:30000", help="the server")
    a("--backend", choices=BACKENDS, default="mimo_fn",
      help="mimo_fn / sglang: POST /generate; openai: POST /v1/completions")
    a("--model", default=None, help="the OpenAI `model` field (default: the first of GET /v1/models)")
    a("--data", required=True, help="GSM8K-format jsonl: {'question': ..., 'answer': '... #### N'} a line")
    a("--num-shots", type=int, default=5, help="worked examples from the head of --data before each question")
    a("--num-questions", type=int, default=200, help="questions asked: the file's first lines, the shots among them")
    a("--parallel", type=int, default=128, help="requests in flight")
    a("--max-new-tokens", type=int, default=512, help="new tokens an answer may take")
    a("--temperature", type=float, default=0.0, help="0: greedy")
    a("--repeat", type=int, default=1, help="run the questions this many times on the same server")
    a("--flush-between", action="store_true", help="POST /flush_cache before each repeat")
    a("--flush-timeout", type=float, default=300.0, help="seconds a flush may wait for the server to go idle")
    a("--request-timeout", type=float, default=None, help="seconds before a request counts as an API error")
    a("--output-file", default=None, help="append one JSON row per run to this JSONL file")
    a("--answers-file", default=None, help="write each question's output, prediction and label as JSONL")
    a("--disable-tqdm", action="store_true", help="no progress bar")
    return p


async def _main(args) -> int:
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    examples = load_gsm8k(args.data)
    prompts, labels = build_prompts(examples, args.num_shots, args.num_questions)
    base_url = args.base_url.rstrip("/")
    model = args.model
    async with make_client() as client:
        if args.backend == "openai" and model is None:
            model = await first_model_id(client, base_url)
            if model is None:
                raise ValueError("--backend openai needs --model (GET /v1/models gave none)")
    api = Api(args.backend, base_url, model=model, stream=False, ignore_eos=False,
              sampling={"temperature": args.temperature, "stop": list(STOP)})
    any_errors = False
    answers = open(args.answers_file, "w") if args.answers_file else None
    try:
        for k in range(args.repeat):
            if k > 0 and args.flush_between:
                async with make_client() as client:
                    await flush_cache(client, base_url, args.flush_timeout)
            if args.repeat > 1:
                print(f"Run {k + 1}/{args.repeat}", flush=True)
            run = await run_eval(api, prompts, labels, args.max_new_tokens, args.parallel,
                                 args.request_timeout, args.disable_tqdm)
            print(format_run(run), flush=True)
            errors = [r.error for r in run.results if not r.success]
            if errors:
                any_errors = True
                print(f"First API error: {' '.join(errors[0].split())[:300]}", file=sys.stderr)
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps({
                        "task": "gsm8k", "backend": args.backend, "run": k + 1, "num_questions": len(prompts),
                        "num_shots": args.num_shots, "parallel": args.parallel, "accuracy": run.score.accuracy,
                        "invalid": run.score.invalid, "api_errors": run.api_errors, "latency": run.latency,
                        "output_throughput": run.output_throughput, "accept_length": run.accept_length,
                    }) + "\n")
            if answers is not None:
                for r, pred, label in zip(run.results, run.preds, labels):
                    answers.write(json.dumps({
                        "run": k + 1, "index": r.index, "output": r.generated_text, "pred": pred, "label": label,
                        "correct": pred == label, "error": r.error,
                    }) + "\n")
    except FlushFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if answers is not None:
            answers.close()
    return 1 if any_errors else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
