"""Release / resume of memory by tag (mimo_fn.rl.memory, driven through Engine)."""

import re

import pytest
import torch
from safetensors.torch import load_file

import mimo_fn as mf
from mimo_fn.params import quantize_params
from mimo_fn.rl import memory
from mimo_fn.rl.weights import hub_names

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]


def _engine(cfg, params, max_tokens=128, page_size=4):
    return mf.Engine(cfg, params, mf.EngineConfig(max_tokens=max_tokens, page_size=page_size))


def _tokens(engine):
    return [o.tokens for o in engine.generate(PROMPTS, 6)]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("fp8", [False, True])
def test_release_with_backup_frees_everything_and_restores_it(fp8):
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128) if fp8 \
        else mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    engine = _engine(cfg, quantize_params(cfg, params) if fp8 else params)
    want = _tokens(engine)
    tagged = {tag: memory.tagged_tensors(engine.state, tag) for tag in memory.TAGS}
    shapes = {tag: [t.shape for t in ts] for tag, ts in tagged.items()}
    assert engine.release_memory(backup=True) == _bytes(tagged["weights"]) + _bytes(tagged["kv_cache"])
    assert all(t.untyped_storage().nbytes() == 0 for ts in tagged.values() for t in ts)
    with pytest.raises(ValueError, match=r"memory is released for \('weights', 'kv_cache', 'graphs'\)"):
        engine.generate(PROMPTS, 1)
    engine.resume_memory("kv_cache")  # one tag at a time
    with pytest.raises(ValueError, match=r"memory is released for \('weights', 'graphs'\)"):
        engine.generate(PROMPTS, 1)
    engine.resume_memory()
    assert {tag: [t.shape for t in memory.tagged_tensors(engine.state, tag)] for tag in memory.TAGS} == shapes
    assert _tokens(engine) == want


def test_release_without_backup_needs_every_weight_rewritten(tmp_path):
    cfg = mf.ModelConfig.tiny()
    mf.save_checkpoint(mf.init_params(cfg, seed=2), cfg, tmp_path / "new")
    new = load_file(tmp_path / "new" / "model.safetensors")
    assert hub_names(cfg) == set(new)
    engine = _engine(cfg, mf.init_params(cfg, seed=1))
    engine.release_memory("weights")
    with pytest.raises(ValueError, match=r"resume_memory\(\['weights'\]\) first"):
        engine.update_weights(new.items())
    engine.resume_memory()
    names = sorted(new)
    torch.nn.init.constant_(engine.state.params.embed, float("nan"))  # what was there is gone
    engine.update_weights([(n, new[n]) for n in names[:-1]])
    with pytest.raises(ValueError, match=rf"1 of them are not rewritten yet \(e.g. {re.escape(repr(names[-1]))}\)"):
        engine.generate(PROMPTS, 1)
    engine.update_weights([(names[-1], new[names[-1]])])
    _, want = mf.load_checkpoint(tmp_path / "new", dtype=torch.float32)
    assert _tokens(engine) == _tokens(_engine(cfg, want))


def test_bad_memory_calls_change_nothing(tmp_path):
    cfg = mf.ModelConfig.tiny()
    engine = _engine(cfg, mf.init_params(cfg, seed=1))
    want = _tokens(engine)
    with pytest.raises(ValueError, match=r"unknown memory tag 'graph'; expected some of \('weights', 'kv_cache', "
                                         r"'graphs'\)"):
        engine.release_memory(["weights", "graph"])
    with pytest.raises(ValueError, match=r"resume_memory: 'kv_cache' is not released \(released: \(\)\)"):
        engine.resume_memory("kv_cache")
    engine.release_memory("weights", backup=True)
    with pytest.raises(ValueError, match=r"'weights' is released already"):
        engine.release_memory()
    engine.resume_memory()
    state, _ = mf.prefill(engine.state, mf.Batch.from_tokens([7], [PROMPTS[0]]))
    engine.state = state
    with pytest.raises(ValueError, match=r"1 sequences hold KV pages"):
        engine.release_memory("kv_cache")
    engine.state = mf.release(engine.state, [7])
    # weights read from a file stay memory-mapped on the CPU: refused before anything is freed
    mf.save_checkpoint(mf.init_params(cfg, seed=1), cfg, tmp_path / "c")
    _, mapped = mf.load_checkpoint(tmp_path / "c", dtype=torch.float32)
    other = _engine(cfg, mapped)
    with pytest.raises(ValueError, match=r"storages cannot be resized .*memory-mapped"):
        other.release_memory(["kv_cache", "weights"])  # the KV pools could go: nothing goes
    assert all(t.untyped_storage().nbytes() > 0 for t in memory.tagged_tensors(other.state, "kv_cache"))
    assert all(t.untyped_storage().nbytes() > 0 for t in memory.tagged_tensors(other.state, "weights"))
    assert _tokens(engine) == want == _tokens(other)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_release_hands_gpu_memory_to_the_driver(tmp_path):
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1, device="cuda")  # CUDA's generator: not the CPU's weights
    mf.save_checkpoint(params, cfg, tmp_path / "same")
    engine = _engine(cfg, params, max_tokens=1 << 21, page_size=128)
    want = _tokens(engine)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    freed = engine.release_memory()
    gained = torch.cuda.mem_get_info()[0] - free_before
    assert freed > 1 << 30  # the KV pools of 2M tokens
    assert gained >= 0.95 * freed, (gained, freed)
    engine.resume_memory("kv_cache")
    engine.resume_memory("weights")
    with pytest.raises(ValueError, match=r"memory is released for \('graphs',\)"):
        engine.generate(PROMPTS, 1)
    engine.resume_memory("graphs")  # the decode graphs are captured again on first use
    with pytest.raises(ValueError, match="not rewritten yet"):
        engine.generate(PROMPTS, 1)
    engine.update_weights(load_file(tmp_path / "same" / "model.safetensors").items())
    assert _tokens(engine) == want


