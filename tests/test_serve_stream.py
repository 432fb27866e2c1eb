"""The streaming path's parts in this process: a /generate stream chunk encoded incrementally is
byte for byte json.dumps of the whole answer, and a client that goes while a stream waits for its
next tokens closes the stream's body (its requests abort) whichever side watches for it."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi import Request

from mimo_fn.serve.context import event_stream
from mimo_fn.serve.generation import Progress
from mimo_fn.serve.http import GrowingIds, native_chunk, native_result
from mimo_fn.serve.protocol import GenerateRequest, parse
from mimo_fn.serve.tokenizer import tiny_tokenizer


class FixedProgress(Progress):
    latency = 1.25  # e2e_latency: the same in both encodings


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6, 7]},
    {"input_ids": [[5, 6], [7]], "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0},
])
def test_a_native_chunk_is_json_dumps_of_the_answer(body):
    req = parse(GenerateRequest, {**body, "stream": True}, context={"vocab_size": 152576})
    ctx = SimpleNamespace(tok=tiny_tokenizer(128))
    p = FixedProgress("rïd-1", [5, 6, 7], 16, prompt_logprobs=[-0.5, -1.0])
    ids = GrowingIds()
    for new in ([], [3], [4, 100000], [], [7, 8, 9], [11]):  # a pass may bring none or several
        p.output_ids += new
        p.logprobs += [-0.25 * (i + 1) for i in range(len(new))]
        p.text += "é\u65e5x" if new else ""
        p.finish = {"type": "length", "length": 16} if new == [11] else None
        index = 1 if req.is_batch else None
        want = native_result(ctx, p, req) | ({} if index is None else {"index": index})
        assert native_chunk(ctx, p, req, ids, index) == json.dumps(want, ensure_ascii=False)


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # Starlette watches itself before 2.4; from 2.4 event_stream does
def test_a_client_that_goes_closes_a_waiting_stream(spec):
    async def main():
        closed, gone, sent = asyncio.Event(), asyncio.Event(), []

        async def payloads():
            try:
                yield {"n": 1}
                await asyncio.Event().wait()  # no more tokens for now
            finally:
                closed.set()  # merged() / progress() abort their requests here

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body", b"").startswith(b"data: {"):
                gone.set()  # the client reads the first event, then goes

        scope = {"type": "http", "asgi": {"spec_version": spec}, "method": "POST", "path": "/generate",
                 "headers": [], "query_string": b""}
        response = event_stream(Request(scope, receive), payloads())
        await asyncio.wait_for(response(scope, receive, send), 10)
        assert closed.is_set()
        assert sent[1]["body"] == b'data: {"n": 1}\n\n'

    asyncio.run(main())
