"""bench_serving: workloads, metrics and the report from hand-made timings; the client's failure
handling against a throwaway socket server; and whole runs against the real mimo_fn server."""

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mimo_fn.bench_serving.metrics import compute_metrics, format_report, report_row
from mimo_fn.bench_serving.protocol import (
    Api, RequestResult, accept_length_from, build_payload, make_client, send_request,
)
from mimo_fn.bench_serving.workload import (
    BenchRequest, arrival_times, jsonl_requests, load_tokenizer, random_ids_requests, random_text_requests,
    sample_lengths,
)
from serve_util import ROOT, child_env, start_server

# the row fields the issue names (SGLang bench_serving's), which result tooling reads
SGLANG_FIELDS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "input_throughput",
    "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms",
    "mean_tpot_ms", "mean_e2e_latency_ms", "p99_e2e_latency_ms", "concurrency", "accept_length",
)


# --- workloads ------------------------------------------------------------------------------------

def test_lengths_stay_in_range_and_ratio_one_is_exact():
    rng = np.random.default_rng(0)
    lens = sample_lengths(rng, 500, 40, 0.5)
    assert min(lens) >= 20 and max(lens) <= 40 and len(set(lens)) > 10
    assert sample_lengths(rng, 20, 17, 1.0) == [17] * 20
    assert min(sample_lengths(rng, 200, 5, 0.0)) >= 1
    with pytest.raises(ValueError, match="range-ratio"):
        sample_lengths(rng, 1, 8, 1.5)


def test_random_ids_are_seeded_in_vocab_and_skip_excluded_ids():
    a = random_ids_requests(8, 30, 5, 1.0, vocab_size=50, seed=3, exclude_ids=[0, 1, 2])
    b = random_ids_requests(8, 30, 5, 1.0, vocab_size=50, seed=3, exclude_ids=[0, 1, 2])
    c = random_ids_requests(8, 30, 5, 1.0, vocab_size=50, seed=4, exclude_ids=[0, 1, 2])
    assert a == b and a != c
    ids = [t for r in a for t in r.prompt]
    assert all(3 <= t < 50 for t in ids) and len(set(ids)) > 20
    assert all(len(r.prompt) == r.prompt_len == 30 and r.output_len == 5 for r in a)


def test_jsonl_workload_forms_and_errors(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "hello there"},
        {"prompt": [5, 6, 7], "output_len": 3},
        {"input_ids": [9]},
        {"text": "plain"},
        {"conversations": [{"from": "human", "value": "first turn"}, {"from": "gpt", "value": "reply"}]},
        {"messages": [{"role": "user", "content": "as openai"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    reqs = jsonl_requests(str(path), 100, default_output_len=11)
    assert [r.prompt for r in reqs] == ["hello there", (5, 6, 7), (9,), "plain", "first turn", "as openai"]
    assert [r.output_len for r in reqs] == [11, 3, 11, 11, 11, 11]
    assert [r.prompt_len for r in reqs[1:3]] == [3, 1]
    assert len(jsonl_requests(str(path), 2, 11)) == 2
    for bad, msg in ((["nope"], "expected a JSON object"), ({"prompt": ""}, "non-empty"),
                     ({"prompt": [1, -2]}, "integers >= 0"), ({"prompt": "x", "output_len": 0}, "output_len"),
                     ({"other": 1}, "expected one of")):
        path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            jsonl_requests(str(path), 10, 4)
        assert "w.jsonl:2" in str(e.value)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="w.jsonl:1: not valid JSON"):
        jsonl_requests(str(path), 10, 4)


def test_arrivals_are_all_at_once_or_poisson_at_the_rate():
    assert arrival_times(5, float("inf"), 0) == [0.0] * 5
    t = arrival_times(4001, 20.0, 7)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / 20) < 0.005 and abs(gaps.std() - 1 / 20) < 0.005   # exponential: std = mean
    assert t == arrival_times(4001, 20.0, 7)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0, 0)