def test_backup_buffers_are_refilled_on_the_next_release():
    ts_ = [torch.randn(5, 7), torch.randn(3), torch.randn(2, 2)[:, :1]]  # the last: a view of a bigger storage
    first = memory.release(ts_, backup=True)
    assert first.nbytes == [5 * 7 * 4, 3 * 4, 2 * 2 * 4]
    memory.resume(first)
    for t in ts_:
        t.normal_()
    want = [t.clone() for t in ts_]
    again = memory.release(ts_, backup=True, reuse=first.backups)
    assert all(a is b for a, b in zip(again.backups, first.backups))
    memory.resume(again)
    assert all(torch.equal(t, w) for t, w in zip(ts_, want))


def test_mapped_weights_refused_before_the_prefix_cache_goes(tmp_path):
    """release_memory on weights memory-mapped from the checkpoint touches nothing, not even the
    prefix cache; cloned weights release and resume."""
    cfg = mf.ModelConfig.tiny()
    mf.save_checkpoint(mf.init_params(cfg, seed=1), cfg, tmp_path)
    _, mapped = mf.load_checkpoint(tmp_path, dtype=torch.float32)
    engine = mf.Engine(cfg, mapped, mf.EngineConfig(max_tokens=128, page_size=4, prefix_cache=True))
    want = _tokens(engine)
    cached = dict(engine.state.seqs)
    assert cached  # the prefix cache holds the prompts' pages
    with pytest.raises(ValueError, match=r"release_memory: the 'weights' tensors cannot be freed .*load_checkpoint "
                                         r"on the CPU maps the weights from the file; copy them first"):
        engine.release_memory()
    assert dict(engine.state.seqs) == cached and not engine.memory.released
    assert _tokens(engine) == want
    cloned = _engine(cfg, torch.utils._pytree.tree_map(torch.clone, mapped))
    cloned.release_memory(backup=True)
    cloned.resume_memory()
    assert _tokens(cloned) == want


def test_a_state_taken_before_a_release_is_stale():
    """release_memory and resume_memory hand the engine a new state: one taken before raises, as
    a donated state does, instead of reading memory that went back to the driver."""
    cfg = mf.ModelConfig.tiny()
    engine = mf.Engine(cfg, mf.init_params(cfg, seed=0), mf.EngineConfig(max_tokens=64, page_size=4))
    before = engine.state
    engine.release_memory(["kv_cache"])
    with pytest.raises(mf.StaleStateError):
        mf.prefill(before, mf.Batch.from_tokens([0], [[1, 2, 3]]))
    during = engine.state
    engine.resume_memory()
    with pytest.raises(mf.StaleStateError):
        mf.prefill(during, mf.Batch.from_tokens([0], [[1, 2, 3]]))
    fresh = mf.Engine(cfg, mf.init_params(cfg, seed=0), mf.EngineConfig(max_tokens=64, page_size=4))
    assert engine.generate([[1, 2, 3]], max_new_tokens=3)[0].tokens == fresh.generate([[1, 2, 3]],
                                                                                      max_new_tokens=3)[0].tokens


def test_release_refused_while_requests_are_queued():
    """A request added but not yet run holds no pages, yet its next pass reads the weights and the
    KV pools: release_memory was accepted, and the next step() raised a raw RuntimeError (a
    storage of size 0) and lost every queued request without an output (found by
    tests/test_engine_state_machine.py)."""
    cfg = mf.ModelConfig.tiny()
    engine = _engine(cfg, mf.init_params(cfg, seed=1))
    want = _tokens(engine)
    rid = engine.add_request(PROMPTS[0], max_new_tokens=6)
    for tags in (["weights"], ["kv_cache"], None):
        with pytest.raises(ValueError, match=r"release_memory: 1 requests are queued or running; call it once "
                                             r"they have finished \(flush_cache runs them to the end\)"):
            engine.release_memory(tags, backup=True)
    assert not engine.memory.released
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.output.tokens for o in outs if o.finished and o.rid == rid] == [want[0]]
    engine.release_memory(backup=True)  # nothing in flight: accepted
    engine.resume_memory()
    assert _tokens(engine) == want
