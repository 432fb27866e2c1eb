"""The server's host work per decode step, on the CPU: the real HTTP server and engine loop in front
of the tiny engine, or of a stand-in engine whose step holds the GIL for --host-ms (as launching a
step's kernels does) and then sleeps --gpu-ms with the GIL released (as waiting for the GPU does),
driven by bench_serving (random ids, streamed, SGLang-native /generate). Prints bench_serving's
report and, per pass with every stream running: the pass, the engine step (Runner.run), posting the
deltas to the event loop, and the CPU time of the engine thread and of the event loop's thread.

    python scripts/serve_overhead.py                     # the tiny engine: 128 x 64 / 128 at C64
    python scripts/serve_overhead.py --stand-in --host-ms 8 --gpu-ms 4.5 --vocab 152576 \\
        --input-len 4096 --output-len 256                # the H100 slice's 4K / 256 C64 case, its host side

The bare engine of the first: python -m mimo_fn.bench serve-bare --device cpu --page-size 16
--max-total-tokens 32768 --max-running-requests 64 --num-prompts 128 --input-len 64 --output-len 128.
The stand-in's bare step is --host-ms + --gpu-ms. The machine's other work shows in every figure:
repeat a run and compare the spread.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from mimo_fn.bench.cli import HelpFormatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--page-size", "16", "--max-total-tokens", "32768", "--log-level", "warning", "--device", "cpu"]


def record_passes(path: str) -> None:
    """Append one JSON line per pass of the engine loop to `path`: [wall, step, post, deltas,
    engine thread CPU, event loop thread CPU] (seconds)."""
    from mimo_fn.serve import loop as L

    out, loop_clock, now = open(path, "a", buffering=1), time.pthread_getcpuclockid(threading.get_ident()), {}
    batched = hasattr(L.EngineLoop, "_post")  # else a loop from before one post per pass: time each delivery
    post_name = "_post" if batched else "_deliver"
    run, post, one_pass = L.Runner.run, getattr(L.EngineLoop, post_name), L.EngineLoop._pass

    def timed_run(self, plan):
        t = time.perf_counter()
        reply = run(self, plan)
        now.update(step=time.perf_counter() - t, deltas=len(reply.deltas))
        return reply

    def timed_post(self, *delivery):
        t = time.perf_counter()
        post(self, *delivery)
        now["post"] = now.get("post", 0.0) + time.perf_counter() - t

    def timed_pass(self):
        now.clear()
        t, cpu, aio = time.perf_counter(), time.thread_time(), time.clock_gettime(loop_clock)
        going = one_pass(self)
        if batched:
            self._post()  # in the pass's time (the loop posts after it returns; then there is nothing left)
        out.write(json.dumps([time.perf_counter() - t, now.get("step", 0.0), now.get("post", 0.0),
                              now.get("deltas", 0), time.thread_time() - cpu,
                              time.clock_gettime(loop_clock) - aio]) + "\n")
        return going

    L.Runner.run, L.EngineLoop._pass = timed_run, timed_pass
    setattr(L.EngineLoop, post_name, timed_post)


class StandInEngine:
    """What the loop needs of an Engine: every step gives each running request (at most 64) one
    token drawn from [4, vocab), after --host-ms of busy Python and --gpu-ms of sleep."""

    weight_version = "0"

    def __init__(self, host_s: float, gpu_s: float, vocab: int):
        from mimo_fn.engine.requests import RequestOutput

        self.out, self.host_s, self.gpu_s, self.vocab = RequestOutput, host_s, gpu_s, vocab
        self.next, self.waiting, self.running, self.pending = 0, [], {}, []

    def add_request(self, prompt, max_new_tokens, sampling=None, return_logprobs=False, return_routed_experts=False,
                    stop_token_ids=()):
        self.next += 1
        self.waiting.append({"rid": self.next, "left": max_new_tokens, "logprobs": return_logprobs})
        return self.next

    def _done(self, r: dict, reason: str, tokens: list[int]):
        from types import SimpleNamespace

        final = SimpleNamespace(finish_reason=reason, prompt_logprobs=None, routed_experts=None)
        return self.out(r["rid"], tokens, [-1.0] * len(tokens) if r["logprobs"] else None, reason, final)

    def abort(self, rid: int) -> bool:
        r = self.running.pop(rid, None) or next((w for w in self.waiting if w["rid"] == rid), None)
        self.waiting = [w for w in self.waiting if w["rid"] != rid]
        if r is not None:
            self.pending.append(self._done(r, "abort", []))
        return r is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    def step(self) -> list:
        import random

        outs, self.pending = self.pending, []
        while self.waiting and len(self.running) < 64:
            r = self.waiting.pop(0)
            self.running[r["rid"]] = r
        if not self.running:
            return outs
        t = time.perf_counter()
        while time.perf_counter() - t < self.host_s:
            pass
        time.sleep(self.gpu_s)
        for rid, r in list(self.running.items()):
            r["left"] -= 1
            tokens = [random.randrange(4, self.vocab)]
            if r["left"]:
                outs.append(self.out(rid, tokens, [-1.0] if r["logprobs"] else None))
            else:
                outs.append(self._done(self.running.pop(rid), "length", tokens))
        return outs

    def flush_cache(self, timeout: float = 30.0) -> bool:
        return True

    def server_info(self) -> dict:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting), "num_used_pages": 0,
                "num_free_pages": 1, "num_total_pages": 1, "page_size": 16, "max_total_num_tokens": 1 << 20}

    def warmup(self) -> None:
        pass


def serve(args) -> None:
    """The child: the server with its passes recorded."""
    record_passes(args.pass_log)
    flags = ["--host", "127.0.0.1", "--port", str(args.port), *FLAGS, "--max-running-requests", "64"]
    if not args.stand_in:
        from mimo_fn.serve.__main__ import main

        return main(flags)
    import dataclasses

    import mimo_fn as mf
    from mimo_fn.serve.args import parse_args
    from mimo_fn.serve.launch import run_http
    from mimo_fn.serve.loop import EngineLoop, Runner
    from mimo_fn.serve.tokenizer import tiny_tokenizer

    engine = StandInEngine(args.host_ms / 1e3, args.gpu_ms / 1e3, args.vocab)
    cfg = dataclasses.replace(mf.ModelConfig.tiny(), vocab_size=args.vocab)
    run_http(parse_args(flags), EngineLoop(Runner(engine), warmup=False), tiny_tokenizer(args.vocab), cfg, {}, 1 << 20)


def report(path: str, running: int) -> None:
    rows = [json.loads(line) for line in open(path)]
    full = [r for r in rows if r[3] >= running]  # decode passes with every stream running
    if not full:
        print(f"no pass had {running} streams running")
        return
    print(f"per pass with {running} streams running ({len(full)} passes), median / mean ms:")
    names = {0: "pass", 1: "engine step (Runner.run)", 2: "post deltas to the event loop", 4: "engine thread CPU",
             5: "event loop thread CPU"}
    for i, name in names.items():
        values = [1e3 * r[i] for r in full]
        print(f"  {name:32s} {statistics.median(values):8.2f} {statistics.mean(values):8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--stand-in", action="store_true", help="the stand-in engine instead of the tiny one")
    ap.add_argument("--host-ms", type=float, default=8.0, help="stand-in: busy Python per step (the GIL held)")
    ap.add_argument("--gpu-ms", type=float, default=4.5, help="stand-in: sleep per step (the GIL released)")
    ap.add_argument("--vocab", type=int, default=128, help="stand-in: token ids drawn below this (the tiny "
                    "tokenizer's reserved specials above 128)")
    ap.add_argument("--num-prompts", type=int, default=128, help="requests of the timed run")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens a request (random ids)")
    ap.add_argument("--output-len", type=int, default=128, help="new tokens a request")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pass-log", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)
    from mimo_fn.serve.process import ServerProcess, free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MIMO_FN_TYPECHECK": "0",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    tmp = tempfile.mkdtemp(prefix="serve_overhead_")
    port, log = free_port(), os.path.join(tmp, "passes.jsonl")
    child = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port), "--pass-log", log,
             "--host-ms", str(args.host_ms), "--gpu-ms", str(args.gpu_ms), "--vocab", str(args.vocab)]
    child += ["--stand-in"] if args.stand_in else []
    with ServerProcess(child, port=port, log_path=os.path.join(tmp, "server.log"), env=env, cwd=ROOT) as server:
        server.wait_healthy(300)
        subprocess.run([sys.executable, "-m", "mimo_fn.bench_serving", "--backend", "mimo_fn", "--base-url", server.url,
                        "--dataset-name", "random-ids", "--vocab-size", str(args.vocab), "--random-range-ratio", "1",
                        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                        "--warmup-requests", "4", "--disable-tqdm"], env=env, cwd=ROOT, check=True)
    report(log, args.concurrency)


if __name__ == "__main__":
    main()
