"""Soak the HTTP server on the tiny model: many concurrent requests of every kind, then check that
none was lost, every greedy answer is what the prompt gets alone, and no KV page leaked.

    python scripts/serve_soak.py                                   # 1000 requests, 64 at a time
    python scripts/serve_soak.py --num-requests 200 --concurrency 48
    python scripts/serve_soak.py --base-url http://127.0.0.1:30000 # a running `python -m mimo_fn.serve`
                                                                   # without --model-path (the tiny model)

Without --base-url it starts `python -m mimo_fn.serve` on a free port (the tiny model, fp32 on the
CPU, --page-size and --max-total-tokens below: a pool that makes requests wait). Each request is one
of: SGLang-native /generate (input_ids or text; greedy or sampled; one prompt or a batch; whole or
streamed), OpenAI /v1/completions (whole or streamed), an invalid body (a 400 naming the field), a
request aborted through /abort_request (streamed: after a random number of chunks; whole: after a
random delay), or a client that disconnects mid-stream or before the answer. Then:
- lost: requests that got no answer within --request-timeout, a transport error, or an unexpected
  status (500, 503, a 400 for a valid body): must be 0;
- mismatches: greedy answers (whole, or up to their abort or disconnect) that differ from the prompt
  run alone in this process (Engine.generate on the same seed's weights, fp32), except where they part
  at a near-tie of the reference (its top two logits within 1e-4: fp32 rounding of another batch may
  pick either): must be 0;
- pages leaked: /get_server_info's num_used_pages once nothing runs and /flush_cache returned: must be 0;
- the server still answers /health and a greedy /generate as before.
The exit code is 0 only if all hold. The figures of a full-size run are in docs/benchmarks.md.
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import torch

import mimo_fn as mf
from mimo_fn.bench.cli import HelpFormatter
from mimo_fn.serve.process import ServerProcess, launch_server
from mimo_fn.serve.tokenizer import tiny_tokenizer

TIE_TOL = 1e-4  # a near-tie: the top two logits within this much (relative to the top, at least absolute)
# kind -> weight in the mix
KINDS = {"native": 20, "text": 8, "batch": 8, "stream": 14, "batch_stream": 4, "sampled": 6, "openai": 8,
         "openai_stream": 6, "invalid": 8, "abort": 6, "abort_whole": 3, "disconnect": 6, "disconnect_whole": 3}
INVALID = [  # (path, body, the field the 400's message must name)
    ("/generate", b'{"input_ids": [1, 2', "body"),
    ("/generate", {"input_ids": [1, 2, 128]}, "input_ids[2]"),
    ("/generate", {"input_ids": [[1], [2, -1]]}, "input_ids[1][1]"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "input_ids"),
    ("/generate", {"input_ids": list(range(4, 100)) * 50}, "input_ids"),  # past max_position_embeddings
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [500]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "m", "prompt": [5, 300]}, "prompt[1]"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "n": 2}, "n"),
    ("/abort_request", {"rid": 5}, "rid"),
]


@dataclass
class Spec:
    """One request of the soak."""

    i: int
    kind: str  # a key of KINDS
    prompts: list[list[int]]  # token ids (text: the tokenizer's ids of `text`)
    max_new: int
    ignore_eos: bool
    text: str | None = None
    cut: int = 0  # abort / disconnect: after this many stream chunks, or this many ms (whole)
    invalid: tuple | None = None  # an entry of INVALID

    @property
    def greedy(self) -> bool:
        return self.kind not in ("sampled", "invalid")


@dataclass
class Result:
    status: str  # completed | aborted | rejected | disconnected | lost
    outputs: list[list[int]] = field(default_factory=list)  # per prompt (OpenAI: none, see texts)
    texts: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    detail: str = ""


def workload(n: int, seed: int, vocab: int, tok, max_prompt: int, max_new: int) -> list[Spec]:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    specs = []
    for i in range(n):
        kind = rng.choices(kinds, weights)[0]
        num = rng.randint(2, 3) if kind.startswith("batch") else 1
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(num)]
        text = None
        if kind == "text":
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.\n") for _ in range(rng.randint(1, max_prompt)))
            prompts = [tok.encode(text)]
        long = kind.startswith(("abort", "disconnect"))  # still running when it is cut
        limit = rng.randint(max_new, 4 * max_new) if long else rng.randint(1, max_new)
        spec = Spec(i, kind, prompts, limit, ignore_eos=long or rng.random() < 0.7, text=text,
                    cut=rng.randint(1, 6) if kind in ("abort", "disconnect") else rng.randint(1, 300))
        if kind == "invalid":
            spec.invalid = rng.choice(INVALID)
        specs.append(spec)
    return specs


# ---- references: each greedy prompt alone, in this process ----

class References:
    """Greedy answers of prompts alone (Engine.generate in this process, fp32), each as long as the
    longest answer it is compared with: greedy's path to n tokens is the start of its path to more."""

    def __init__(self, cfg: mf.ModelConfig, params: mf.Params, eos: tuple[int, ...]):
        self.cfg, self.params, self.eos = cfg, params, eos
        self.need: dict[tuple, int] = {}  # (prompt, stops) -> tokens wanted
        self.tokens: dict[tuple, list[int]] = {}

    def key(self, prompt: list[int], ignore_eos: bool) -> tuple:
        return tuple(prompt), () if ignore_eos else self.eos

    def want(self, prompt: list[int], ignore_eos: bool, n: int) -> None:
        k = self.key(prompt, ignore_eos)
        self.need[k] = max(self.need.get(k, 0), n)

    def run(self) -> None:
        engine = mf.Engine(self.cfg, self.params, mf.EngineConfig(max_tokens=1 << 16, page_size=16, max_batch=256))
        for stops in {k[1] for k in self.need}:
            keys = [k for k in self.need if k[1] == stops and k not in self.tokens]
            outs = engine.generate([list(k[0]) for k in keys], max_new_tokens=[self.need[k] for k in keys],
                                   stop_token_ids=list(stops))
            self.tokens.update((k, out.tokens) for k, out in zip(keys, outs))

    def answer(self, prompt: list[int], ignore_eos: bool, max_new: int) -> list[int]:
        return self.tokens[self.key(prompt, ignore_eos)][:max_new]

    def near_tie(self, prompt: list[int], tokens: list[int], d: int) -> bool:
        """Whether the top two logits after prompt + tokens[:d] are within TIE_TOL."""
        top2 = mf.forward(self.params, self.cfg, torch.tensor(prompt + tokens[:d]))[-1].topk(2).values
        return bool(top2[0] - top2[1] <= TIE_TOL * max(1.0, abs(float(top2[0]))))