def test_command_line_builds_each_workload(tmp_path):
    from mimo_fn.bench_serving.__main__ import build_parser, build_requests
    from mimo_fn.serve.tokenizer import tiny_tokenizer

    nowhere = "http://127.0.0.1:9"   # no server is asked when the flags say everything
    parse = build_parser().parse_args
    ids = build_requests(parse(["--dataset-name", "random-ids", "--vocab-size", "64", "--num-prompts", "3",
                                "--random-input-len", "10", "--random-range-ratio", "1"]), nowhere)
    assert [len(r.prompt) for r in ids] == [10] * 3 and all(0 <= t < 64 for r in ids for t in r.prompt)

    tiny_tokenizer(128).backend.save(str(tmp_path / "tok.json"))
    text = build_requests(parse(["--dataset-name", "random", "--tokenizer", str(tmp_path / "tok.json"),
                                 "--num-prompts", "2", "--random-input-len", "12", "--random-range-ratio", "1"]),
                          nowhere)
    assert all(isinstance(r.prompt, str) and r.prompt and r.prompt_len == 12 for r in text)
    assert "<|" not in "".join(r.prompt for r in text)       # the special tokens are left out

    (tmp_path / "w.jsonl").write_text('{"prompt": "abc"}\n{"input_ids": [1, 2], "output_len": 2}\n')
    lines = build_requests(parse(["--dataset-name", "jsonl", "--dataset-path", str(tmp_path / "w.jsonl"),
                                  "--jsonl-output-len", "9"]), nowhere)
    assert [(r.prompt, r.output_len) for r in lines] == [("abc", 9), ((1, 2), 2)]
    with pytest.raises(ValueError, match="--dataset-path"):
        build_requests(parse(["--dataset-name", "jsonl"]), nowhere)
    with pytest.raises(ValueError, match="--vocab-size"):
        build_requests(parse(["--dataset-name", "random-ids"]), nowhere)
    with pytest.raises(ValueError, match="--tokenizer"):
        build_requests(parse(["--dataset-name", "random"]), nowhere)


# --- metrics and the report ----------------------------------------------------------------------

def _result(i, start, chunks, prompt_tokens=10, success=True, end=None, error=""):
    r = RequestResult(index=i, prompt_len=prompt_tokens, output_len=chunks[-1][1] if chunks else 4)
    r.start, r.chunks = start, list(chunks)
    r.first_token = chunks[0][0] if chunks else None
    r.end = end if end is not None else (chunks[-1][0] if chunks else start)
    r.prompt_tokens, r.completion_tokens = prompt_tokens, (chunks[-1][1] if chunks else None)
    r.success, r.error = success, error
    return r


def test_metrics_from_hand_made_timings():
    results = [
        _result(0, 0.0, [(0.10, 1), (0.15, 2), (0.20, 3)], prompt_tokens=10),
        _result(1, 0.0, [(0.30, 1), (0.50, 3)], prompt_tokens=20),     # one chunk of two tokens
        _result(2, 0.5, [(0.60, 1)], prompt_tokens=5),                  # a single token: no TPOT, no ITL
        _result(3, 0.2, [], prompt_tokens=7, success=False, end=0.4, error="HTTP 500: boom\nline two"),
    ]
    m = compute_metrics(results, duration=1.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 7)          # failed ones not counted
    assert m.input_throughput == 35.0 and m.output_throughput == 7.0 and m.request_throughput == 3.0
    ttfts = np.array([0.10, 0.30, 0.10])
    assert m.mean_ttft_ms == pytest.approx(ttfts.mean() * 1e3)
    assert m.median_ttft_ms == pytest.approx(100.0)
    assert m.p99_ttft_ms == pytest.approx(np.percentile(ttfts, 99) * 1e3)
    itls = [0.05, 0.05, 0.10, 0.10]        # the two-token chunk's 0.2 s spread over its tokens
    assert m.mean_itl_ms == pytest.approx(np.mean(itls) * 1e3)
    assert m.p99_itl_ms == pytest.approx(np.percentile(itls, 99) * 1e3) and m.max_itl_ms == pytest.approx(100.0)
    assert m.mean_tpot_ms == pytest.approx(np.mean([(0.20 - 0.10) / 2, (0.50 - 0.30) / 2]) * 1e3)
    e2e = [0.20, 0.50, 0.10]
    assert m.mean_e2e_latency_ms == pytest.approx(np.mean(e2e) * 1e3)
    assert m.p99_e2e_latency_ms == pytest.approx(np.percentile(e2e, 99) * 1e3)
    assert m.concurrency == pytest.approx(sum(e2e) / 1.0)

    row = report_row({"backend": "mimo_fn", "request_rate": float("inf"), "max_concurrency": 4}, m, results,
                     accept_length=2.5, details=True)
    assert all(k in row for k in SGLANG_FIELDS)
    assert row["accept_length"] == 2.5 and row["first_errors"] == ["request 3: HTTP 500: boom line two"]
    assert row["output_lens"] == [3, 3, 1, 0] and row["errors"][3].startswith("HTTP 500")
    json.loads(json.dumps(row))
    text = format_report(row)
    assert "Failed requests:" in text and "request 3: HTTP 500" in text and "Accept length:" in text


