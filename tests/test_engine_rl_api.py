"""The Engine's colocated-RL calls under SGLang's names (mimo_fn.engine.rl_api), in process: each
update form lands the new weights (greedy tokens and log-probs then equal mf.forward on them), a
bad one changes nothing, tags take SGLang's names, pause holds requests, and on a mesh every rank
raises together when one rejects a call."""

import base64
import io
import threading
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import mimo_fn as mf
from dist_util import free_port, run_ranks
from mimo_fn.engine.rl_api import RejectedElsewhere
from mimo_fn.params import quantize_params, to_flat
from mimo_fn.quant import QTensor
from mimo_fn.rl import transfer
from mimo_fn.rl.weights import hub_tensors

CFG = mf.ModelConfig.tiny()
PROMPTS = [[5, 6, 7, 8, 9], [40, 3, 3, 77, 12, 100, 9]]


def engine(seed=0, **config) -> mf.Engine:
    return mf.Engine(CFG, mf.init_params(CFG, seed=seed), mf.EngineConfig(max_tokens=256, page_size=8, **config))


def snapshot(e: mf.Engine) -> dict:
    return {k: (v.data.clone(), v.scale.clone()) if isinstance(v, QTensor) else v.clone()
            for k, v in to_flat(e.state.params).items()}


def same_weights(e: mf.Engine, snap: dict) -> bool:
    now = snapshot(e)
    return all(torch.equal(now[k][0], snap[k][0]) and torch.equal(now[k][1], snap[k][1]) if isinstance(now[k], tuple)
               else torch.equal(now[k], snap[k]) for k in snap)


def holds(e: mf.Engine, params) -> bool:
    """The engine's weights are exactly `params` (dense)."""
    want = to_flat(params)
    return all(torch.equal(v, want[k]) for k, v in to_flat(e.state.params).items())


def check_forward(e: mf.Engine, params, cfg=CFG, tol=1e-5) -> None:
    """Greedy tokens and their log-probs of every prompt equal mf.forward on `params` (a generate
    costs seconds with the shape checks on: the tests call it sparingly)."""
    for prompt, out in zip(PROMPTS, e.generate(PROMPTS, 4, return_logprobs=True)):
        logits = mf.forward(params, cfg, torch.tensor(prompt + out.tokens)).float()
        rows = logits[len(prompt) - 1:-1]
        assert out.tokens == rows.argmax(-1).tolist()
        want = torch.log_softmax(rows, -1).gather(1, torch.tensor(out.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=tol, rtol=0)


def test_each_update_form_lands_in_place_and_bumps_the_version(tmp_path):
    e = engine()
    ptrs = {k: v.data_ptr() for k, v in to_flat(e.state.params).items()}
    assert e.get_weight_version() == "0"
    forms = [
        ("pairs", lambda named: e.update_weights_from_tensor(named)),
        ("dict", lambda named: e.update_weights_from_tensor(dict(named))),
        ("serialised", lambda named: e.update_weights_from_tensor(transfer.serialize(named))),
        ("bucket", lambda named: e.update_weights_from_tensor(transfer.flatten(named), load_format="flattened_bucket")),
        ("serialised bucket", lambda named: e.update_weights_from_tensor(
            transfer.serialize(transfer.flatten(named)), load_format="flattened_bucket", weight_version="step-5")),
    ]
    for i, (form, push) in enumerate(forms):
        new = mf.init_params(CFG, seed=10 + i)
        push(hub_tensors(new, CFG))
        assert holds(e, new), form
        assert e.get_weight_version() == (str(i + 1) if i < 4 else "step-5"), form
    new = mf.init_params(CFG, seed=20)
    mf.save_checkpoint(new, CFG, tmp_path / "ckpt")
    e.update_weights_from_disk(str(tmp_path / "ckpt"))
    assert holds(e, new)
    check_forward(e, new)
    assert e.get_weight_version() == "step-5+1"
    assert e.update_weights(hub_tensors(mf.init_params(CFG, seed=0), CFG)) == len(hub_tensors(new, CFG))
    assert e.get_weight_version() == "step-5+1+1"
    assert {k: v.data_ptr() for k, v in to_flat(e.state.params).items()} == ptrs  # the same storage throughout


def test_older_buckets_of_one_dtype_read_too():
    """SGLang's older buckets: a flat tensor of the tensors' own dtype, ranges in elements."""
    named = hub_tensors(mf.init_params(CFG, seed=3), CFG)
    flat = torch.cat([t.reshape(-1) for _, t in named])
    metadata, at = [], 0
    for name, t in named:
        metadata.append(transfer.FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + t.numel(), t.numel()))
        at += t.numel()
    got = transfer.unflatten({"flattened_tensor": flat, "metadata": metadata})
    assert [n for n, _ in got] == [n for n, _ in named] and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))


