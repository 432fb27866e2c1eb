"""The server as users run it: `python -m mimo_fn.serve` in a subprocess on 127.0.0.1 (the tiny
model), driven with httpx and the official openai client; greedy answers equal Engine.generate
on the same ids in this process (same seed-0 weights, fp32)."""

import asyncio
import base64
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from mimo_fn.client import EngineClient, ServerError
from mimo_fn.serve.tokenizer import tiny_tokenizer
from serve_util import POOL, one_torch_thread, pages_settle, random_prompts, start_server, tiny_engine

TOK = tiny_tokenizer(128)
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
EOS = list(TOK.eos_token_ids)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(str(tmp_path_factory.mktemp("serve")), "--skip-warmup")
    yield proc
    assert proc.stop() is not None


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def solo(engine, prompt, n, stops=EOS, **kw):
    return engine.generate([prompt], n, stop_token_ids=list(stops), **kw)[0]


def text_of(out) -> str:
    """The answer's text: a stop token the engine keeps last is not part of it."""
    return TOK.decode(out.tokens[:-1] if out.finish_reason == "stop" else out.tokens)


def generate(url, **body) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(n: int, **more) -> dict:
    return {"max_new_tokens": n, "temperature": 0, **more}


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_equals_engine(server, engine):
    prompts = random_prompts(3, [5, 23, 40], seed=1)
    for p in prompts:
        out, want = generate(server.url, input_ids=p, sampling_params=greedy(12)), solo(engine, p, 12)
        assert out["output_ids"] == want.tokens and out["text"] == text_of(want)
        assert out["meta_info"]["finish_reason"]["type"] == want.finish_reason
        assert out["meta_info"]["prompt_tokens"] == len(p) and out["meta_info"]["completion_tokens"] == len(want.tokens)
    batch = generate(server.url, input_ids=prompts, sampling_params=greedy(12))
    assert [b["output_ids"] for b in batch] == [solo(engine, p, 12).tokens for p in prompts]
    text = "The quick brown fox"
    out, want = generate(server.url, text=text, sampling_params=greedy(9)), solo(engine, TOK.encode(text), 9)
    assert out["meta_info"]["prompt_tokens"] == len(TOK.encode(text))
    assert out["output_ids"] == want.tokens and out["text"] == text_of(want)
    unstopped = generate(server.url, input_ids=prompts[0], sampling_params=greedy(20, ignore_eos=True))
    assert unstopped["output_ids"] == solo(engine, prompts[0], 20, stops=()).tokens


def test_openai_client(server, engine):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    (model,) = [m.id for m in client.models.list().data]
    p = random_prompts(1, [17], seed=2)[0]
    want = solo(engine, p, 10, return_logprobs=True)
    r = client.completions.create(model=model, prompt=p, max_tokens=10, temperature=0, logprobs=1)
    assert r.choices[0].text == text_of(want) and r.usage.completion_tokens == len(want.tokens)
    assert r.choices[0].logprobs.tokens == [TOK.token_text(t) for t in want.tokens]
    assert np.allclose(r.choices[0].logprobs.token_logprobs, want.logprobs, atol=1e-5)
    # streamed, each chunk carries its new tokens' log-probs, their text offsets running on
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt=p, max_tokens=10, temperature=0, logprobs=1, stream=True) if c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == r.choices[0].logprobs.tokens
    assert [o for c in chunks for o in c.text_offset] == r.choices[0].logprobs.text_offset
    assert np.allclose([lp for c in chunks for lp in c.token_logprobs], want.logprobs, atol=1e-5)
    texts = ["hello there", "abc"]
    r = client.completions.create(model=model, prompt=texts, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [
        text_of(solo(engine, TOK.encode(t), 6)) for t in texts]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    want = solo(engine, TOK.encode(TOK.chat_prompt(messages)), 8)
    assert chat.choices[0].message.content == text_of(want) and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(want.tokens) and chat.choices[0].finish_reason == want.finish_reason


def test_32_concurrent_requests_each_equal_their_solo_result(server, engine):
    lengths, limits = [3, 17, 40, 90, 150], [1, 4, 9, 16]
    prompts = random_prompts(32, lengths, seed=3)  # ~2.8K tokens reserved in all: more than the pool holds

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*(c.post(server.url + "/generate", json={
                "input_ids": p, "sampling_params": greedy(limits[i % 4])}) for i, p in enumerate(prompts)))
        return [r.json() for r in rs]

    outs = asyncio.run(run())
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out["output_ids"] == solo(engine, p, limits[i % 4]).tokens, f"request {i}"
    assert pages_settle(server.url, 0)["num_used_pages"] == 0


