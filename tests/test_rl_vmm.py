"""Release / resume at the same addresses (mimo_fn.rl.vmm, EngineConfig.memory_saver).

On the CPU a stand-in saver checks the engine's side (what is paused in place, what is backed up,
which graphs go); the GPU tests run torch_memory_saver itself."""

import dataclasses
import importlib.util
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import mimo_fn as mf
from mimo_fn.params import quantize_params
from mimo_fn.rl import memory, vmm

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
HAS_TMS = torch.cuda.is_available() and importlib.util.find_spec("torch_memory_saver") is not None


def _tokens(engine):
    return [o.tokens for o in engine.generate(PROMPTS, 6)]


class PoisoningSaver:
    """What a paused tag looks like to the engine: the storages stay where they are and, resumed,
    hold garbage (NaN bytes) until a backup or update_weights rewrites them."""

    def __init__(self, tags):
        self.tags = dict.fromkeys(tags, 0)
        self.calls = []
        self.storages = {}

    def adopt(self, tag, tensors):
        self.storages[tag] = memory.storages_of(tensors)

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))
        for s in self.storages[tag]:
            memory.bytes_of(s).fill_(0xFF)  # 0xFFFF... is a NaN in every float format here


def _saver_engine(cfg, params):
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=128, page_size=4))
    saver = PoisoningSaver(("weights", "kv_cache"))
    for tag in saver.tags:
        saver.adopt(tag, memory.tagged_tensors(engine.state, tag))
    engine.memory.saver = saver
    return engine, saver


@pytest.mark.parametrize("fp8", [False, True])
def test_paused_tags_keep_their_storages_and_come_back_from_the_backup(fp8):
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128) if fp8 \
        else mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    engine, saver = _saver_engine(cfg, quantize_params(cfg, params) if fp8 else params)
    want = _tokens(engine)
    tagged = {tag: memory.tagged_tensors(engine.state, tag) for tag in ("weights", "kv_cache")}
    ptrs = {tag: [t.data_ptr() for t in ts] for tag, ts in tagged.items()}
    freed = engine.release_memory(["weights", "kv_cache"], backup=True)
    assert freed == sum(s.nbytes() for ss in saver.storages.values() for s in ss)
    assert saver.calls == [("pause", "weights"), ("pause", "kv_cache")]
    assert all(t.untyped_storage().nbytes() > 0 for ts in tagged.values() for t in ts)  # paused, not resized
    with pytest.raises(ValueError, match=r"memory is released for \('weights', 'kv_cache'\)"):
        engine.generate(PROMPTS, 1)
    engine.resume_memory()
    assert saver.calls[2:] == [("resume", "weights"), ("resume", "kv_cache")]
    assert {tag: [t.data_ptr() for t in ts] for tag, ts in tagged.items()} == ptrs
    assert _tokens(engine) == want  # the weights from the backup; the pages' garbage never read


def test_paused_weights_without_a_backup_must_be_rewritten(tmp_path):
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    mf.save_checkpoint(params, cfg, tmp_path / "same")
    engine, saver = _saver_engine(cfg, params)
    want = _tokens(engine)
    engine.release_memory("weights")
    engine.resume_memory()
    assert torch.isnan(engine.state.params.embed).all()
    with pytest.raises(ValueError, match="not rewritten yet"):
        engine.generate(PROMPTS, 1)
    engine.update_weights(load_file(tmp_path / "same" / "model.safetensors").items())
    assert _tokens(engine) == want


def test_a_draft_models_memory_is_resized_beside_the_paused_tags():
    """With a DFlash draft, the saver pauses the target's tensors; the draft's weights (backed up
    always) and context pages are resized to 0 as without a saver, and come back the same."""
    from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash

    cfg = mf.ModelConfig.tiny()
    dcfg = DFlashConfig(target_layers=(1, 3), mask_token_id=cfg.vocab_size - 1, block_size=4, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
    params = mf.init_params(cfg, seed=3)
    proposer = DFlashProposer(init_dflash(cfg, dcfg, seed=1), dcfg, params, cfg)
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                    proposer=proposer))
    want = [o.tokens for o in engine.generate(PROMPTS, 10)]
    drafted = engine.spec_stats()["drafted"]
    saver = PoisoningSaver(("weights", "kv_cache"))
    for tag in saver.tags:
        saver.adopt(tag, memory.tagged_tensors(engine.state, tag))
    engine.memory.saver = saver
    draft_weights, draft_pages = proposer.weight_tensors(), proposer.kv_cache_tensors()
    assert draft_pages
    target = [s.nbytes() for ss in saver.storages.values() for s in ss]
    draft = sum(s.nbytes() for s in memory.storages_of(draft_weights + draft_pages))
    freed = engine.release_memory(["weights", "kv_cache"], backup=True)
    assert freed == sum(target) + draft
    assert [s.nbytes() for ss in saver.storages.values() for s in ss] == target  # paused in place
    assert all(t.untyped_storage().nbytes() == 0 for t in draft_weights + draft_pages)  # resized
    engine.resume_memory()
    assert [o.tokens for o in engine.generate(PROMPTS, 10)] == want
    assert engine.spec_stats()["drafted"] == drafted


