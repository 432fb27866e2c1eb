"""The server on a mesh: torchrun over 4 gloo CPU processes, DP 2 x attention TP 2 x EP 4. Rank 0
serves HTTP and broadcasts each pass's requests and aborts; its greedy answers equal the 1-rank
Engine.generate's on the same ids, and requests reach both DP groups."""

import asyncio

import httpx
import openai
import pytest

from mimo_fn.serve.tokenizer import tiny_tokenizer
from serve_util import one_torch_thread, pages_settle, random_prompts, start_server, tiny_engine

TOK = tiny_tokenizer(128)
# slow: two or four server processes; .ci/run leaves them to scripts/gpu_tests.py (the nightly-style run)
pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__), pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh_server(tmp_path_factory):
    proc = start_server(str(tmp_path_factory.mktemp("serve_mesh")), "--dp-size", "2", "--tp-size", "2",
                        "--ep-size", "4", "--skip-warmup", nproc=4, name="mesh")
    yield proc
    proc.stop()


def test_mesh_server_equals_one_rank(mesh_server):
    url, engine, eos = mesh_server.url, tiny_engine(), list(TOK.eos_token_ids)
    prompts = random_prompts(8, [5, 30, 12, 61], seed=30)
    limits = [6, 2, 9, 4]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*(c.post(url + "/generate", json={
                "input_ids": p, "sampling_params": {"max_new_tokens": limits[i % 4], "temperature": 0}})
                for i, p in enumerate(prompts)))
        return [r.json() for r in rs]

    outs = asyncio.run(run())
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out["output_ids"] == engine.generate([p], limits[i % 4], stop_token_ids=eos)[0].tokens, i
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    got = client.completions.create(model="m", prompt="on every rank", max_tokens=5, temperature=0)
    want = engine.generate([TOK.encode("on every rank")], 5, stop_token_ids=eos)[0]
    assert got.choices[0].text == TOK.decode(want.tokens[:-1] if want.finish_reason == "stop" else want.tokens)
    info = httpx.get(url + "/get_server_info").json()
    assert len(info["dp_groups"]) == 2 and min(info["dp_requests_total"]) >= 3, info["dp_requests_total"]
    assert len(httpx.get(url + "/get_load").json()) == 2


def test_mesh_abort_frees_pages(mesh_server):
    url = mesh_server.url
    p = random_prompts(1, [40], seed=31)[0]
    with httpx.stream("POST", url + "/generate", timeout=120, json={
            "input_ids": p, "rid": "mesh-long", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert httpx.get(url + "/get_server_info").json()["num_used_pages"] > 0
        assert httpx.post(url + "/abort_request", json={"rid": "mesh-long"}).json() == {"success": True}
        assert '"abort"' in [line for line in lines if line.startswith("data: {")][-1]
    info = pages_settle(url, 0)
    assert info["num_used_pages"] == 0 and info["num_running_reqs"] == 0
