"""One request through the loop, as every API runs it: submit, read each pass's tokens, turn them
into text (stop strings end it: the engine's request is aborted), abort it when its client goes.

`Generator.start` hands a request to the engine; `Running.progress()` is an async generator of
`Progress`, one after each pass that gave the request tokens, the last one finished. The APIs
(http.py, openai_api.py) only format these.
"""

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from mimo_fn.serve.loop import EngineError, EngineLoop, Job, Stream, engine_sampling
from mimo_fn.serve.protocol import Sampling
from mimo_fn.serve.tokenizer import OutputText, TextTokenizer


@dataclass
class Progress:
    """A request's output so far (cumulative), and what the last pass added to its text."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""  # what may be shown now (a possible stop string's start held back)
    new_text: str = ""  # text added by the last pass
    finish: dict | None = None  # SGLang's {"type": "stop" | "length" | "abort", "matched" / "length" / "message"}
    prompt_logprobs: list[float] | None = None  # at the finish, when asked
    routed_experts: torch.Tensor | None = None  # [prompt + output - 1, MoE layers, K], at the finish, when asked
    started: float = field(default_factory=time.perf_counter)

    def snapshot(self) -> "Progress":
        return dataclasses.replace(self, output_ids=list(self.output_ids), logprobs=list(self.logprobs))

    @property
    def finish_reason(self) -> str | None:
        return None if self.finish is None else self.finish["type"]

    @property
    def latency(self) -> float:
        return time.perf_counter() - self.started


@dataclass(frozen=True)
class Ask:
    """One prompt to run and how (the API-level view; `job` is the engine's)."""

    prompt: list[int]
    sampling: Sampling
    return_logprobs: bool = False
    return_routed_experts: bool = False
    rid: str | None = None


class Running:
    """A request the engine took: `progress()` reads its passes to its end (once); `close()`
    aborts it unless it ended (also what an interrupted `progress()` does)."""

    def __init__(self, gen: "Generator", ask: Ask, job: Job, rid: str, sid: int, stream: Stream, started: float):
        self.gen, self.ask, self.job, self.rid, self.sid, self.stream = gen, ask, job, rid, sid, stream
        self.done = False
        self.p = Progress(rid, ask.prompt, ask.sampling.max_new_tokens, started=started)

    def close(self) -> None:
        self.gen.in_flight.pop(self.rid, None)
        if not self.done:  # its client went away, or the call failed
            self.done = True
            self.gen.loop.abort(self.sid)

    async def progress(self) -> AsyncIterator[Progress]:
        p, ask = self.p, self.ask
        text = OutputText(self.gen.tok, ask.sampling.stop)
        shown = ""  # the text of the last Progress handed out
        aborted = False  # for a stop string
        try:
            while not self.done:
                delta = await self.stream.next()
                if delta.finish_reason == "error":
                    self.done = True
                    raise (RuntimeError if self.gen.loop.failed else EngineError)(delta.error)
                if p.finish is None:
                    self._take(text, delta)
                if delta.finish_reason is not None:  # the engine's end, or the abort a stop string asked for
                    self.done = True
                    p.prompt_logprobs = delta.prompt_logprobs
                    if delta.routed_experts is not None:  # rows of the tokens fed: prompt and output but the last
                        p.routed_experts = delta.routed_experts[:len(p.prompt) + len(p.output_ids) - 1]
                    if p.finish is None:
                        p.finish = self._finish(delta.finish_reason)
                    text.finish()
                elif p.finish is not None:  # a stop string: end the engine's request
                    if not aborted:
                        self.gen.loop.abort(self.sid)
                        aborted = True
                    # its prompt log-probs and routed experts come with the abort's last outputs
                    self.done = not (ask.return_logprobs or ask.return_routed_experts)
                    if not self.done:
                        continue  # the end is handed out with them
                    text.finish()
                p.text = text.visible
                p.new_text, shown = p.text[len(shown):], p.text
                if p.new_text or self.done or delta.tokens:
                    yield p
        finally:
            self.close()

    def _take(self, text: OutputText, delta) -> None:
        """Add a pass's tokens, one by one: a stop string may end the output inside them."""
        p = self.p
        for i, t in enumerate(delta.tokens):
            p.output_ids.append(t)
            if delta.logprobs is not None:
                p.logprobs.append(delta.logprobs[i])
            if delta.finish_reason == "stop" and i == len(delta.tokens) - 1 and t in self.job.stop_token_ids:
                p.finish = {"type": "stop", "matched": t}  # the stop token: in output_ids, not in the text
                return
            text.push(t)
            if text.stopped is not None:
                p.finish = {"type": "stop", "matched": text.stopped}
                return

    def _finish(self, reason: str) -> dict:
        if reason == "length":
            return {"type": "length", "length": self.ask.sampling.max_new_tokens}
        if reason == "abort":
            return {"type": "abort", "message": "aborted"}
        return {"type": "stop", "matched": self.p.output_ids[-1] if self.p.output_ids else None}


class Generator:
    """The server's requests: the loop, the tokenizer, and the client rids in flight."""

    def __init__(self, loop: EngineLoop, tok: TextTokenizer):
        self.loop, self.tok = loop, tok
        self.in_flight: dict[str, int] = {}  # client rid -> sid
        self.num_requests = 0  # requests the engine took since the start

    def job(self, ask: Ask) -> Job:
        s = ask.sampling
        stops = s.stop_token_ids + (() if s.ignore_eos else self.tok.eos_token_ids)
        return Job(ask.prompt, s.max_new_tokens, engine_sampling(s.temperature, s.top_p, s.top_k, s.seed),
                   ask.return_logprobs, ask.return_routed_experts, tuple(dict.fromkeys(stops)))

    def abort(self, rid: str | None = None) -> bool:
        """Abort a client rid (None: every request in flight); whether any was found."""
        sids = list(self.in_flight.values()) if rid is None else [self.in_flight[rid]] if rid in self.in_flight else []
        for sid in sids:
            self.loop.abort(sid)
        return bool(sids)

    async def start(self, ask: Ask, field: str) -> Running:
        """Hand a request to the engine. A ValueError (the engine rejected it) names `field`."""
        started = time.perf_counter()
        rid = ask.rid or uuid.uuid4().hex
        if rid in self.in_flight:
            raise ValueError(f"rid: {rid!r} is in flight already")
        sid = self.loop.new_sid()
        self.in_flight[rid] = sid
        job = self.job(ask)
        try:
            stream = await self.loop.submit(job, sid)
        except ValueError as e:
            self.in_flight.pop(rid, None)
            raise ValueError(f"{field}: {e}") from None
        except BaseException:  # cancelled while it waited: it may have been admitted
            self.in_flight.pop(rid, None)
            self.loop.abort(sid)
            raise
        self.num_requests += 1
        return Running(self, ask, job, rid, sid, stream, started)

    async def start_all(self, asks: Sequence[Ask], field: str) -> list[Running]:
        """start() each, in one pass; if one fails, the others are aborted and its error raised."""
        got = await asyncio.gather(*(self.start(a, f"{field}[{i}]" if len(asks) > 1 else field)
                                     for i, a in enumerate(asks)), return_exceptions=True)
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            for g in got:
                if isinstance(g, Running):
                    g.close()
            raise failed[0]
        return got


async def finish_all(runs: Sequence[Running]) -> list[Progress]:
    """Read every request to its end; their final Progress, in order. Interrupted: all are aborted."""
    async def last(run: Running) -> Progress:
        async for _ in run.progress():
            pass
        return run.p

    try:
        return list(await asyncio.gather(*(last(r) for r in runs)))
    finally:
        for r in runs:
            r.close()


async def merged(runs: Sequence[Running]) -> AsyncIterator[tuple[int, Progress]]:
    """(index, progress) of several requests as they come. Closed early: all are aborted.
    One request (what most streams are) is read in the caller's task: its Progress itself, which
    the caller formats before asking for the next; several are read by a task each, into one
    queue, as copies (a request runs ahead of a reader still busy with another's)."""
    if len(runs) == 1:
        progress = runs[0].progress()
        try:
            async for p in progress:
                yield 0, p
        finally:
            await progress.aclose()
            runs[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: Running) -> None:
        try:
            async for p in run.progress():
                q.put_nowait((i, p.snapshot(), None))
            q.put_nowait((i, None, None))
        except BaseException as e:  # noqa: BLE001  handed to the reader, which raises it
            q.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, p, err = await q.get()
            if err is not None:
                raise err
            if p is None:
                left -= 1
            else:
                yield i, p
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.close()


async def until_disconnect(receive) -> None:
    """Returns when the client has gone (the ASGI http.disconnect message); the body is read already."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def or_disconnect(receive, coro):
    """coro's result, unless the client goes first: then coro is cancelled and ClientGone raised."""
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


def server_watches_disconnect(scope: dict) -> bool:
    """Whether Starlette's StreamingResponse cancels the body itself when the client goes: it listens
    for http.disconnect while it streams where the server speaks ASGI before 2.4 (uvicorn says 2.3);
    from 2.4 on it learns of it only from a send that fails."""
    version = scope.get("asgi", {}).get("spec_version", "2.0")
    try:
        return tuple(int(v) for v in version.split(".")) < (2, 4)
    except ValueError:  # not a version: watch ourselves
        return False


async def unless_disconnect(receive, agen: AsyncIterator) -> AsyncIterator:
    """agen's items until the client goes (then agen is cancelled and closed: its requests abort).
    A stream's body where the response does not watch for the disconnect itself
    (server_watches_disconnect): each item is raced against the client going, a task per item."""
    watch = asyncio.ensure_future(until_disconnect(receive))
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(agen.__anext__())
            await asyncio.wait({nxt, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        watch.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        await agen.aclose()