def test_stream_pieces_join_to_the_answer(server):
    p = random_prompts(1, [11], seed=4)[0]
    whole = generate(server.url, input_ids=p, sampling_params=greedy(16, ignore_eos=True))
    with httpx.stream("POST", server.url + "/generate", timeout=60, json={
            "input_ids": p, "sampling_params": greedy(16, ignore_eos=True), "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) > 3
    chunks = events[:-1]
    for a, b in zip(chunks, chunks[1:]):  # SGLang's chunks carry the text so far
        assert b["text"].startswith(a["text"]) and len(b["output_ids"]) > len(a["output_ids"])
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    text = TOK.decode(p)
    plain = client.completions.create(model="m", prompt=text, max_tokens=12, temperature=0, stop=["q"])
    pieces = client.completions.create(model="m", prompt=text, max_tokens=12, temperature=0, stop=["q"], stream=True,
                                       stream_options={"include_usage": True})
    pieces = list(pieces)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == plain.choices[0].text
    assert pieces[-1].usage.completion_tokens == plain.usage.completion_tokens
    messages = [{"role": "user", "content": text}]
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    deltas = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == plain.choices[0].message.content


def test_logprobs_and_routed_experts(server, engine):
    p = random_prompts(1, [21], seed=5)[0]
    want = solo(engine, p, 7, return_logprobs=True, return_routed_experts=True)
    out = generate(server.url, input_ids=p, sampling_params=greedy(7), return_logprob=True, logprob_start_len=0,
                   return_routed_experts=True, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want.tokens
    assert [s for _, _, s in meta["output_token_logprobs"]] == [TOK.token_text(t) for t in want.tokens]
    assert np.allclose([lp for lp, _, _ in meta["output_token_logprobs"]], want.logprobs, atol=1e-5)
    assert meta["input_token_logprobs"][0][:2] == [None, p[0]] and [t for _, t, _ in meta["input_token_logprobs"]] == p
    assert np.allclose([lp for lp, _, _ in meta["input_token_logprobs"][1:]], want.prompt_logprobs, atol=1e-5)
    experts = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
    assert torch.equal(torch.from_numpy(experts.copy()).view(want.routed_experts.shape), want.routed_experts)

    with httpx.stream("POST", server.url + "/generate", timeout=60, json={  # streamed: the same, chunk by chunk
            "input_ids": p, "sampling_params": greedy(7), "stream": True, "return_logprob": True,
            "logprob_start_len": 0, "return_text_in_logprobs": True}) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert len(chunks) > 1
    for a, b in zip(chunks, chunks[1:]):  # each chunk's log-probs: the last one's and the new tokens'
        olds, news = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        assert news[:len(olds)] == olds and len(news) == len(b["output_ids"])
    last = chunks[-1]["meta_info"]
    assert [e[1:] for e in last["output_token_logprobs"]] == [e[1:] for e in meta["output_token_logprobs"]]
    assert [e[1:] for e in last["input_token_logprobs"]] == [e[1:] for e in meta["input_token_logprobs"]]
    assert np.allclose([lp for lp, _, _ in last["output_token_logprobs"]], want.logprobs, atol=1e-5)


def test_stop_strings_and_stop_token_ids(server, engine):
    p = random_prompts(1, [9], seed=6)[0]
    full = solo(engine, p, 24, stops=())
    text = text_of(full)
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i)
    cut = text[:text.find(stop)]
    out = generate(server.url, input_ids=p, sampling_params=greedy(24, ignore_eos=True, stop=[stop, "\x00never"]))
    assert out["text"] == cut and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert TOK.decode(out["output_ids"]).startswith(cut + stop)  # tokens up to the one completing it
    with_lp = generate(server.url, input_ids=p, sampling_params=greedy(24, ignore_eos=True, stop=stop),
                       return_logprob=True, logprob_start_len=0, return_routed_experts=True)
    meta = with_lp["meta_info"]  # the aborted request's prompt log-probs and experts still come back
    assert with_lp["text"] == cut and meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(meta["output_token_logprobs"]) == len(with_lp["output_ids"]) == len(out["output_ids"])
    assert [t for _, t, _ in meta["input_token_logprobs"]] == p
    experts = torch.from_numpy(np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).copy())
    rows = solo(engine, p, 24, stops=(), return_routed_experts=True).routed_experts
    rows = rows[:len(p) + len(out["output_ids"]) - 1]
    assert torch.equal(experts.view(rows.shape), rows)  # the rows of the tokens it kept
    with httpx.stream("POST", server.url + "/generate", timeout=60, json={
            "input_ids": p, "sampling_params": greedy(24, ignore_eos=True, stop=stop), "stream": True}) as r:
        chunks = sse_events(r.iter_lines())[:-1]
    assert all(cut.startswith(c["text"]) for c in chunks) and chunks[-1]["text"] == cut  # no part of it sent
    stop_id = full.tokens[3]
    k = full.tokens.index(stop_id)
    out = generate(server.url, input_ids=p, sampling_params=greedy(24, ignore_eos=True, stop_token_ids=[stop_id]))
    assert out["output_ids"] == full.tokens[:k + 1] and out["text"] == TOK.decode(full.tokens[:k])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert pages_settle(server.url, 0)["num_running_reqs"] == 0  # the stop string's request was aborted


def _long_request(server, rid):
    p = random_prompts(1, [100], seed=7)[0]
    return {"input_ids": p, "rid": rid, "stream": True,
            "sampling_params": greedy(POOL - 2 * len(p), ignore_eos=True)}


def test_abort_request_frees_its_pages(server):
    assert pages_settle(server.url, 0)["num_used_pages"] == 0
    with httpx.stream("POST", server.url + "/generate", json=_long_request(server, "long-1"), timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        info = httpx.get(server.url + "/get_server_info").json()
        assert info["num_running_reqs"] == 1 and info["num_used_pages"] > 0
        assert httpx.post(server.url + "/abort_request", json={"rid": "long-1"}).json() == {"success": True}
        last = sse_events(lines)[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and len(last["output_ids"]) < POOL - 200
    assert json.loads(first[len("data: "):])["meta_info"]["id"] == "long-1"
    assert pages_settle(server.url, 0)["num_used_pages"] == 0
    assert httpx.post(server.url + "/abort_request", json={"rid": "long-1"}).json() == {"success": False}


def test_disconnect_frees_its_pages(server):
    with httpx.stream("POST", server.url + "/generate", json=_long_request(server, "gone-1"), timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        next(events)
        t0 = time.monotonic()
        for _ in range(20):  # the decode rate: how long the whole answer would take
            next(events)
        per_token = (time.monotonic() - t0) / 20
        assert httpx.get(server.url + "/get_server_info").json()["num_used_pages"] > 0
    t0 = time.monotonic()
    info = pages_settle(server.url, 0, timeout=60)
    assert info["num_used_pages"] == 0 and info["num_running_reqs"] == 0
    left = _long_request(server, "")["sampling_params"]["max_new_tokens"] - 21
    assert time.monotonic() - t0 < 0.5 * left * per_token  # not by running to its end
    body = {**_long_request(server, "gone-2"), "stream": False}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up waiting: the connection closes
        httpx.post(server.url + "/generate", json=body, timeout=1.0)
    t0 = time.monotonic()
    info = pages_settle(server.url, 0, timeout=60)
    assert info["num_used_pages"] == 0 and info["num_running_reqs"] == 0
    assert time.monotonic() - t0 < 0.5 * left * per_token


BAD = [  # (path, body, the field the message must name)
    ("/generate", b'{"input_ids": [1, 2', "body"),
    ("/generate", b"[1, 2]", "body"),
    ("/generate", {"input_ids": [1, 2, 128]}, "input_ids[2]"),
    ("/generate", {"input_ids": [[1], [2, -1]]}, "input_ids[1][1]"),
    ("/generate", {"input_ids": [1, "2"]}, "input_ids"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "input_ids"),
    ("/generate", {"input_ids": list(range(4, 100)) * 30}, "input_ids"),  # 2880 tokens: more than the pool
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [500]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"frequency_penalty": 0.3}}, "sampling_params.frequency_penalty"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"model": "m", "prompt": [], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [5, 300]}, "prompt[1]"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": 2},
     "top_p"),
    ("/abort_request", {"rid": 5}, "rid"),
    ("/flush_cache", {"timeout": -1}, "timeout"),
]