def test_update_from_disk_requantises_fp8_weights(tmp_path):
    """An FP8 engine takes a dense checkpoint as load_checkpoint(quant="fp8") would read it, expert
    stacks included; a checkpoint of another model or a missing one changes nothing."""
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)
    e = mf.Engine(cfg, quantize_params(cfg, mf.init_params(cfg, seed=1)), mf.EngineConfig(max_tokens=128, page_size=8))
    mf.save_checkpoint(mf.init_params(cfg, seed=2), cfg, tmp_path / "new")
    e.update_weights_from_disk(str(tmp_path / "new"))
    _, want = mf.load_checkpoint(tmp_path / "new", dtype=torch.float32, quant="fp8", progress=False)
    tokens = torch.tensor(PROMPTS[1])
    assert torch.equal(mf.forward(e.state.params, cfg, tokens), mf.forward(want, cfg, tokens))
    before = snapshot(e)
    other = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128, vocab_size=160)
    mf.save_checkpoint(mf.init_params(other, seed=3), other, tmp_path / "other")
    with pytest.raises(ValueError, match="holds another model: its vocab_size is 160"):
        e.update_weights_from_disk(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="model_path .*nowhere"):
        e.update_weights_from_disk(str(tmp_path / "nowhere"))
    assert same_weights(e, before) and e.get_weight_version() == "1"