def agrees(refs: References, s: Spec, j: int, res: Result, tok) -> str:
    """"equal", "tie" (parts from the prompt's answer alone at a near-tie there) or "mismatch".
    An answer cut short (abort, disconnect) may be any start of it. OpenAI answers come as text."""
    prompt, partial = s.prompts[j], res.status in ("aborted", "disconnected")
    ref = refs.answer(prompt, s.ignore_eos, s.max_new)
    if res.outputs:
        got = res.outputs[j]
        if got == ref or (partial and ref[:len(got)] == got):
            return "equal"
        d = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    else:
        text = res.texts[j]
        if text in (text_of(tok, ref), tok.decode(ref)):
            return "equal"
        d = max(i for i in range(len(ref) + 1) if text.startswith(tok.decode(ref[:i])))
    return "tie" if d < len(ref) and refs.near_tie(prompt, ref, d) else "mismatch"


def text_of(tok, tokens: list[int]) -> str:
    """An answer's text: a stop token the engine keeps last is not part of it."""
    return tok.decode(tokens[:-1] if tokens and tokens[-1] in tok.eos_token_ids else tokens)


# ---- the requests ----

def _sse(line: str):
    if not line.startswith("data: "):
        return None
    data = line[len("data: "):]
    return "[DONE]" if data == "[DONE]" else json.loads(data)