def test_bad_input_is_a_400_naming_the_field(server, engine):
    p = random_prompts(1, [13], seed=8)[0]
    want = solo(engine, p, 8).tokens
    for path, body, name in BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(server.url + path, timeout=30, headers={"content-type": "application/json"}, **kw)
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and name in msg and "Traceback" not in r.text, (path, body, r.status_code, msg)
        assert generate(server.url, input_ids=p, sampling_params=greedy(8))["output_ids"] == want, (path, body)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="m", prompt="hi", top_p=0)
    r = httpx.get(server.url + "/no/such/endpoint")
    assert r.status_code == 404 and "error" in r.json()
    assert pages_settle(server.url, 0)["num_used_pages"] == 0


def test_engine_client(server, engine):
    c = EngineClient(server.url)
    assert c.health() and c.health_generate()
    info = c.get_model_info()
    assert info["is_generation"] is True and info["vocab_size"] == 128 and info["model_path"]
    p = random_prompts(1, [6], seed=9)[0]
    assert c.generate(p, greedy(5))["output_ids"] == solo(engine, p, 5).tokens
    assert [o["output_ids"] for o in c.generate([p, p], greedy(5))] == [solo(engine, p, 5).tokens] * 2
    with pytest.raises(ServerError, match="sampling_params.top_p") as e:
        c.generate(p, {"top_p": 7})
    assert e.value.status_code == 400
    server_info = c.get_server_info()
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_pages", "num_free_pages", "page_size",
                "max_total_num_tokens", "avg_spec_accept_length", "dp_size", "tp_size", "model_path"):
        assert key in server_info, key
    assert c.abort("no-such-rid") is False
    assert c.flush_cache(timeout=5) is True