def test_memory_saver_refuses_what_it_cannot_do(monkeypatch):
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    with pytest.raises(ValueError, match=r"memory_saver: needs the engine's weights on a CUDA device, got cpu"):
        mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64, page_size=4, memory_saver=True))
    monkeypatch.setitem(sys.modules, "torch_memory_saver", None)  # import fails
    with pytest.raises(ValueError, match=r"the torch_memory_saver package is not installed"):
        vmm.load_package()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match=r"expandable_segments:True"):
        vmm.load_package()


def _free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def check_saver_pauses_in_place_and_hands_the_memory_to_the_driver(tmp_path):
    saver = vmm.Saver(torch.device("cuda"))
    x = torch.randn(64, 1 << 20, device="cuda")  # 256 MiB
    view = x[3:5, 7:]
    want = x.clone()
    assert saver.adopt("weights", [x, view]) == x.untyped_storage().nbytes()
    ptr = x.data_ptr()  # moved with its bytes, the view with it
    assert torch.equal(x, want) and torch.equal(view, want[3:5, 7:])
    assert view.data_ptr() == ptr + (3 * (1 << 20) + 7) * 4
    before = _free()
    released = memory.release([x], backup=True, saver=saver, tag="weights")
    gained = _free() - before
    assert gained >= 0.95 * x.untyped_storage().nbytes(), gained
    memory.resume(released)
    assert x.data_ptr() == ptr and torch.equal(x, want) and torch.equal(view, want[3:5, 7:])
    vmm._MARGIN = 1 << 50  # as if the GPU were full: the bytes go aside through the host
    y = torch.randn(1 << 20, device="cuda")
    want_y = y.clone()
    saver.adopt("kv_cache", [y])
    assert torch.equal(y, want_y)
    z = torch.randn(1 << 20, device="cuda")
    saver.adopt("kv_cache", [z], keep_bytes=False)  # moved, bytes not kept
    z.copy_(want_y)
    released = memory.release([y, z], backup=True, saver=saver, tag="kv_cache")
    memory.resume(released)
    assert torch.equal(y, want_y) and torch.equal(z, want_y)
    del x, view, y, z, released  # their blocks go back to the saver's pool: freed at exit (vmm's exit hook)


def check_engine_keeps_its_graphs_across_a_release(tmp_path):
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1, device="cuda")
    mf.save_checkpoint(params, cfg, tmp_path / "same")
    config = mf.EngineConfig(max_tokens=1 << 21, page_size=128)
    want = _tokens(mf.Engine(cfg, params, config))
    engine = mf.Engine(cfg, params, dataclasses.replace(config, memory_saver=True))
    assert _tokens(engine) == want
    graphs, captures = len(engine.graphs), engine.graphs.stats["captures"]
    assert graphs > 0
    ptrs = [t.data_ptr() for tag in ("weights", "kv_cache") for t in memory.tagged_tensors(engine.state, tag)]
    before = _free()
    freed = engine.release_memory(["weights", "kv_cache"], backup=True)
    gained = _free() - before
    assert freed > 1 << 30 and gained >= 0.95 * freed, (gained, freed)  # the KV pools of 2M tokens
    engine.resume_memory()
    assert [t.data_ptr() for tag in ("weights", "kv_cache") for t in memory.tagged_tensors(engine.state, tag)] == ptrs
    assert _tokens(engine) == want
    assert (len(engine.graphs), engine.graphs.stats["captures"]) == (graphs, captures)  # replayed, not captured
    engine.release_memory("weights")  # no backup: rewritten through update_weights, graphs still kept
    engine.resume_memory()
    engine.update_weights(load_file(tmp_path / "same" / "model.safetensors").items())
    assert _tokens(engine) == want and engine.graphs.stats["captures"] == captures
    engine.release_memory()  # "graphs" too: dropped, captured again
    engine.resume_memory()
    engine.update_weights(load_file(tmp_path / "same" / "model.safetensors").items())
    assert _tokens(engine) == want and engine.graphs.stats["captures"] > captures
    del engine, params  # a discarded engine: the process must still exit cleanly


@pytest.mark.skipif(not HAS_TMS, reason="needs a GPU and torch_memory_saver")
@pytest.mark.parametrize("check", ["check_saver_pauses_in_place_and_hands_the_memory_to_the_driver",
                                   "check_engine_keeps_its_graphs_across_a_release"])
def test_on_the_gpu_in_a_process_of_its_own(check, tmp_path):
    """torch_memory_saver's state is the process's (its hook mode, its pools, their frees at exit):
    each check runs in a fresh interpreter, which must exit with 0."""
    done = subprocess.run([sys.executable, __file__, check, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "passed" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]


if __name__ == "__main__":  # python tests/test_rl_vmm.py CHECK TMP_DIR: one GPU check, in this process
    globals()[sys.argv[1]](pathlib.Path(sys.argv[2]))
    print(sys.argv[1], "passed")