def _native_body(s: Spec, stream: bool, rid: str | None = None) -> dict:
    sampling = {"max_new_tokens": s.max_new, "temperature": 0.0, "ignore_eos": s.ignore_eos}
    if s.kind == "sampled":
        sampling.update(temperature=0.8, top_k=20, seed=s.i)
    body = {"sampling_params": sampling, "stream": stream}
    if s.text is not None:
        body["text"] = s.text
    else:
        body["input_ids"] = s.prompts if s.kind.startswith("batch") else s.prompts[0]
    return body | ({"rid": rid} if rid else {})


def _native_result(answer, status: str = "completed") -> Result:
    answers = answer if isinstance(answer, list) else [answer]
    finish = [a["meta_info"]["finish_reason"]["type"] for a in answers]
    return Result("aborted" if "abort" in finish else status, [a["output_ids"] for a in answers],
                  [a["text"] for a in answers], finish)


async def _read_stream(r: httpx.Response, num: int, cut: int | None = None, on_cut=None) -> list[dict | None]:
    """The last event of each index of a native stream; each must extend the one before. cut:
    after that many events call on_cut() (abort) or, without it, stop reading (disconnect)."""
    last: list[dict | None] = [None] * num
    seen = 0
    async for line in r.aiter_lines():
        ev = _sse(line)
        if ev is None:
            continue
        if ev == "[DONE]":
            break
        if "error" in ev:
            raise AssertionError(f"the stream carried an error: {ev['error']}")
        i = ev.get("index", 0)
        before = last[i]["output_ids"] if last[i] is not None else []
        if ev["output_ids"][:len(before)] != before:
            raise AssertionError(f"stream index {i}: output_ids {ev['output_ids']} do not extend {before}")
        last[i] = ev
        seen += 1
        if cut is not None and seen == cut:
            if on_cut is None:
                return last
            await on_cut()
    return last


async def _run(client: httpx.AsyncClient, s: Spec, model: str) -> Result:
    if s.kind == "invalid":
        path, body, name = s.invalid
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await client.post(path, headers={"content-type": "application/json"}, **kw)
        msg = r.json().get("error", {}).get("message", "") if r.headers.get("content-type", "").startswith(
            "application/json") else ""
        if r.status_code == 400 and name in msg:
            return Result("rejected", detail=msg)
        return Result("lost", detail=f"{path} {body!r:.60}: {r.status_code} {r.text[:200]}")
    if s.kind.startswith("openai"):
        stream = s.kind == "openai_stream"
        body = {"model": model, "prompt": s.prompts[0], "max_tokens": s.max_new, "temperature": 0.0,
                "ignore_eos": s.ignore_eos, "stream": stream}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return Result("lost", detail=f"{r.status_code} {r.text[:200]}")
            c = r.json()["choices"][0]
            return Result("completed", texts=[c["text"]], finish=[c["finish_reason"]])
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result("lost", detail=f"{r.status_code} {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                ev = _sse(line)
                if ev is None or ev == "[DONE]" or not ev.get("choices"):
                    continue
                text += ev["choices"][0]["text"]
                finish = ev["choices"][0]["finish_reason"] or finish
        return Result("completed", texts=[text], finish=[finish])
    if s.kind in ("native", "text", "batch", "sampled"):
        r = await client.post("/generate", json=_native_body(s, False))
        return _native_result(r.json()) if r.status_code == 200 else Result("lost", detail=f"{r.status_code} {r.text}")
    if s.kind == "abort_whole":
        rid = f"soak-{s.i}-{random.getrandbits(32):x}"
        task = asyncio.ensure_future(client.post("/generate", json=_native_body(s, False, rid)))
        await asyncio.sleep(s.cut / 1000)
        await client.post("/abort_request", json={"rid": rid})
        r = await task
        return _native_result(r.json()) if r.status_code == 200 else Result("lost", detail=f"{r.status_code} {r.text}")
    if s.kind == "disconnect_whole":  # the client gives up waiting: its connection closes
        try:
            r = await asyncio.wait_for(client.post("/generate", json=_native_body(s, False)), s.cut / 1000)
        except asyncio.TimeoutError:
            return Result("disconnected")
        return _native_result(r.json()) if r.status_code == 200 else Result("lost", detail=f"{r.status_code} {r.text}")
    # streams: whole, aborted after `cut` chunks, or left after `cut` chunks
    rid = f"soak-{s.i}-{random.getrandbits(32):x}" if s.kind == "abort" else None
    on_cut = (lambda: client.post("/abort_request", json={"rid": rid})) if rid else None
    cut = s.cut if s.kind in ("abort", "disconnect") else None
    async with client.stream("POST", "/generate", json=_native_body(s, True, rid)) as r:
        if r.status_code != 200:
            return Result("lost", detail=f"{r.status_code} {(await r.aread())[:200]!r}")
        last = await _read_stream(r, len(s.prompts), cut, on_cut)
    if s.kind == "disconnect" and any(ev is None or ev["meta_info"]["finish_reason"] is None for ev in last):
        return Result("disconnected", [[] if ev is None else ev["output_ids"] for ev in last])
    if any(ev is None for ev in last):
        return Result("lost", detail="a stream ended without its answer")
    return _native_result(last)


async def _one(client: httpx.AsyncClient, s: Spec, model: str, timeout: float, gate: asyncio.Semaphore) -> Result:
    async with gate:
        try:
            return await asyncio.wait_for(_run(client, s, model), timeout)
        except asyncio.TimeoutError:
            return Result("lost", detail=f"no answer within {timeout:g} s")
        except (httpx.HTTPError, AssertionError, KeyError, ValueError) as e:
            return Result("lost", detail=f"{type(e).__name__}: {e}")


async def drive(url: str, specs: list[Spec], concurrency: int, timeout: float) -> list[Result]:
    """Send every spec, at most `concurrency` at once; their results in order."""
    limits = httpx.Limits(max_connections=2 * concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(_one(client, s, model, timeout, gate) for s in specs)))