def test_metrics_of_a_run_where_nothing_succeeded_are_none_not_zero():
    m = compute_metrics([_result(0, 0.0, [], success=False, end=0.1, error="refused")], duration=0.1)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 1, 0)
    assert m.mean_ttft_ms is None and m.p99_e2e_latency_ms is None and m.mean_itl_ms is None
    assert "n/a" in format_report(report_row({"backend": "x", "request_rate": 1.0, "max_concurrency": None}, m,
                                              [], None))


def test_whole_answers_have_ttft_equal_to_latency_and_no_tpot_or_itl():
    r = _result(0, 0.1, [(0.5, 6)])
    r.first_token = None                 # as send_request leaves a non-streamed answer
    m = compute_metrics([r], duration=0.5)
    assert m.mean_ttft_ms == pytest.approx(400.0) == m.mean_e2e_latency_ms
    assert m.mean_tpot_ms is None and m.mean_itl_ms is None and m.total_output_tokens == 6


# --- protocol details ------------------------------------------------------------------------------

def test_payloads_follow_each_api():
    ids, text = BenchRequest((1, 2, 3), 3, 7), BenchRequest("hi", 0, 7)
    native = build_payload(Api("sglang", "http://h"), ids)
    assert native == {"input_ids": [1, 2, 3], "stream": True,
                      "sampling_params": {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}}
    assert build_payload(Api("mimo_fn", "http://h", stream=False), text)["text"] == "hi"
    oai = build_payload(Api("openai", "http://h", model="m", extra_body={"top_p": 0.5}), ids)
    assert oai["prompt"] == [1, 2, 3] and oai["max_tokens"] == 7 and oai["model"] == "m" and oai["top_p"] == 0.5
    assert oai["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="--backend"):
        Api("vllm", "http://h")


def test_accept_length_is_read_where_each_server_puts_it():
    assert accept_length_from({"avg_spec_accept_length": 2.25}) == 2.25
    assert accept_length_from({"internal_states": [{"avg_spec_accept_length": 3.0}]}) == 3.0
    assert accept_length_from({"decode": [{"internal_states": [{"avg_spec_accept_length": 1.5}]}]}) == 1.5
    assert accept_length_from({"avg_spec_accept_length": None}) is None
    assert accept_length_from({}) is None and accept_length_from(None) is None


# --- failure modes, against a throwaway socket server ----------------------------------------------

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(n: int) -> bytes:
    return _chunk(b"data: " + json.dumps({"text": "x" * n, "output_ids": list(range(n)),
                                          "meta_info": {"prompt_tokens": 3, "completion_tokens": n}}).encode() + b"\n\n")


async def _serve_once(behaviour):
    """A socket server whose every connection gets `behaviour(reader, writer)`; returns (server, url)."""

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        try:
            await behaviour(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _drop_mid_stream(reader, writer):
    writer.write(SSE_HEAD + _event(1) + _event(2))
    await writer.drain()
    writer.transport.abort()      # the server dies: no [DONE], no final chunk


async def _stream_ok(reader, writer):
    writer.write(SSE_HEAD + _event(1) + _event(3) + _chunk(b"data: [DONE]\n\n") + _chunk(b""))
    await writer.drain()


async def _http_500(reader, writer):
    body = b'{"error": {"message": "sampling_params.max_new_tokens: bad"}}'
    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(body), body))
    await writer.drain()


async def _hang(reader, writer):
    writer.write(SSE_HEAD + _event(1))
    await writer.drain()
    await asyncio.sleep(30)


async def _abort_finish(reader, writer):
    done = json.dumps({"text": "x", "output_ids": [0], "meta_info": {
        "prompt_tokens": 3, "completion_tokens": 1, "finish_reason": {"type": "abort", "message": "gone"}}})
    writer.write(SSE_HEAD + _chunk(b"data: " + done.encode() + b"\n\n") + _chunk(b"data: [DONE]\n\n") + _chunk(b""))
    await writer.drain()


