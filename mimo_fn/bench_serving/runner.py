"""The run itself: warm-ups, the cache flush, then every request at its arrival time, at most
`max_concurrency` in flight, with a progress bar; then the server's acceptance length."""

import asyncio
import sys
import time
from dataclasses import dataclass, replace

from tqdm import tqdm

from mimo_fn.bench_serving.protocol import (
    Api, RequestResult, accept_length, flush_cache, make_client, send_request,
)
from mimo_fn.bench_serving.workload import BenchRequest

WARMUP_OUTPUT_LEN = 32   # a warm-up compiles and captures; it need not decode long (SGLang's cap too)


@dataclass(frozen=True)
class RunConfig:
    api: Api
    requests: tuple[BenchRequest, ...]
    arrivals: tuple[float, ...]          # send time of each request, s from the start
    max_concurrency: int | None = None   # None: no cap
    warmup_requests: int = 1
    flush_cache: bool = False
    flush_timeout: float = 300.0
    request_timeout: float | None = None
    disable_tqdm: bool = False

    def __post_init__(self):
        if len(self.arrivals) != len(self.requests):
            raise ValueError(f"{len(self.arrivals)} arrival times for {len(self.requests)} requests")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"--request-timeout must be > 0, got {self.request_timeout}")


@dataclass(frozen=True)
class RunOutput:
    results: list[RequestResult]   # in request order
    duration: float                # s from the first send to the last answer
    accept_length: float | None


class WarmupFailed(RuntimeError):
    pass


async def _warmup(client, cfg: RunConfig) -> None:
    """`warmup_requests` copies of the first request at once, decoding at most WARMUP_OUTPUT_LEN.
    Any failure stops the run: numbers taken after a failing warm-up would measure a broken server."""
    if cfg.warmup_requests == 0:
        return
    first = cfg.requests[0]
    req = replace(first, output_len=min(first.output_len, WARMUP_OUTPUT_LEN))
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[
        send_request(client, cfg.api, req, i, t0, cfg.request_timeout) for i in range(cfg.warmup_requests)
    ])
    bad = [r for r in outs if not r.success]
    if bad:
        raise WarmupFailed(f"{len(bad)} of {len(outs)} warm-up requests failed; the first: {bad[0].error}")


async def run(cfg: RunConfig) -> RunOutput:
    limit = cfg.max_concurrency or len(cfg.requests)
    async with make_client(max_connections=limit + cfg.warmup_requests + 4) as client:
        await _warmup(client, cfg)
        if cfg.flush_cache:
            await flush_cache(client, cfg.api.base_url, cfg.flush_timeout)
        sem = asyncio.Semaphore(limit)
        bar = tqdm(total=len(cfg.requests), desc="requests", unit="req", file=sys.stderr, disable=cfg.disable_tqdm)
        failed = 0

        async def one(i: int, req: BenchRequest, t0: float) -> RequestResult:
            nonlocal failed
            async with sem:
                res = await send_request(client, cfg.api, req, i, t0, cfg.request_timeout)
            failed += not res.success
            if failed:
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for i, (req, at) in enumerate(zip(cfg.requests, cfg.arrivals)):
            wait = at - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, req, t0)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        bar.close()
        return RunOutput(results, duration, await accept_length(client, cfg.api.base_url))
