"""Past one machine: two servers behind sglang-router (the Rust load balancer Miles puts in front
of its engines), all on 127.0.0.1. The router registers each server as a worker from what it
answers (/health, /model_info, /server_info); requests reach both, and every answer equals the
request's solo result."""

import asyncio
import sys
import time

import httpx
import openai

from dist_util import free_port
from mimo_fn.serve.tokenizer import tiny_tokenizer
from serve_util import Proc, random_prompts, start_server, tiny_engine

TOK = tiny_tokenizer(128)


def start_router(tmp_dir: str, workers: list[str]) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin", "--log-level", "warn"]
    router = Proc(cmd, port, f"{tmp_dir}/router.log").wait_healthy(60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # it registers the workers after it starts listening
        listed = httpx.get(router.url + "/workers", timeout=5).json().get("workers", [])
        if sorted(w["url"] for w in listed if w.get("is_healthy")) == sorted(workers):
            return router
        time.sleep(0.3)
    router.stop()
    raise AssertionError(f"the router did not register {workers}:\n{router.log()}")


def test_two_servers_behind_sglang_router(tmp_path):
    # warm-up on (the default): each server reports healthy only after engine.warmup()
    servers = [start_server(str(tmp_path), name=f"worker{i}") for i in range(2)]
    router = None
    try:
        router = start_router(str(tmp_path), [s.url for s in servers])
        engine = tiny_engine()
        eos = list(TOK.eos_token_ids)
        prompts = random_prompts(8, [4, 19, 33], seed=20)
        limits = [3, 8, 5, 12]

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                rs = await asyncio.gather(*(c.post(router.url + "/generate", json={
                    "input_ids": p, "sampling_params": {"max_new_tokens": limits[i % 4], "temperature": 0}})
                    for i, p in enumerate(prompts)))
            return [r.json() for r in rs]

        outs = asyncio.run(run())
        for i, (p, out) in enumerate(zip(prompts, outs)):
            assert out["output_ids"] == engine.generate([p], limits[i % 4], stop_token_ids=eos)[0].tokens, i
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        for text in ("one prompt", "and another"):
            got = client.completions.create(model="mimo-fn-tiny-random", prompt=text, max_tokens=6, temperature=0)
            want = engine.generate([TOK.encode(text)], 6, stop_token_ids=eos)[0]
            assert got.choices[0].text == TOK.decode(want.tokens[:-1] if want.finish_reason == "stop" else want.tokens)
        served = [httpx.get(s.url + "/get_server_info").json()["num_requests_total"] for s in servers]
        assert min(served) >= 2 and sum(served) == len(prompts) + 2, served  # round robin: both got requests
    finally:
        for p in ([router] if router else []) + servers:
            p.stop()