# ---- after the soak ----

def settle(url: str, timeout: float = 60.0) -> dict:
    """/get_server_info once nothing runs or waits (an abort frees its pages a pass later)."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        if info["num_running_reqs"] == info["num_waiting_reqs"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def check(specs: list[Spec], results: list[Result], refs: References, tok) -> dict:
    """Counts by status, and the greedy answers that differ from the prompt's answer alone."""
    counts = {k: 0 for k in ("completed", "aborted", "rejected", "disconnected", "lost")}
    compare, problems = [], []
    for s, res in zip(specs, results):
        counts[res.status] += 1
        if res.status == "lost":
            problems.append(f"request {s.i} ({s.kind}) lost: {res.detail}")
        elif res.status == "completed" and any(len(o) > s.max_new for o in res.outputs):
            problems.append(f"request {s.i} ({s.kind}): more tokens than max_new_tokens")
        elif s.greedy and res.status != "rejected" and (res.outputs or res.texts):
            for j, p in enumerate(s.prompts):
                cut = res.status in ("aborted", "disconnected")
                refs.want(p, s.ignore_eos, max(len(res.outputs[j]), 1) if cut else s.max_new)
                compare.append((s, j, res))
    refs.run()
    mismatches = ties = 0
    for s, j, res in compare:
        verdict = agrees(refs, s, j, res, tok)
        ties += verdict == "tie"
        if verdict == "mismatch":
            mismatches += 1
            got = res.outputs[j] if res.outputs else res.texts[j]
            problems.append(f"request {s.i} ({s.kind}, prompt {j}): got {got!r}, alone "
                            f"{refs.answer(s.prompts[j], s.ignore_eos, s.max_new)}")
    return {**counts, "mismatches": mismatches, "near_ties": ties, "problems": problems}


