"""A trainer driving the server (colocated RL): `python -m mimo_fn.serve` in its own process, and
this test's process as the trainer, an unrelated process as a trainer is. It pushes weights by
handle (shared memory made here, opened there), from disk and by broadcast over a gloo group it
hosts; after each, the server's greedy tokens and log-probs equal mf.forward on the new weights.
A bad update is a 400 naming what was wrong and leaves the weights byte-exact (the same
log-probs, bit for bit); release / resume cycles keep the weights and the server's memory flat;
requests wait while memory is released or generation paused, and none is lost."""

import concurrent.futures
import gc
import os
import threading
import time

import httpx
import pytest
import torch

import mimo_fn as mf
from dist_util import free_port
from mimo_fn.client import EngineClient, ServerError
from mimo_fn.rl import transfer
from mimo_fn.rl.weights import hub_tensors
from mimo_fn.serve.launch import nccl_graph_register
from serve_util import one_torch_thread, start_server
from test_engine_rl_api import fd_pickle

pytestmark = pytest.mark.usefixtures(one_torch_thread.__name__)
CFG = mf.ModelConfig.tiny()
PROMPTS = [[5, 6, 7, 8, 9], [40, 3, 3, 77, 12, 100, 9, 31]]
NEW = 5  # tokens generated per prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(str(tmp_path_factory.mktemp("serve_rl")), "--skip-warmup", "--enable-weights-cpu-backup")
    yield proc
    assert proc.stop() is not None


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.url) as c:
        yield c


def answers(url: str, prompts=PROMPTS) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their log-probs) of each prompt, one request at a time: alone in its
    passes, a prompt's log-probs are the same bits whenever the weights are (in a batch they
    would depend on which pass each request joined)."""
    out = []
    for prompt in prompts:
        r = httpx.post(url + "/generate", timeout=120, json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out.append((r.json()["output_ids"], [lp for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"]]))
    return out


def check_forward(url: str, params) -> None:
    """The server's answers equal mf.forward on params: the greedy tokens, and log-probs to fp32 rounding."""
    for prompt, (tokens, logprobs) in zip(PROMPTS, answers(url)):
        rows = mf.forward(params, CFG, torch.tensor(prompt + tokens)).float()[len(prompt) - 1:-1]
        assert tokens == rows.argmax(-1).tolist()
        want = torch.log_softmax(rows, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-5, rtol=0), (logprobs, want.tolist())


def bad(url: str, path: str, body: dict, says: str) -> None:
    """A 400 in SGLang's shape and ours, whose message says `says`."""
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["success"] is False and says in j["message"] and j["error"]["message"] == j["message"], j


