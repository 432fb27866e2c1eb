"""The server's engine loop in this process (no HTTP): the real tiny engine behind EngineLoop, driven
from an asyncio loop as the handlers drive it. What the subprocess tests cannot provoke: a pass
that raises, and requests that arrive and leave while a flush holds admissions back."""

import asyncio

import pytest

from mimo_fn.serve.loop import EngineLoop, Job, Runner
from serve_util import one_torch_thread, random_prompts, tiny_engine

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


async def finish(loop: EngineLoop, job: Job):
    """(tokens, last delta) of one request."""
    stream = await loop.submit(job, loop.new_sid())
    tokens = []
    while True:
        delta = await stream.next()
        tokens += delta.tokens
        if delta.finish_reason is not None:
            return tokens, delta


def run_loop(engine, body):
    loop = EngineLoop(Runner(engine), warmup=False)

    async def main():
        loop.start(asyncio.get_running_loop())
        try:
            return await asyncio.wait_for(body(loop), 120)
        finally:
            loop.stop()

    return asyncio.run(main())


def test_a_failed_pass_ends_its_requests_and_the_loop_goes_on():
    engine = tiny_engine()
    p = random_prompts(1, [12], seed=40)[0]
    want = tiny_engine().generate([p], 6)[0].tokens
    real_pass, calls = engine._pass, []

    def failing_pass():  # the second pass raises, as an out-of-memory error in a step would
        calls.append(1)
        if len(calls) == 2:
            engine._pass = real_pass
            raise RuntimeError("out of memory (injected)")
        return real_pass()

    async def body(loop):
        engine._pass = failing_pass
        tokens, last = await finish(loop, Job(p, 6, None))
        assert len(tokens) == 1  # the prompt's pass gave its first token, the next one failed
        assert last.finish_reason == "error" and "out of memory (injected)" in last.error and loop.failed is None
        info = await loop.info()
        assert info["num_used_pages"] == 0 and info["num_running_reqs"] == 0  # the engine dropped it
        tokens, last = await finish(loop, Job(p, 6, None))
        assert tokens == want and last.finish_reason == "length"

    run_loop(engine, body)


def test_flush_holds_new_requests_back_and_they_can_leave_meanwhile():
    engine = tiny_engine(prefix_cache=True)
    long_p, p = random_prompts(2, [20, 40], seed=41)
    want = tiny_engine().generate([p], 5)[0].tokens

    async def body(loop):
        long_stream = await loop.submit(Job(long_p, 200, None), loop.new_sid())
        await long_stream.next()  # it runs
        flush = asyncio.ensure_future(loop.flush(60))
        await asyncio.sleep(0.05)
        held = asyncio.ensure_future(finish(loop, Job(p, 5, None)))  # admitted once the flush is done
        gone = loop.new_sid()
        leaving = asyncio.ensure_future(loop.submit(Job(p, 5, None), gone))
        await asyncio.sleep(0.05)
        loop.abort(gone)  # held back, and aborted before it ran: it hears the abort at once
        assert (await (await leaving).next()).finish_reason == "abort"
        assert not flush.done() and not held.done()
        assert await flush is True  # once the long request ran to its end
        while (delta := await long_stream.next()).finish_reason is None:
            pass
        assert delta.finish_reason == "length"
        tokens, last = await held
        assert tokens == want and last.finish_reason == "length"
        assert (await loop.info())["prefix_cache_entries"] == 1  # only the request admitted after the flush

    run_loop(engine, body)


def test_each_stream_gets_exactly_its_tokens_in_order():
    """A pass posts every request's delta in one call into the event loop: each stream still reads
    its own tokens, in order, to its own end (requests of different lengths, added in two passes)."""
    engine = tiny_engine()
    prompts = random_prompts(6, [7, 19, 33], seed=42)
    limits = [3, 9, 5, 12, 1, 7]
    want = [tiny_engine().generate([p], n)[0].tokens for p, n in zip(prompts, limits)]

    async def body(loop):
        first = [asyncio.ensure_future(finish(loop, Job(p, n, None))) for p, n in zip(prompts[:3], limits[:3])]
        await asyncio.sleep(0.05)
        later = [asyncio.ensure_future(finish(loop, Job(p, n, None))) for p, n in zip(prompts[3:], limits[3:])]
        got = await asyncio.gather(*first, *later)
        assert [tokens for tokens, _ in got] == want
        assert [last.finish_reason for _, last in got] == ["length"] * 6

    run_loop(engine, body)
