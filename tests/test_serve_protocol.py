"""The server's parts that need no running server: request validation (protocol.py), the
tokenizers and incremental detokenisation (tokenizer.py), flags (args.py, launch.py's config
overrides), and /health before warm-up (the app in this process, its loop not started)."""

import json

import pytest
import torch

import mimo_fn as mf
from mimo_fn.serve.args import ServerArgs, parse_args
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.serve.launch import override_config, plan
from mimo_fn.serve.protocol import ChatRequest, CompletionRequest, GenerateRequest, parse
from mimo_fn.serve.tokenizer import OutputText, TextTokenizer, tiny_tokenizer

CTX = {"vocab_size": 128}


def gen(body):
    return parse(GenerateRequest, body, context=CTX)


def test_generate_request_shapes_and_defaults():
    one = gen({"text": "hi"})
    assert one.prompts == ["hi"] and not one.is_batch and one.rids == [None]
    s = one.samplings[0]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.stop, s.seed) == (128, 1.0, 1.0, -1, (), None)
    batch = gen({"input_ids": [[1, 2], [3]], "rid": ["a", "b"], "sampling_params": [
        {"temperature": 0, "max_new_tokens": 3}, {"top_k": 5, "stop": "x", "sampling_seed": 9}]})
    assert batch.is_batch and batch.prompts == [[1, 2], [3]] and batch.rids == ["a", "b"]
    assert batch.samplings[0].temperature == 0 and batch.samplings[1].stop == ("x",)
    assert batch.samplings[1].seed == 9 and batch.samplings[1].top_k == 5
    # fields SGLang clients (and sglang-router) send at their neutral values are accepted; nulls mean the default
    assert gen({"input_ids": [5], "model": None, "log_metrics": True, "return_hidden_states": False,
                "sampling_params": {"skip_special_tokens": True, "n": 1, "stop": None}}).prompts == [[5]]


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [1, 128]}, "input_ids[1] = 128: outside the vocabulary"),
    ({"input_ids": [[1], [2, -1]]}, "input_ids[1][1] = -1"),
    ({"input_ids": [1, True]}, "input_ids: expected a list of token ids"),
    ({"text": ["a", ""]}, "text[1]: empty prompt"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"temperature": "0"}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": 1.01}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k = 0"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop: an empty stop string"),
    ({"text": "a", "sampling_params": {"stop": 3}}, "sampling_params.stop: expected a string"),
    ({"text": "a", "sampling_params": {"min_p": 0.1}}, "sampling_params.min_p = 0.1: not supported"),
    ({"text": "a", "sampling_params": {"temprature": 0}}, "sampling_params.temprature: unknown field"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params: 1 of them for 2 prompts"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 0}]}, "sampling_params[1].top_p"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid: expected a list of 2 distinct"),
    ({"text": "a", "top_logprobs_num": 2}, "top_logprobs_num = 2: not supported"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
])
def test_generate_request_errors_name_the_field(body, message):
    with pytest.raises(ValueError, match=None) as e:
        gen(body)
    assert message in str(e.value), str(e.value)


