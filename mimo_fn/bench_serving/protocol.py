"""One request over HTTP, timed, and the server calls around a run.

Backends: `mimo_fn` and `sglang` speak SGLang's native `POST /generate` (`text` or `input_ids`,
`sampling_params`; a stream is server-sent events `data: {...}`, each carrying the cumulative
`text` / `output_ids` and `meta_info` with `prompt_tokens` / `completion_tokens`, then
`data: [DONE]`); `openai` speaks `POST /v1/completions` (a stream of `choices[0].text` pieces, and
`usage` in a last chunk, asked for with `stream_options.include_usage`).

Every request ends as a `RequestResult`; nothing raises out of `send_request`. A request
succeeds only if the server answered 200, a stream reached `[DONE]`, and no error or abort came
back; anything else (refused connection, dropped stream, timeout, HTTP error) is a failure with
its reason in `error`. Times are seconds of `time.perf_counter()` minus the run's start.
"""

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mimo_fn.bench_serving.workload import BenchRequest

BACKENDS = ("mimo_fn", "sglang", "openai")


@dataclass
class RequestResult:
    """What happened to one request (filled in while it streams; read-only afterwards)."""

    index: int
    prompt_len: int                     # the client's count of prompt tokens (0 if it has none)
    output_len: int                     # max_new_tokens asked for
    success: bool = False
    error: str = ""
    start: float = 0.0                  # sent
    first_token: float | None = None    # first chunk with a generated token arrived
    end: float = 0.0                    # last byte of the answer arrived (or the failure)
    chunks: list[tuple[float, int]] = field(default_factory=list)   # (arrival, tokens so far) per chunk with tokens
    prompt_tokens: int | None = None    # as the server reports them
    completion_tokens: int | None = None
    generated_text: str = ""
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        """Time to first token; a non-streamed answer's first token arrives with its last."""
        return (self.first_token if self.first_token is not None else self.end) - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def output_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.chunks[-1][1] if self.chunks else 0

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: each chunk's gap from the one before, spread evenly over the
        tokens it brought (a chunk can carry several: speculative decoding, a busy server)."""
        out: list[float] = []
        for (t0, n0), (t1, n1) in zip(self.chunks, self.chunks[1:]):
            if n1 > n0:
                out.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
        return out

    def to_json(self) -> dict:
        return {
            "index": self.index, "success": self.success, "error": self.error,
            "prompt_len": self.prompt_len, "output_len": self.output_len,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "start": self.start, "first_token": self.first_token, "end": self.end,
            "ttft": self.ttft, "latency": self.latency, "itl": self.itl,
            "chunks": [list(c) for c in self.chunks], "finish_reason": self.finish_reason,
            "generated_text": self.generated_text,
        }


@dataclass(frozen=True)
class Api:
    backend: str                 # one of BACKENDS
    base_url: str                # http://host:port, no trailing slash
    model: str | None = None     # the OpenAI `model` field
    stream: bool = True
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)        # merged into every payload (--extra-request-body)
    sampling: dict = field(default_factory=dict)          # merged into sampling_params / the OpenAI payload

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    @property
    def url(self) -> str:
        return self.base_url + ("/v1/completions" if self.backend == "openai" else "/generate")


def auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def make_client(max_connections: int | None = None) -> httpx.AsyncClient:
    """One client for a whole run: no pool limit (a queue in the client would count as TTFT),
    no proxies from the environment, and no httpx timeout (send_request bounds each request)."""
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        timeout=httpx.Timeout(None), trust_env=False, headers=auth_headers(),
    )


def build_payload(api: Api, req: BenchRequest) -> dict:
    prompt: Any = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    if api.backend == "openai":
        payload = {
            "model": api.model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": api.stream, "ignore_eos": api.ignore_eos, **api.sampling,
        }
        if api.stream:
            payload["stream_options"] = {"include_usage": True}
    else:
        payload = {
            ("input_ids" if isinstance(prompt, list) else "text"): prompt,
            "sampling_params": {
                "max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": api.ignore_eos, **api.sampling,
            },
            "stream": api.stream,
        }
    return {**payload, **api.extra_body}


def _finish(reason: Any) -> str | None:
    # SGLang's meta_info.finish_reason is {"type": "length", ...}; OpenAI's a string.
    return reason.get("type") if isinstance(reason, dict) else reason


def _error_text(obj: Any) -> str | None:
    if isinstance(obj, dict) and obj.get("error"):
        err = obj["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return None


def _take_native(res: RequestResult, data: dict, now: float) -> None:
    """Fold one /generate answer (a stream chunk or the whole answer) into `res`."""
    meta = data.get("meta_info") or {}
    res.generated_text = data.get("text", res.generated_text)
    if "prompt_tokens" in meta:
        res.prompt_tokens = int(meta["prompt_tokens"])
    before = res.chunks[-1][1] if res.chunks else 0
    if "completion_tokens" in meta:       # cumulative in every chunk
        n = res.completion_tokens = int(meta["completion_tokens"])
    elif "output_ids" in data:
        n = res.completion_tokens = len(data["output_ids"])
    else:                                 # no count at all: a chunk with text is a token
        n = before + (1 if data.get("text") else 0)
    if meta.get("finish_reason") is not None:
        res.finish_reason = _finish(meta["finish_reason"])
    if n > before:
        if res.first_token is None:
            res.first_token = now
        res.chunks.append((now, n))


def _take_openai(res: RequestResult, data: dict, now: float) -> None:
    usage = data.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        res.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        res.completion_tokens = int(usage["completion_tokens"])
    for choice in data.get("choices") or []:
        res.generated_text += choice.get("text") or ""
        if choice.get("finish_reason") is not None:
            res.finish_reason = _finish(choice["finish_reason"])
        # A piece with no text and no finish is a token whose characters are not complete yet:
        # it still arrived. A piece that only finishes brings no token.
        if choice.get("text") or choice.get("finish_reason") is None:
            if res.first_token is None:
                res.first_token = now
            res.chunks.append((now, (res.chunks[-1][1] if res.chunks else 0) + 1))


async def _stream(client: httpx.AsyncClient, api: Api, payload: dict, res: RequestResult, t0: float) -> None:
    take = _take_openai if api.backend == "openai" else _take_native
    async with client.stream("POST", api.url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            res.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        done = False
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue    # blank separators, SSE comments
            chunk = line[len("data:"):].strip()
            if chunk == "[DONE]":
                done = True
                break
            now = time.perf_counter() - t0
            data = json.loads(chunk)
            err = _error_text(data)
            if err is not None:
                res.error = f"error in stream: {err}"
                return
            take(res, data, now)
        res.end = time.perf_counter() - t0
        if not done:
            res.error = "the stream ended without [DONE]"
            return
    res.success = True


async def _whole(client: httpx.AsyncClient, api: Api, payload: dict, res: RequestResult, t0: float) -> None:
    resp = await client.post(api.url, json=payload)
    res.end = time.perf_counter() - t0
    if resp.status_code != 200:
        res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return
    data = resp.json()
    err = _error_text(data)
    if err is not None:
        res.error = err
        return
    if api.backend == "openai":
        _take_openai(res, data, res.end)
        res.chunks = [(res.end, res.output_tokens)] if res.output_tokens else []
    else:
        _take_native(res, data[0] if isinstance(data, list) else data, res.end)
    res.first_token = None   # one answer: TTFT is its latency
    res.success = True


async def send_request(client: httpx.AsyncClient, api: Api, req: BenchRequest, index: int, t0: float,
                       timeout: float | None = None) -> RequestResult:
    """Send `req`, time it against `t0` (a perf_counter reading), and never raise."""
    res = RequestResult(index=index, prompt_len=req.prompt_len, output_len=req.output_len)
    res.start = time.perf_counter() - t0
    body = _stream if api.stream else _whole
    try:
        await asyncio.wait_for(body(client, api, build_payload(api, req), res, t0), timeout)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001  (whatever broke the request, it is a failure with its reason)
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not res.success:
        res.end = time.perf_counter() - t0
    elif res.finish_reason == "abort":
        res.success, res.error = False, "the server aborted the request"
    return res


# --- the server calls around a run -----------------------------------------------------------

class FlushFailed(RuntimeError):
    pass


async def flush_cache(client: httpx.AsyncClient, base_url: str, timeout: float) -> None:
    """Empty the server's prefix cache once it is idle. The mimo_fn server waits up to `timeout`
    itself; SGLang refuses while requests run, so a refusal is retried until `timeout` passes.
    FlushFailed if it never flushed."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            resp = await client.post(base_url + "/flush_cache", json={"timeout": left}, timeout=left + 30.0)
            if resp.status_code == 200:
                return
            why = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise FlushFailed(f"POST /flush_cache did not flush within {timeout:g} s ({why})")
        await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))


def accept_length_from(info: Any) -> float | None:
    """The mean speculative acceptance length in a /get_server_info answer: top level
    (mimo_fn) or in `internal_states[0]` (SGLang; a PD deployment nests it under `decode[0]`)."""
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("decode"), list) and info["decode"]:
        info = info["decode"][0]
    value = info.get("avg_spec_accept_length")
    if value is None and isinstance(info.get("internal_states"), list) and info["internal_states"]:
        value = info["internal_states"][0].get("avg_spec_accept_length")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


async def get_json(client: httpx.AsyncClient, url: str) -> Any | None:
    """GET url's JSON, or None if it is not there (older servers, other backends)."""
    try:
        resp = await client.get(url, timeout=30.0)
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, json.JSONDecodeError):
        return None


async def accept_length(client: httpx.AsyncClient, base_url: str) -> float | None:
    return accept_length_from(await get_json(client, base_url + "/get_server_info"))


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first id of GET /v1/models (the OpenAI `model` field when --model is not given)."""
    models = await get_json(client, base_url + "/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    return data[0].get("id") if data else None
