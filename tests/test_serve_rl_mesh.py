"""A trainer driving a multi-rank server: torchrun over 4 gloo CPU processes, DP 2 x attention TP 2
x EP 4. Every rank applies each call: after an update by handle (one payload per rank), from disk
(each rank reads its slices) or by broadcast (the trainer and the 4 ranks in one group), and after
release / resume, prompts answered by both DP groups equal mf.forward on the new weights. A
payload only one rank cannot read fails the call on every rank, with that rank's reason."""

import asyncio
import concurrent.futures

import httpx
import pytest
import torch

import mimo_fn as mf
from dist_util import free_port
from mimo_fn.client import EngineClient, ServerError
from mimo_fn.rl import transfer
from mimo_fn.rl.weights import hub_tensors
from serve_util import one_torch_thread, random_prompts, start_server

CFG = mf.ModelConfig.tiny()
# slow: four server processes; .ci/run leaves them to scripts/gpu_tests.py (the nightly-style run)
pytestmark = [pytest.mark.usefixtures(one_torch_thread.__name__), pytest.mark.slow]


@pytest.fixture(scope="module")
def mesh_server(tmp_path_factory):
    proc = start_server(str(tmp_path_factory.mktemp("serve_rl_mesh")), "--dp-size", "2", "--tp-size", "2",
                        "--ep-size", "4", "--skip-warmup", "--enable-weights-cpu-backup", nproc=4, name="mesh")
    yield proc
    proc.stop()


def check_both_groups(url: str, params) -> None:
    """8 prompts at once (both DP groups take some): greedy tokens equal mf.forward on params,
    log-probs within 1e-4 (fp32 on a mesh: partial sums in another order)."""
    prompts = random_prompts(8, [5, 17, 9, 30], seed=50)
    before = httpx.get(url + "/get_server_info").json()["dp_requests_total"]

    async def run():
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*(c.post(url + "/generate", json={
                "input_ids": p, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}) for p in prompts))
        return [r.json() for r in rs]

    for prompt, out in zip(prompts, asyncio.run(run())):
        tokens = out["output_ids"]
        rows = mf.forward(params, CFG, torch.tensor(prompt + tokens)).float()[len(prompt) - 1:-1]
        assert tokens == rows.argmax(-1).tolist()
        want = torch.log_softmax(rows, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    after = httpx.get(url + "/get_server_info").json()["dp_requests_total"]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_every_rank_applies_each_call(mesh_server, tmp_path):
    url = mesh_server.url
    client = EngineClient(url)
    new = mf.init_params(CFG, seed=21)
    client.update_weights_from_tensor(hub_tensors(new, CFG))  # one payload per rank (4, from /get_server_info)
    assert client.num_ranks == 4 and client.get_weight_version() == "1"
    check_both_groups(url, new)

    new = mf.init_params(CFG, seed=22)
    mf.save_checkpoint(new, CFG, tmp_path / "disk")
    client.update_weights_from_disk(str(tmp_path / "disk"))
    check_both_groups(url, new)

    new, port = mf.init_params(CFG, seed=23), free_port()
    named = hub_tensors(new, CFG)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 5)
        group = transfer.init_trainer_group("127.0.0.1", port, 5, backend="gloo")  # CPU ranks
        joined.result()
        done = pool.submit(client.update_weights_from_distributed, [n for n, _ in named], [t.dtype for _, t in named],
                           [t.shape for _, t in named], weight_version="broadcast")
        for _, t in named:
            transfer.broadcast(group, t)
        done.result()
    client.destroy_weights_update_group()
    assert client.get_weight_version() == "broadcast"
    check_both_groups(url, new)

    for tags in (None, ["kv_cache", "cuda_graph"]):
        client.release_memory_occupation(tags)
        client.resume_memory_occupation(tags)
    check_both_groups(url, new)

    # rank 2 alone gets a payload it must refuse: every rank refuses, with rank 2's reason
    good = transfer.serialize(hub_tensors(mf.init_params(CFG, seed=24), CFG))
    odd = transfer.serialize([*hub_tensors(mf.init_params(CFG, seed=24), CFG), ("model.norm.nope", torch.ones(1))])
    r = httpx.post(url + "/update_weights_from_tensor", timeout=120,
                   json={"serialized_named_tensors": [good, good, odd, good]})
    assert r.status_code == 400 and "unknown weight 'model.norm.nope'" in r.json()["message"], r.text
    with pytest.raises(ServerError, match="unknown memory tag 'gpu'"):
        client.release_memory_occupation(["gpu"])
    assert client.get_weight_version() == "broadcast"
    check_both_groups(url, new)
    client.close()