def soak(url: str, specs: list[Spec], refs: References, tok, concurrency: int, timeout: float) -> dict:
    """Run the soak against a server at url; the summary (the table's rows, and what went wrong)."""
    t0 = time.perf_counter()
    results = asyncio.run(drive(url, specs, concurrency, timeout))
    duration = time.perf_counter() - t0
    settle(url)
    flushed = httpx.post(url + "/flush_cache", json={"timeout": 60}, timeout=90).json().get("success") is True
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    healthy = httpx.get(url + "/health", timeout=30).status_code == 200
    probe = Spec(len(specs), "native", [list(range(5, 25))], 8, ignore_eos=True)  # the server still answers
    if healthy:
        r = httpx.post(url + "/generate", json=_native_body(probe, False), timeout=timeout)
        healthy = r.status_code == 200
        refs.want(probe.prompts[0], probe.ignore_eos, probe.max_new)
    summary = check(specs, results, refs, tok)  # runs the references
    healthy = healthy and agrees(refs, probe, 0, _native_result(r.json()), tok) == "equal"
    if not flushed:
        summary["problems"].append("/flush_cache did not succeed")
    if not healthy:
        summary["problems"].append("the server does not answer /health and a greedy /generate as before")
    return {"requests": len(specs), "concurrency": concurrency, **summary, "pages_leaked": info["num_used_pages"],
            "running_after": info["num_running_reqs"] + info["num_waiting_reqs"], "healthy": healthy,
            "duration_s": round(duration, 1)}


def passed(summary: dict) -> bool:
    return (summary["lost"] == summary["mismatches"] == summary["pages_leaked"] == summary["running_after"] == 0
            and summary["healthy"] and not summary["problems"])


def table(summary: dict) -> str:
    rows = [("requests", summary["requests"]), ("concurrency", summary["concurrency"]),
            ("completed", summary["completed"]), ("aborted", summary["aborted"]),
            ("disconnected", summary["disconnected"]), ("rejected (400)", summary["rejected"]),
            ("lost", summary["lost"]), ("mismatches", summary["mismatches"]),
            ("near-ties (not mismatches)", summary["near_ties"]), ("pages leaked", summary["pages_leaked"]),
            ("healthy after", "yes" if summary["healthy"] else "NO"), ("duration", f"{summary['duration_s']} s")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- the server this script starts ----

def start_server(args, log_path: str) -> ServerProcess:
    """The tiny server on a free port of 127.0.0.1; SystemExit, with the end of its log, if it does
    not become healthy."""
    flags = ["--device", "cpu", "--page-size", str(args.page_size), "--max-total-tokens", str(args.max_total_tokens),
             "--random-seed", str(args.random_seed), "--skip-warmup", "--log-level", "warning"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        return launch_server(flags, log_path=log_path, env=env)
    except RuntimeError as e:
        raise SystemExit(f"serve_soak.py: {e}") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="serve_soak.py", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000, help="requests to send")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    ap.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    ap.add_argument("--base-url", default=None,
                    help="a running tiny-model server (default: none: start one on a free port)")
    ap.add_argument("--random-seed", type=int, default=0, help="seed of the tiny weights (the server's --random-seed)")
    ap.add_argument("--page-size", type=int, default=16, help="the started server's --page-size")
    ap.add_argument("--max-total-tokens", type=int, default=2048,
                    help="the started server's KV pool (small, so that requests wait for pages)")
    ap.add_argument("--max-prompt-len", type=int, default=80, help="longest random prompt, in tokens")
    ap.add_argument("--max-new-tokens", type=int, default=48,
                    help="longest answer of a request run to its end (aborted ones ask for up to 4x)")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds a request may take before it counts as lost")
    ap.add_argument("--json", default=None, help="also write the summary to this file (default: none)")
    ap.add_argument("--server-log", default="serve_soak_server.log", help="the started server's log file")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the reference steps are tiny; the server needs the other core
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=args.random_seed)
    tok = tiny_tokenizer(cfg.vocab_size)
    specs = workload(args.num_requests, args.seed, cfg.vocab_size, tok, args.max_prompt_len, args.max_new_tokens)
    refs = References(cfg, params, tuple(tok.eos_token_ids))
    server = None if args.base_url else start_server(args, args.server_log)
    url = args.base_url.rstrip("/") if args.base_url else server.url
    try:
        summary = soak(url, specs, refs, tok, args.concurrency, args.request_timeout)
    finally:
        if server is not None:
            server.stop()
    print(table(summary))
    for p in summary["problems"][:20]:
        print("  " + p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if passed(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
