"""Past one machine: two servers behind sglang-router (the Rust load balancer Miles puts in front
of its engines), all on 127.0.0.1. The router registers each server as a worker from what it
answers (/health, /model_info, /server_info); requests reach both, and every answer equals the
request's solo result."""

import asyncio
import json
import sys
import time

import httpx
import openai
import pytest

import mimo_fn as mf
from mimo_fn.serve.process import ServerProcess, free_port
from mimo_fn.serve.tokenizer import tiny_tokenizer
from serve_util import ROOT, child_env, one_torch_thread, random_prompts, start_server, tiny_engine

TOK = tiny_tokenizer(128)
# slow: two or four server processes; .ci/run leaves them to scripts/gpu_tests.py (the nightly-style run)
pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__), pytest.mark.slow]


def start_router(tmp_dir: str, workers: list[str]) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers, "--host", "127.0.0.1",
           "--port", str(port), "--policy", "round_robin", "--log-level", "warn"]
    router = ServerProcess(cmd, port=port, log_path=f"{tmp_dir}/router.log", env=child_env(), cwd=ROOT).wait_healthy(60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # it registers the workers after it starts listening
        listed = httpx.get(router.url + "/workers", timeout=5).json().get("workers", [])
        if sorted(w["url"] for w in listed if w.get("is_healthy")) == sorted(workers):
            return router
        time.sleep(0.3)
    router.stop()
    raise AssertionError(f"the router did not register {workers}:\n{router.log_tail()}")


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_model_dir(path) -> None:
    """config.json of the tiny model, and its tokenizer as transformers saves one (eos ids in
    generation_config.json, as MiMo's directory has them)."""
    from transformers import PreTrainedTokenizerFast

    path.mkdir()
    (path / "config.json").write_text(json.dumps(mf.ModelConfig.tiny().to_hf()))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(TOK.eos_token_ids)}))
    PreTrainedTokenizerFast(tokenizer_object=TOK.backend, eos_token="<|endoftext|>", unk_token="<unk>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(str(path))


def test_two_servers_behind_sglang_router(tmp_path):
    # warm-up on (the default): each server reports healthy only after engine.warmup(). The second
    # serves the same model as a model directory does: config.json with random weights (--load-format
    # dummy: init_params with the same seed), an override that keeps it the same, and the tokenizer
    # through transformers' AutoTokenizer (the same vocabulary, saved with a chat template)
    config_dir = tmp_path / "tiny-model"
    save_tiny_model_dir(config_dir)
    servers = [start_server(str(tmp_path), name="worker0"), start_server(
        str(tmp_path), "--model-path", str(config_dir), "--load-format", "dummy", "--served-model-name",
        "mimo-fn-tiny-random", "--json-model-override-args", '{"num_hidden_layers": 4}', name="worker1")]
    info = httpx.get(servers[1].url + "/get_model_info").json()
    assert info["model_path"] == str(config_dir) and info["eos_token_ids"] == list(TOK.eos_token_ids)
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
        messages = [{"role": "user", "content": "Hi there"}]
        assert "character-level" not in servers[1].log_tail()  # it did not fall back to the built-in tokenizer
        for srv in servers:  # each tokenizer (and chat template) the same way
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
            chat = client.chat.completions.create(model="m", messages=messages, max_tokens=7, temperature=0)
            want = engine.generate([TOK.encode(TOK.chat_prompt(messages))], 7, stop_token_ids=eos)[0]
            assert chat.choices[0].message.content == TOK.decode(want.tokens[:-1] if want.finish_reason == "stop"
                                                                 else want.tokens), srv.url
        served = [httpx.get(s.url + "/get_server_info").json()["num_requests_total"] for s in servers]
        assert min(served) >= 3 and sum(served) == len(prompts) + 4, served  # round robin: both got requests
    finally:
        for p in ([router] if router else []) + servers:
            p.stop()