def fd_pickle(named) -> str:
    """What torch.multiprocessing sends by default: CPU storages as file descriptors."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class Evil:
    def __reduce__(self):
        return (print, ("this must not run",))


def test_bad_updates_change_nothing():
    e = engine()
    before = snapshot(e)
    good = hub_tensors(mf.init_params(CFG, seed=4), CFG)
    name, t = good[3]
    bucket = transfer.flatten(good[:3])
    bucket["metadata"][1] = transfer.FlattenedTensorMetadata(name, t.shape, t.dtype, 0, 10**9, 10**9)
    cases = [
        ([*good, ("model.layers.0.nope.weight", t)], "unknown weight 'model.layers.0.nope.weight'"),
        ([*good[:5], (name, t[:-1])], f"'{name}' has shape"),  # the good tensors before it are not written either
        ([*good, (name, t.to(torch.int32))], f"'{name}' has dtype torch.int32; expected a floating-point"),
        ([(name, t.bool())], f"'{name}' has dtype torch.bool"),
        ([(name, t.to(torch.complex64))], f"'{name}' has dtype torch.complex64"),
        ([(name, torch.zeros(t.shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))],
         f"'{name}' has dtype torch.float4_e2m1fn_x2, which cannot be cast"),
        ([(name, t.to_sparse())], f"'{name}' is a torch.sparse_coo tensor"),
        (transfer.serialize([("x", t), 3]), "entry 1 is a int"),
        (fd_pickle([(name, t.clone())]), "file_system"),
        (base64.b64encode(ForkingPickler.dumps([Evil()])).decode(), "names builtins.print"),
        ("not base64!", "not a base64 string"),
    ]
    for payload, message in cases:
        with pytest.raises(ValueError) as err:
            e.update_weights_from_tensor(payload)
        assert message in str(err.value)
    with pytest.raises(ValueError, match=f"'{name}' spans"):
        e.update_weights_from_tensor(bucket, load_format="flattened_bucket")
    with pytest.raises(ValueError, match="load_format: 'safetensors'"):
        e.update_weights_from_tensor(good, load_format="safetensors")
    with pytest.raises(ValueError, match="weight_version = 3"):
        e.update_weights_from_tensor(good, weight_version=3)
    assert same_weights(e, before) and e.get_weight_version() == "0"


def test_memory_occupation_takes_sglang_tags():
    e, weights = engine(), mf.init_params(CFG, seed=0)
    with pytest.raises(ValueError, match=r"unknown memory tag 'gpu'; expected some of \['weights', 'kv_cache', "
                                         r"'cuda_graph'\]"):
        e.release_memory_occupation(["weights", "gpu"])
    assert not e.memory.released
    e.release_memory_occupation(["kv_cache", "cuda_graph"])
    assert set(e.memory.released) == {"kv_cache", "graphs"}
    with pytest.raises(ValueError, match="'kv_cache' is released already"):
        e.release_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="'weights' is not released"):
        e.resume_memory_occupation(["weights"])
    with pytest.raises(ValueError, match="memory is released"):
        e.generate(PROMPTS, 2)
    e.resume_memory_occupation()
    e.release_memory_occupation()  # no backup (EngineConfig.weights_cpu_backup): the weights must be pushed
    e.resume_memory_occupation(["weights", "kv_cache", "graphs"])
    with pytest.raises(ValueError, match="not rewritten yet"):
        e.generate(PROMPTS, 2)
    e.update_weights_from_tensor(hub_tensors(weights, CFG))
    assert holds(e, weights) and not e.memory.unsynced

    kept = engine(weights_cpu_backup=True)
    for _ in range(3):
        kept.release_memory_occupation()
        kept.resume_memory_occupation()
    assert holds(kept, weights) and not kept.memory.unsynced


def test_pause_aborts_in_flight_and_holds_new_requests():
    e = engine()
    want = engine().generate([PROMPTS[1]], 6)[0].tokens
    first = e.add_request(PROMPTS[0], max_new_tokens=50)
    e.step()
    e.pause_generation()
    outs = e.step()
    assert [(o.rid, o.finish_reason) for o in outs] == [(first, "abort")]
    later = e.add_request(PROMPTS[1], max_new_tokens=6)
    assert e.step() == [] and e.has_unfinished()  # it waits
    with pytest.raises(ValueError, match="generation is paused"):
        e.generate(PROMPTS, 2)
    e.continue_generation()
    done = {}
    while e.has_unfinished():
        done.update({o.rid: o.output for o in e.step() if o.finished})
    assert done[later].tokens == want and done[later].finish_reason == "length"


def test_update_by_broadcast_in_process():
    """The trainer's side (a thread here; a process in test_serve_rl) hosts the group and
    broadcasts; the engine receives everything, then writes or (an int tensor) refuses it all."""
    # neither side names a backend in user code: both pick by device, gloo for CPU tensors
    assert transfer.default_backend(False) == "gloo" and transfer.default_backend(True) == "nccl"
    e, port = engine(), free_port()
    new = hub_tensors(mf.init_params(CFG, seed=6), CFG)
    trainer_group = {}

    def trainer(tensors):
        if "g" not in trainer_group:
            trainer_group["g"] = transfer.init_trainer_group("127.0.0.1", port, 2, backend="gloo")  # a CPU engine
        for _, t in tensors:
            transfer.broadcast(trainer_group["g"], t)

    def round_(tensors, **kw):
        th = threading.Thread(target=trainer, args=(tensors,))
        th.start()
        try:
            if "g" not in trainer_group and not kw.pop("joined", False):
                e.init_weights_update_group("127.0.0.1", port, 1, 2)
            e.update_weights_from_distributed([n for n, _ in tensors], [str(t.dtype) for _, t in tensors],
                                              [list(t.shape) for _, t in tensors], **kw)
        finally:
            th.join()

    before = snapshot(e)
    bad = [*new[:4], (new[4][0], new[4][1].to(torch.int64))]
    with pytest.raises(ValueError, match=f"'{new[4][0]}' has dtype torch.int64"):
        round_(bad)
    assert same_weights(e, before)
    round_(new, weight_version="from-broadcast")  # the group still works after a refused update
    assert holds(e, mf.init_params(CFG, seed=6))
    assert e.get_weight_version() == "from-broadcast"
    with pytest.raises(ValueError, match="no group 'other'"):
        e.update_weights_from_distributed([], [], [], group_name="other")
    with pytest.raises(ValueError, match="group_name 'weight_update_group' exists already"):
        e.init_weights_update_group("127.0.0.1", port, 1, 2)
    with pytest.raises(ValueError, match="rank_offset 0"):
        e.init_weights_update_group("127.0.0.1", port, 0, 2, group_name="g2")
    e.destroy_weights_update_group()
    with pytest.raises(ValueError, match="no group"):
        e.destroy_weights_update_group()


def _agree_worker(rank, world, path):
    from mimo_fn.parallel.mesh import init_mesh

    mesh = init_mesh(1, 2, 2)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    local = mf.params.from_flat(cfg, {k: v.clone() for k, v in to_flat(local).items()})
    e = mf.Engine(cfg, local, mf.EngineConfig(max_tokens=128, page_size=4, chunk_size=8), mesh=mesh)
    before = snapshot(e)
    new = mf.init_params(cfg, seed=7)
    named = hub_tensors(new, cfg)
    # rank 1's payload names a weight no model has; rank 0's is good: both raise, neither writes
    mine = [*named, ("model.layers.0.nope.weight", named[0][1])] if rank == 1 else named
    with pytest.raises(RejectedElsewhere if rank == 0 else ValueError, match="rank\\(s\\) \\[1\\]" if rank == 0
                       else "unknown weight"):
        e.update_weights_from_tensor(transfer.serialize(mine))
    assert same_weights(e, before) and e.get_weight_version() == "0"
    with pytest.raises(ValueError, match="unknown memory tag" if rank == 1 else "rank\\(s\\) \\[1\\]"):
        e.release_memory_occupation(["weights", "gpu"] if rank == 1 else ["weights"])
    assert not e.memory.released
    e.update_weights_from_tensor(transfer.serialize(named))
    e.release_memory_occupation()
    e.resume_memory_occupation()
    e.update_weights_from_tensor(named)
    out = e.generate([PROMPTS[1]], 4)[0]
    logits = mf.forward(new, cfg, torch.tensor(PROMPTS[1] + out.tokens))
    assert out.tokens == logits[len(PROMPTS[1]) - 1:-1].argmax(-1).tolist() and e.get_weight_version() == "2"


def test_mesh_ranks_raise_together(tmp_path):
    from test_parallel import write_checkpoint

    run_ranks(2, _agree_worker, str(write_checkpoint(tmp_path / "ckpt")), tmp_dir=str(tmp_path))