@pytest.fixture(scope="module")
def caching_server(tmp_path_factory):  # prefix cache and speculative decoding (prompt-lookup drafts) on
    proc = start_server(str(tmp_path_factory.mktemp("serve_cache")), "--skip-warmup", "--enable-prefix-caching",
                        "--speculative-num-draft-tokens", "2", name="caching")
    yield proc
    proc.stop()


def test_flush_cache_waits_for_running_requests_then_empties_the_cache(caching_server):
    url, c = caching_server.url, EngineClient(caching_server.url)
    p = random_prompts(1, [40], seed=10)[0]
    assert c.get_server_info()["avg_spec_accept_length"] is None  # no verify step yet
    c.generate(p, greedy(4))
    info = c.get_server_info()
    assert info["prefix_cache_entries"] > 0 and info["avg_spec_accept_length"] >= 1.0  # drafts were verified
    ended = {}

    def long_request():
        with httpx.stream("POST", url + "/generate", timeout=120, json={
                "input_ids": p + [7, 8], "stream": True, "sampling_params": greedy(300, ignore_eos=True)}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ended["last"] = json.loads(line[6:])

    t = threading.Thread(target=long_request)
    t.start()
    while "last" not in ended:
        time.sleep(0.02)
    assert c.flush_cache(timeout=0.0) is False  # a request runs: nothing emptied
    assert c.get_server_info()["prefix_cache_entries"] > 0
    assert c.flush_cache(timeout=120) is True
    info = c.get_server_info()  # nothing ran or was cached any more when the flush answered
    assert info["num_running_reqs"] == 0 and info["prefix_cache_entries"] == 0 and info["num_used_pages"] == 0
    t.join()
    last = ended["last"]  # and the request was not cut
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 300} and len(last["output_ids"]) == 300