def test_openai_requests():
    c = parse(CompletionRequest, {"prompt": [[1, 2], [3]], "max_tokens": 4, "stop": ["a"], "top_k": 3,
                                  "stream_options": {"include_usage": True}, "user": "me"}, context=CTX)
    assert c.prompts == [[1, 2], [3]] and c.include_usage and c.sampling(c.max_tokens).stop == ("a",)
    for body, message in (({"prompt": "a", "n": 3}, "n = 3: not supported"), ({"prompt": "a", "echo": True}, "echo"),
                          ({"prompt": "a", "logprobs": 50}, "logprobs"), ({"prompt": [9, 200]}, "prompt[1] = 200"),
                          ({"prompt": ""}, "prompt: empty prompt"), ({}, "prompt: required")):
        with pytest.raises(ValueError) as e:
            parse(CompletionRequest, body, context=CTX)
        assert message in str(e.value), str(e.value)
    chat = parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}],
                               "max_completion_tokens": 7})
    assert chat.messages == [{"role": "user", "content": "ab"}] and chat.limit == 7
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        parse(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


def test_tiny_tokenizer():
    tok = tiny_tokenizer(128)
    assert tok.vocab_size == 128 and tok.eos_token_ids == (0, 2)
    text = "Hello, world!\n\tx = [1, 2]"
    assert tok.decode(tok.encode(text)) == text
    assert all(isinstance(tok.decode([i], skip_special_tokens=False), str) for i in range(128))
    prompt = tok.chat_prompt([{"role": "user", "content": "hi"}])
    ids = tok.encode(prompt)
    assert ids[0] == 1 and 2 in ids and tok.decode(ids) == "user\nhi\nassistant\n"  # specials are single ids
    assert tok.decode(tok.encode("héllo")) == "hllo"  # outside the characters: <unk>, dropped on decode
    bigger = tiny_tokenizer(1000)
    assert bigger.vocab_size == 1000 and bigger.decode([999]) == ""


def byte_level_tokenizer() -> TextTokenizer:
    """A byte-level BPE (as MiMo's tokenizer is), trained here: characters outside ASCII span several
    tokens, so a prefix of them decodes to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world", "the cat sat"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return TextTokenizer(tok, [tok.token_to_id("<eos>")], None, hf=False)


def test_output_text_emits_only_stable_text():
    tok = byte_level_tokenizer()
    text = "héllo wörld, 日本語 ok"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(len(ids)))  # the case under test occurs
    out, seen = OutputText(tok), []
    for t in ids:
        out.push(t)
        assert "\ufffd" not in out.visible and out.visible.startswith("".join(seen))
        seen = [out.visible]
    out.finish()
    assert out.text == text == out.visible


def test_output_text_stop_strings():
    tok = tiny_tokenizer(128)
    ids = tok.encode("abc STOP def")
    out, shown = OutputText(tok, ["STOP", "zzz"]), []
    for t in ids:
        out.push(t)
        shown.append(out.visible)
        if out.stopped:
            break
    assert out.stopped == "STOP" and out.text == "abc " and shown[-1] == "abc "
    assert all("abc ".startswith(s) for s in shown)  # the stop string's start is held back, never shown
    assert tok.decode(out.ids) == "abc STOP"  # up to the token that completed it
    out = OutputText(tok, ["STOP"])
    for t in tok.encode("xx ST"):
        out.push(t)
    assert out.visible == "xx " and out.text == "xx ST"
    out.finish()  # no more tokens: what was held back is the answer's end
    assert out.visible == "xx ST" and out.stopped is None


def test_output_text_skips_dropped_ids_with_the_same_text():
    """Ids decode() leaves out (the tiny tokenizer's specials: a random model's reserved ids) are not
    decoded again and again: the visible text after every push, the stop and the end are what the
    same tokenizer gives without the shortcut."""
    tok = tiny_tokenizer(400)
    plain = TextTokenizer(tok.backend, tok.eos_token_ids, None, hf=False)  # drops nothing
    assert tok.drops(0) and tok.drops(399) and not tok.drops(tok.encode("a")[0]) and not plain.drops(0)
    gen = torch.Generator().manual_seed(3)
    chars = tok.encode("ab cd STOP xy")
    for case in range(40):
        ids = [chars[i % len(chars)] if torch.rand((), generator=gen) < 0.5 else
               int(torch.randint(0, 400, (), generator=gen)) for i in range(int(torch.randint(1, 60, (), generator=gen)))]
        stop = ["STOP", "d S"] if case % 2 else []
        fast, ref = OutputText(tok, stop), OutputText(plain, stop)
        for t in ids:
            fast.push(t)
            ref.push(t)
            assert (fast.visible, fast.stopped, fast.ids) == (ref.visible, ref.stopped, ref.ids)
        fast.finish()
        ref.finish()
        assert (fast.text, fast.visible, fast.stopped) == (ref.text, ref.visible, ref.stopped)


def test_server_args():
    a = parse_args(["--port", "31000", "--dp-size", "2", "--tp-size", "4", "--quantization", "fp8",
                    "--json-model-override-args", '{"num_hidden_layers": 6}', "--skip-warmup"])
    assert (a.port, a.dp_size, a.tp_size, a.quantization, a.skip_warmup) == (31000, 2, 4, "fp8", True)
    assert a.model_overrides() == {"num_hidden_layers": 6} and a.host == "127.0.0.1"
    for bad in (["--port", "0"], ["--json-model-override-args", "[1]"], ["--json-model-override-args", "{x"],
                ["--load-format", "dummy"], ["--chunked-prefill-size", "0"], ["--quantization", "int4"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(ValueError, match="--max-total-tokens"):
        ServerArgs(max_total_tokens=0)


def test_json_model_override_args_slice_the_layers():
    released = json.loads(json.dumps(mf.ModelConfig.flash().to_hf()))
    sliced = mf.ModelConfig.from_hf(override_config(released, {"num_hidden_layers": 6}))
    assert sliced == mf.ModelConfig.flash(num_layers=6)
    nested = override_config({"text_config": released}, {"num_hidden_layers": 3, "vocab_size": 1000})
    assert mf.ModelConfig.from_hf(nested) == mf.ModelConfig.flash(num_layers=3, vocab_size=1000)


def test_memory_plan_says_what_does_not_fit():
    cfg = mf.ModelConfig.flash(num_layers=6)
    d, GiB = cfg.to_hf(), 2**30
    args = ServerArgs(model_path="/nowhere", load_format="dummy", page_size=128, max_total_tokens=65536)
    with pytest.raises(SystemExit) as e:  # bf16 weights of the 6-layer slice alone are ~64 GiB
        plan(args, cfg, d, Mesh.single(), torch.bfloat16, 16 * GiB, 128)
    for what in ("does not fit", "weights", "KV cache", "--quantization", "--max-total-tokens",
                 "--chunked-prefill-size", "--tp-size"):
        assert what in str(e.value), what
    assert plan(args, cfg, d, Mesh.single(), torch.bfloat16, 140 * GiB, 128) == (65536, 16384)
    # no --max-total-tokens: what the device holds beside the weights and a chunk, in whole pages
    auto = ServerArgs(model_path="/nowhere", load_format="dummy", page_size=128)
    tokens, chunk = plan(auto, cfg, d, Mesh.single(), torch.bfloat16, 140 * GiB, 128)
    assert tokens % 128 == 0 and 65536 < tokens and chunk == 16384
    with pytest.raises(SystemExit):  # that much more than the device holds
        plan(ServerArgs(model_path="/n", load_format="dummy", max_total_tokens=4 * tokens), cfg, d, Mesh.single(),
             torch.bfloat16, 140 * GiB, 128)
    assert plan(ServerArgs(), mf.ModelConfig.tiny(), {}, Mesh.single(), torch.float32, None, 16)[0] == 65536


def test_health_is_503_until_warmed_up():
    from fastapi.testclient import TestClient

    from mimo_fn.serve.http import ServerContext, create_app
    from mimo_fn.serve.loop import EngineLoop, Runner
    from serve_util import tiny_engine

    loop = EngineLoop(Runner(tiny_engine()))  # not started: it has not warmed up
    app = create_app(ServerContext(ServerArgs(), loop, tiny_tokenizer(128), 128, 2048, {}))
    r = TestClient(app).get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == "warming up"
    loop.ready.set()
    assert TestClient(app).get("/health").status_code == 200
    loop.failed = "RuntimeError: boom"
    r = TestClient(app).get("/health")
    assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
