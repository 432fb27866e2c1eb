"""The server under a soak (issue 44): 200 requests, 48 at a time, over the real server process on the
tiny model: native /generate (input_ids and text, greedy and sampled, one prompt and batches, whole and
streamed), OpenAI completions, invalid bodies, aborts through /abort_request and clients that
disconnect mid-stream, at random points (scripts/serve_soak.py; its full size, 1000 requests at 64,
is in docs/benchmarks.md). Every request ends with an answer, every greedy one equals the prompt run
alone in this process (or parts from it at a near-tie of fp32 rounding), no page is left used after a
flush, and the server still serves."""

import runpy
from pathlib import Path

import pytest

import mimo_fn as mf
from mimo_fn.serve.tokenizer import tiny_tokenizer
from serve_util import POOL, one_torch_thread, start_server

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
SOAK = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "serve_soak.py"))
NUM, CONCURRENCY = 200, 48


def test_soak(tmp_path):
    cfg = mf.ModelConfig.tiny()
    tok = tiny_tokenizer(cfg.vocab_size)
    specs = SOAK["workload"](NUM, 1, cfg.vocab_size, tok, max_prompt=80, max_new=32)
    assert {s.kind for s in specs} == set(SOAK["KINDS"])  # every kind of request is in the mix
    refs = SOAK["References"](cfg, mf.init_params(cfg, seed=0), tuple(tok.eos_token_ids))  # after the soak
    server = start_server(str(tmp_path), "--skip-warmup")  # the pool (POOL tokens) makes requests wait
    try:
        summary = SOAK["soak"](server.url, specs, refs, tok, CONCURRENCY, timeout=60.0)
    finally:
        server.stop()
    print(SOAK["table"](summary))
    assert summary["problems"] == [], "\n".join(summary["problems"][:10])
    assert summary["lost"] == 0 and summary["mismatches"] == 0
    assert summary["pages_leaked"] == 0 and summary["running_after"] == 0 and summary["healthy"]
    assert summary["completed"] + summary["aborted"] + summary["disconnected"] + summary["rejected"] == NUM
    # the cuts happened: some requests were aborted or left mid-answer, and the bad ones refused
    assert summary["aborted"] > 0 and summary["disconnected"] > 0 and summary["rejected"] > 0
    assert POOL < sum(len(p) + s.max_new for s in specs[:CONCURRENCY] for p in s.prompts)  # more than fits at once
