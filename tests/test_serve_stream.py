"""The streaming path's parts in this process: a /generate stream chunk encoded incrementally is
byte for byte json.dumps of the whole answer (log-probs too, each encoded once a stream), and a
client that goes while a stream waits for its next tokens closes the stream's body (its requests
abort) whichever side watches for it."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch
from fastapi import Request

from mimo_fn.serve.context import event_stream, to_json
from mimo_fn.serve.generation import Progress
from mimo_fn.serve.http import NativeStream, native_chunk, native_result
from mimo_fn.serve.protocol import GenerateRequest, parse
from mimo_fn.serve.stream_json import GrowingList, ints_json


class FixedProgress(Progress):
    latency = 1.25  # e2e_latency: the same in both encodings


class CountingTokenizer:
    """token_text of each id: non-ASCII, quotes, escapes or nothing; counts the calls."""

    def __init__(self):
        self.calls = 0

    def token_text(self, t: int) -> str:
        self.calls += 1
        return ["", f"é\u65e5{t}", '"\\\n\t', " x"][t % 4]


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6, 7]},
    {"input_ids": [[5, 6], [7]], "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0},
    {"input_ids": [5, 6, 7], "return_logprob": True},
    {"input_ids": [5, 6, 7], "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 1},
    {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 0, "return_routed_experts": True},
])
def test_a_native_chunk_is_json_dumps_of_the_answer(body):
    req = parse(GenerateRequest, {**body, "stream": True}, context={"vocab_size": 152576})
    ctx = SimpleNamespace(tok=CountingTokenizer())
    p = FixedProgress("rïd-1", [5, 6, 7], 16)
    s = NativeStream()
    lps = iter([-0.25, float("-inf"), -1e-300, float("nan"), -0.0, -3.5, -7.125, -0.5, -2.0])
    for step, new in enumerate(([], [3], [4, 100000], [], [7, 8, 9], [11])):  # a pass may bring none or several
        p.output_ids += new
        p.logprobs += [next(lps) for _ in new]
        p.text += "é\u65e5x" if new else ""
        if step == 2:  # the prompt's log-probs (the finish brings them; a length change is encoded anew)
            p.prompt_logprobs = [-0.5, float("-inf")]
        elif step == 4:
            p.prompt_logprobs = [-0.75, -2.0, 0.0]
        if new == [11]:
            p.finish = {"type": "length", "length": 16}
            p.routed_experts = torch.arange(3 * 2 * 2, dtype=torch.int32).view(3, 2, 2)
        index = 1 if req.is_batch else None
        want = native_result(ctx, p, req) | ({} if index is None else {"index": index})
        assert native_chunk(ctx, p, req, s, index) == json.dumps(want, ensure_ascii=False)


def test_a_stream_encodes_each_log_prob_once():
    """n tokens, one a chunk: each output token's entry is built and encoded once (re-encoding the
    whole list every chunk is n * (n + 1) / 2), the prompt's once."""
    n, prompt = 200, [5, 6, 7, 8]
    req = parse(GenerateRequest, {"input_ids": prompt, "stream": True, "return_logprob": True,
                                  "return_text_in_logprobs": True, "logprob_start_len": 0},
                context={"vocab_size": 152576})
    ctx = SimpleNamespace(tok=CountingTokenizer())
    encoded = []  # the items each call of the log-probs' encoder was given

    def spy(items):
        encoded.append(len(items))
        return to_json(items)

    s = NativeStream(output_logprobs=GrowingList(spy))
    p = FixedProgress("r", prompt, n, prompt_logprobs=[-1.0] * (len(prompt) - 1))
    for i in range(n):
        p.output_ids.append(i)
        p.logprobs.append(-0.5 * i)
        chunk = native_chunk(ctx, p, req, s, None)
    assert chunk == json.dumps(native_result(SimpleNamespace(tok=CountingTokenizer()), p, req), ensure_ascii=False)
    assert encoded == [1] * n and s.output_logprobs.count == n
    assert ctx.tok.calls == n + len(prompt)


def test_a_growing_list_is_to_json_of_the_list():
    g, xs = GrowingList(), []
    for new in ([], [[1.5, 2, "é"]], [], [[float("-inf"), 3, None], [0.0, 4, '"\n']]):
        xs += new
        assert g.encode(len(xs), lambda a, b: xs[a:b]) == to_json(xs)
    del xs[1:]  # a list that shrank (never a stream's): encoded anew
    assert g.encode(len(xs), lambda a, b: xs[a:b]) == to_json(xs) and g.count == 1
    assert ints_json([]) == "[]" and ints_json([3, 100000]) == json.dumps([3, 100000])


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