def shm_files() -> set[str]:
    """This process's shared-memory files (torch names them after the creating pid)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def test_update_by_handle(server, client):
    version = int(client.get_weight_version())
    before = shm_files()

    def push(seed, **kw):  # temporaries: once the call returns, nothing of them may stay alive
        new = mf.init_params(CFG, seed=seed)
        client.update_weights_from_tensor([(n, t.clone()) for n, t in hub_tensors(new, CFG)], **kw)
        return new

    check_forward(server.url, push(11))
    assert client.get_weight_version() == str(version + 1)
    check_forward(server.url, push(12, load_format="flattened_bucket", weight_version="bucket-12"))
    assert client.get_weight_version() == "bucket-12"
    assert httpx.get(server.url + "/get_server_info").json()["weight_version"] == "bucket-12"
    gc.collect()
    deadline = time.monotonic() + 10  # the server let go of every handle: the files went with our tensors
    while shm_files() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not shm_files() - before


def test_update_from_disk(server, client, tmp_path):
    new = mf.init_params(CFG, seed=13)
    mf.save_checkpoint(new, CFG, tmp_path / "step")
    client.update_weights_from_disk(str(tmp_path / "step"))
    check_forward(server.url, new)
    before = answers(server.url)
    bad(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")}, "nowhere")
    other = mf.ModelConfig.tiny(vocab_size=160)
    mf.save_checkpoint(mf.init_params(other, seed=1), other, tmp_path / "other")
    bad(server.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "other")},
        "holds another model: its vocab_size is 160")
    bad(server.url, "/update_weights_from_disk", {}, "model_path")
    assert answers(server.url) == before


def test_update_by_broadcast(server, client):
    """The trainer hosts the group (rank 0), the server's one rank joins as rank 1; each update
    call runs in a thread while the trainer broadcasts. A refused update (an int tensor) is still
    received whole, so the group stays usable."""
    port, version = free_port(), client.get_weight_version()
    new = mf.init_params(CFG, seed=14)
    named = hub_tensors(new, CFG)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2)
        group = transfer.init_trainer_group("127.0.0.1", port, 2, backend="gloo")  # a CPU server
        joined.result()

        def update(tensors, **kw):
            done = pool.submit(client.update_weights_from_distributed, [n for n, _ in tensors],
                               [t.dtype for _, t in tensors], [t.shape for _, t in tensors], **kw)
            for _, t in tensors:
                transfer.broadcast(group, t)
            return done.result()

        before = answers(server.url)
        wrong = [*named[:3], (named[3][0], named[3][1].to(torch.int64)), *named[4:]]
        with pytest.raises(ServerError) as err:
            update(wrong)
        assert err.value.status_code == 400 and f"{named[3][0]!r} has dtype torch.int64" in err.value.message
        assert answers(server.url) == before and client.get_weight_version() == version
        update(named, weight_version="broadcast-14")
    check_forward(server.url, new)
    assert client.get_weight_version() == "broadcast-14"
    client.destroy_weights_update_group()
    bad(server.url, "/destroy_weights_update_group", {}, "no group 'weight_update_group'")
    bad(server.url, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32", "int8"],
                                                          "shapes": [[1]]}, "1 names, 2 dtypes and 1 shapes")
    bad(server.url, "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float17"], "shapes": [[1]]},
        "'a' has dtype 'float17'")
    bad(server.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": 0, "world_size": 2}, "rank_offset")


def test_bad_updates_leave_the_weights_byte_exact(server, client):
    before, version = answers(server.url), client.get_weight_version()
    named = hub_tensors(mf.init_params(CFG, seed=15), CFG)
    name, t = named[5]
    for tensors, says in [
        ([*named, ("model.layers.1.mlp.experts.0.nope_proj.weight", t)], "'model.layers.1.mlp.experts.0.nope_proj"),
        ([*named[:5], (name, t[:, 1:])], f"{name!r} has shape {list(t[:, 1:].shape)}"),
        ([*named[:5], (name, t.to(torch.int32))], f"{name!r} has dtype torch.int32"),
    ]:
        with pytest.raises(ServerError) as err:
            client.update_weights_from_tensor(tensors)
        assert err.value.status_code == 400 and says in err.value.message, err.value.message
    tag_says = "unknown memory tag 'gpu'; expected some of ['weights', 'kv_cache', 'cuda_graph']"
    with pytest.raises(ServerError, match="unknown memory tag 'gpu'"):
        client.release_memory_occupation(["weights", "gpu"])
    bad(server.url, "/resume_memory_occupation", {"tags": ["gpu"]}, tag_says)
    bad(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [fd_pickle(named[:2])]},
        "file_system")
    payload = transfer.serialize(named)
    bad(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload, payload]},
        "2 strings; expected one per rank of this server (1")
    bad(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]},
        "serialized_named_tensors[0]: not a base64 string")
    bad(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "load_format": "x"},
        "load_format = 'x'")
    bad(server.url, "/resume_memory_occupation", {"tags": ["weights"]}, "'weights' is not released")
    assert answers(server.url) == before and client.get_weight_version() == version


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_release_resume_cycles_keep_weights_and_memory_flat(server, client):
    before, version = answers(server.url), client.get_weight_version()
    for _ in range(10):  # warm-up: the backup buffers and the allocator's pools settle
        client.release_memory_occupation()
        client.resume_memory_occupation()
    rss = rss_kib(server.pid)
    for i in range(100):
        client.release_memory_occupation(["weights", "kv_cache", "cuda_graph"] if i % 2 else None)
        client.resume_memory_occupation()
    grown = (rss_kib(server.pid) - rss) / 1024
    # a weight backup or KV pool kept per cycle would be 0.9+ MiB a cycle (90+ MiB); it grew 0.3 MiB
    assert grown < 20, f"the server's RSS grew {grown:.1f} MiB over 100 release / resume cycles"
    assert answers(server.url) == before and client.get_weight_version() == version


def generate_in_thread(url: str, prompt, n: int = NEW):
    box = {}

    def run():
        box["r"] = httpx.post(url + "/generate", timeout=120, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})

    th = threading.Thread(target=run)
    th.start()
    return th, box


def long_stream(url: str, rid: str):
    """A streaming request that runs until it is aborted; returns (its line iterator, closer)."""
    cm = httpx.stream("POST", url + "/generate", timeout=120, json={
        "input_ids": PROMPTS[0], "rid": rid, "stream": True,
        "sampling_params": {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}})
    lines = cm.__enter__().iter_lines()
    next(line for line in lines if line.startswith("data: {"))  # it runs
    return lines, cm


def last_finish(lines) -> str:
    events = [line for line in lines if line.startswith("data: {")]
    import json

    return json.loads(events[-1][len("data: "):])["meta_info"]["finish_reason"]["type"]


def test_requests_wait_while_released_or_paused(server, client):
    url = server.url
    want = answers(url)
    client.release_memory_occupation()
    th, box = generate_in_thread(url, PROMPTS[1])
    th.join(1.0)
    assert th.is_alive()  # held back while the memory is out
    client.resume_memory_occupation()
    th.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["output_ids"] == want[1][0]

    lines, cm = long_stream(url, "running-1")
    bad(url, "/release_memory_occupation", {"timeout": 0.5}, "still in flight after 0.5 s (timeout)")
    client.pause_generation()  # the running request ends "abort"; a new one waits
    assert last_finish(lines) == "abort"
    cm.__exit__(None, None, None)
    th, box = generate_in_thread(url, PROMPTS[0])
    th.join(1.0)
    assert th.is_alive()
    client.continue_generation()
    th.join(60)
    assert box["r"].status_code == 200 and box["r"].json()["output_ids"] == want[0][0]

    lines, cm = long_stream(url, "running-2")  # a pause ends the wait of an update queued before it
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(client.update_weights_from_tensor, hub_tensors(
        mf.init_params(CFG, seed=17), CFG), weight_version="after-pause")
    time.sleep(0.5)
    assert not waiting.done()
    client.pause_generation()
    waiting.result(timeout=60)
    assert last_finish(lines) == "abort" and client.get_weight_version() == "after-pause"
    cm.__exit__(None, None, None)
    client.continue_generation()

    lines, cm = long_stream(url, "running-3")  # abort_all_requests: an update aborts instead of waiting
    r = httpx.post(url + "/update_weights_from_tensor", timeout=120, json={
        "serialized_named_tensors": [transfer.serialize(hub_tensors(mf.init_params(CFG, seed=16), CFG))],
        "abort_all_requests": True, "timeout": 30, "weight_version": "aborted-16"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert last_finish(lines) == "abort" and client.get_weight_version() == "aborted-16"
    cm.__exit__(None, None, None)
    check_forward(url, mf.init_params(CFG, seed=16))
    info = httpx.get(url + "/get_server_info").json()
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["num_used_pages"] == 0


def test_nccl_graph_register_with_the_memory_saver():
    env = {}
    assert nccl_graph_register(env, pausable_graphs=False) is None and env == {}
    assert nccl_graph_register(env, pausable_graphs=True) is None and env == {"NCCL_GRAPH_REGISTER": "0"}
    env = {"NCCL_GRAPH_REGISTER": "1"}  # the user's value wins, with the hazard named
    warning = nccl_graph_register(env, pausable_graphs=True)
    assert env == {"NCCL_GRAPH_REGISTER": "1"} and "read released pages" in warning and "deadlock" in warning