@pytest.mark.parametrize("behaviour, error", [
    (_stream_ok, None),
    (_drop_mid_stream, "RemoteProtocolError"),
    (_http_500, "HTTP 400: .*max_new_tokens"),
    (_hang, "timed out after 1 s"),
    (_abort_finish, "aborted"),
])
def test_each_failure_is_a_failed_result_with_its_reason(behaviour, error):
    async def go():
        server, url = await _serve_once(behaviour)
        async with server, make_client() as client:
            return await send_request(client, Api("mimo_fn", url), BenchRequest((1, 2, 3), 3, 3), 0,
                                      0.0, timeout=1.0)

    res = asyncio.run(go())
    if error is None:
        assert res.success and res.error == "" and res.output_tokens == 3 and res.prompt_tokens == 3
        assert len(res.chunks) == 2 and len(res.itl) == 2
    else:
        assert not res.success
        assert re.search(error, res.error), res.error


def test_a_refused_connection_is_a_failure_not_an_exception():
    async def go():
        server, url = await _serve_once(_stream_ok)
        server.close()
        await server.wait_closed()
        async with make_client() as client:
            return await send_request(client, Api("sglang", url), BenchRequest("hi", 0, 2), 5, 0.0)

    res = asyncio.run(go())
    assert not res.success and "ConnectError" in res.error and res.index == 5


# --- end to end, against the real server --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(str(tmp_path_factory.mktemp("serve")))
    yield srv.url
    srv.stop()


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mimo_fn.bench_serving", *args], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def _read_run(out: Path, log: Path) -> tuple[dict, list[dict]]:
    row = json.loads(out.read_text().splitlines()[-1])
    return row, [json.loads(line) for line in log.read_text().splitlines()]


def check_timings(row: dict, reqs: list[dict], max_concurrency: int) -> None:
    """The report's latency statistics are those of the per-request timestamps it wrote."""
    assert len(reqs) == row["completed"] + row["failed"]
    ok = [r for r in reqs if r["success"]]
    ttft = np.array([r["first_token"] - r["start"] for r in ok])
    e2e = np.array([r["end"] - r["start"] for r in ok])
    assert (ttft > 0).all() and (e2e >= ttft).all()
    assert [r["ttft"] for r in ok] == pytest.approx(ttft.tolist(), abs=1e-12)
    assert row["mean_ttft_ms"] == pytest.approx(ttft.mean() * 1e3, rel=1e-9)
    assert row["median_ttft_ms"] == pytest.approx(np.median(ttft) * 1e3, rel=1e-9)
    assert row["p99_ttft_ms"] == pytest.approx(np.percentile(ttft, 99) * 1e3, rel=1e-9)
    assert row["mean_ttft_ms"] <= row["p99_ttft_ms"] <= ttft.max() * 1e3 + 1e-9
    assert row["mean_e2e_latency_ms"] == pytest.approx(e2e.mean() * 1e3, rel=1e-9)
    assert row["p99_e2e_latency_ms"] == pytest.approx(np.percentile(e2e, 99) * 1e3, rel=1e-9)
    # ITL from the chunk arrivals: each gap spread over the tokens its chunk brought
    itl = [(t1 - t0) / (n1 - n0) for r in ok for (t0, n0), (t1, n1) in zip(r["chunks"], r["chunks"][1:])
           for _ in range(n1 - n0)]
    assert row["mean_itl_ms"] == pytest.approx(np.mean(itl) * 1e3, rel=1e-9)
    assert all(r["chunks"][0][0] == r["first_token"] and r["chunks"][-1][0] <= r["end"] for r in ok)
    assert row["concurrency"] == pytest.approx(e2e.sum() / row["duration"], rel=1e-9)
    assert 0 <= min(r["start"] for r in reqs) and max(r["end"] for r in reqs) <= row["duration"]
    # never more than the cap in flight: sweep the send / end events
    events = sorted([(r["start"], 1) for r in reqs] + [(r["end"], -1) for r in reqs], key=lambda e: (e[0], e[1]))
    in_flight = np.cumsum([d for _, d in events])
    assert in_flight.max() <= max_concurrency


