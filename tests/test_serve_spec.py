"""DFlash speculative decoding through the real server: `python -m mimo_fn.serve
--speculative-algorithm DFLASH --speculative-draft-model-path D --speculative-min-confidence P` in a
subprocess on 127.0.0.1 (the tiny model), driven with the openai client and httpx. Greedy answers
equal plain decoding in this process, and /get_server_info reports the verify steps' acceptance."""

import httpx
import openai
import pytest

import mimo_fn as mf
from mimo_fn.serve.tokenizer import tiny_tokenizer
from mimo_fn.speculative.dflash import init_dflash
from mimo_fn.speculative.dflash_checkpoint import save_dflash
from mimo_fn.speculative.train_dflash import draft_config
from serve_util import one_torch_thread, random_prompts, start_server, tiny_engine

TOK = tiny_tokenizer(128)
pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)


@pytest.fixture(scope="module")
def dflash_server(tmp_path_factory):
    """A random block-4 draft saved for the tiny model; a cut of 0.2 drops the drafts such a draft
    doubts, so the verify steps feed masked rows (the rows past a request's cut read no experts)."""
    root = tmp_path_factory.mktemp("serve_spec")
    cfg = mf.ModelConfig.tiny()
    dcfg = draft_config(cfg, 4)
    save_dflash(init_dflash(cfg, dcfg, seed=6), dcfg, cfg, root / "draft")
    proc = start_server(str(root), "--skip-warmup", "--speculative-algorithm", "DFLASH",
                        "--speculative-draft-model-path", str(root / "draft"), "--speculative-min-confidence", "0.2",
                        name="dflash")
    yield proc
    assert proc.stop() is not None


def test_dflash_server_answers_as_plain_greedy(dflash_server):
    url = dflash_server.url
    assert httpx.get(url + "/get_server_info", timeout=10).json()["avg_spec_accept_length"] is None
    prompts = random_prompts(3, [9, 30, 17], seed=4)
    want = [o.tokens for o in tiny_engine().generate(prompts, 12)]  # no stop tokens: ignore_eos below
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": prompts, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert [b["output_ids"] for b in r.json()] == want
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    (model,) = [m.id for m in client.models.list().data]
    done = client.completions.create(model=model, prompt=prompts[1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text == TOK.decode(want[1])
    info = httpx.get(url + "/get_server_info", timeout=10).json()
    assert 1.0 <= info["avg_spec_accept_length"] <= 4.0  # verify steps ran: the bonus token at least, block 4