def test_random_text_run_counts_what_the_server_ran(server, tmp_path):
    from mimo_fn.serve.tokenizer import tiny_tokenizer

    server_tok = tiny_tokenizer(httpx.get(server + "/get_model_info").json()["vocab_size"])
    server_tok.backend.save(str(tmp_path / "tokenizer.json"))
    out, log, png = tmp_path / "out.jsonl", tmp_path / "requests.jsonl", tmp_path / "lat.png"
    proc = bench("--base-url", server, "--dataset-name", "random", "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--num-prompts", "8", "--random-input-len", "40", "--random-output-len", "6",
                 "--random-range-ratio", "0.5", "--max-concurrency", "4", "--seed", "5", "--flush-cache",
                 "--output-file", str(out), "--request-log", str(log), "--plot", str(png), "--output-details")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row, reqs = _read_run(out, log)
    assert (row["completed"], row["failed"], row["first_errors"]) == (8, 0, [])
    assert "Successful requests:" in proc.stdout and "requests: 100%" in proc.stderr   # the table, the bar

    # the prompts the client drew, tokenised as the server tokenises them
    prompts = random_text_requests(8, 40, 6, 0.5, load_tokenizer(str(tmp_path / "tokenizer.json")), seed=5)
    assert [r["prompt_tokens"] for r in reqs] == [len(server_tok.encode(p.prompt)) for p in prompts]
    assert row["total_input_tokens"] == sum(len(server_tok.encode(p.prompt)) for p in prompts) == sum(row["input_lens"])
    assert [r["completion_tokens"] for r in reqs] == [p.output_len for p in prompts]     # ignore_eos
    assert row["total_output_tokens"] == sum(p.output_len for p in prompts) == sum(row["output_lens"])
    # and what the server says of one of them asked on its own
    alone = httpx.post(server + "/generate", json={"text": prompts[3].prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=60).json()
    assert alone["meta_info"]["prompt_tokens"] == reqs[3]["prompt_tokens"]

    check_timings(row, reqs, max_concurrency=4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_random_ids_run_native_and_openai(server, tmp_path):
    for backend, n in (("mimo_fn", 8), ("openai", 4)):
        out, log = tmp_path / f"{backend}.jsonl", tmp_path / f"{backend}-requests.jsonl"
        proc = bench("--backend", backend, "--base-url", server, "--dataset-name", "random-ids",
                     "--num-prompts", str(n), "--random-input-len", "32", "--random-output-len", "5",
                     "--random-range-ratio", "0.5", "--max-concurrency", "4", "--warmup-requests", "2",
                     "--output-file", str(out), "--request-log", str(log), "--disable-tqdm")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        row, reqs = _read_run(out, log)
        assert (row["completed"], row["failed"]) == (n, 0)
        vocab = httpx.get(server + "/get_model_info").json()["vocab_size"]
        drawn = random_ids_requests(n, 32, 5, 0.5, vocab, seed=1)
        assert [r["prompt_tokens"] for r in reqs] == [r["prompt_len"] for r in reqs] == [d.prompt_len for d in drawn]
        assert [r["completion_tokens"] for r in reqs] == [d.output_len for d in drawn]
        assert row["total_input_tokens"] == sum(d.prompt_len for d in drawn)
        assert row["total_output_tokens"] == sum(d.output_len for d in drawn)
        check_timings(row, reqs, max_concurrency=4)


def test_a_server_killed_mid_run_gives_counted_failures_and_a_nonzero_exit(tmp_path):
    srv = start_server(str(tmp_path))
    url, out = srv.url, tmp_path / "out.jsonl"
    try:
        client = subprocess.Popen(
            [sys.executable, "-m", "mimo_fn.bench_serving", "--base-url", url, "--dataset-name", "random-ids",
             "--num-prompts", "32", "--random-input-len", "16", "--random-output-len", "64",
             "--random-range-ratio", "1", "--max-concurrency", "4", "--warmup-requests", "0",
             "--request-timeout", "60", "--output-file", str(out), "--request-log", str(tmp_path / "r.jsonl")],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # kill it once the timed run is under way
            info = httpx.get(url + "/get_server_info", timeout=10).json()
            if info["num_running_reqs"] > 0:
                break
            assert client.poll() is None, client.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        srv.popen.kill()
        stdout, stderr = client.communicate(timeout=180)
    finally:
        srv.stop()
    assert client.returncode == 1, stdout + stderr
    row, reqs = _read_run(out, tmp_path / "r.jsonl")
    assert row["failed"] >= 1 and row["completed"] + row["failed"] == 32
    assert len(row["first_errors"]) >= 1 and "Failed requests:" in stdout and "First errors" in stdout
    assert sum(not r["success"] for r in reqs) == row["failed"] and all(r["error"] for r in reqs if not r["success"])
