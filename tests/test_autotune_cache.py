"""kernels.autotune_cache: an autotuner's picks written by one process are found by the next, per
GPU model, with their pre_hooks; MIMO_FN_AUTOTUNE_CACHE=0 keeps them in the process only.

The tuners here are real triton Autotuners over a real JITFunction; only their launch is stood in
for (no GPU): it "tunes" a key it has not seen as Triton's run does, by filling Autotuner.cache.
"""

import dataclasses
import json

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mimo_fn import options
from mimo_fn.kernels import autotune_cache
from mimo_fn.kernels.autotune_cache import FILE_NAME, Persisted


def _kernel(x_ptr, N, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)


def _hook(nargs):
    pass


def _prune(configs, named_args, **kwargs):
    return configs


def _tuner(log: list):
    """A fresh autotuner (as a new process builds it) whose launch records (key, config index, tuned)."""
    configs = [triton.Config({"BLOCK": b}, num_warps=w, pre_hook=_hook) for b, w in ((16, 4), (32, 4), (32, 8))]
    tuner = triton.autotune(configs, key=["N"], prune_configs_by={"early_config_prune": _prune})(JITFunction(_kernel))

    def run(*args, grid, warmup, **kwargs):
        key = (kwargs["N"], "torch.float32")
        tuned = key not in tuner.cache
        if tuned:  # the pick depends on the key, as timings would
            tuner.cache[key] = tuner.configs[kwargs["N"] % len(tuner.configs)]
        log.append((key, tuner.configs.index(tuner.cache[key]), tuned))

    tuner.run = run
    return tuner


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, autotune_cache=True))  # as by default
    return tmp_path


def _launch(kernel, n: int) -> None:
    kernel[(1,)](None, N=n)


def test_picks_outlive_the_process(cache_dir):
    log = []
    first = Persisted(_tuner(log))
    _launch(first, 64)
    _launch(first, 64)
    assert log == [((64, "torch.float32"), 1, True), ((64, "torch.float32"), 1, False)]
    files = list(cache_dir.rglob(FILE_NAME))
    assert len(files) == 1 and json.loads(files[0].read_text()) == [[[64, "torch.float32"], 1]]

    log.clear()
    second_tuner = _tuner(log)  # the next process: its own Config objects
    second = Persisted(second_tuner)
    _launch(second, 64)
    _launch(second, 65)  # a new key is tuned and added beside the stored one
    assert log == [((64, "torch.float32"), 1, False), ((65, "torch.float32"), 2, True)]
    assert second_tuner.cache[(64, "torch.float32")] is second_tuner.configs[1]  # with its pre_hook
    assert second_tuner.configs[1].pre_hook is _hook
    assert sorted(map(tuple, (k for k, _ in json.loads(files[0].read_text())))) == [
        (64, "torch.float32"), (65, "torch.float32")]

    log.clear()
    _launch(Persisted(_tuner(log)), 65)
    assert log == [((65, "torch.float32"), 2, False)]


def test_another_gpu_model_tunes_again(cache_dir, monkeypatch):
    log = []
    _launch(Persisted(_tuner(log)), 64)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    _launch(Persisted(_tuner(log)), 64)
    assert [tuned for *_, tuned in log] == [True, True]
    assert len(list(cache_dir.rglob(FILE_NAME))) == 2


def test_store_key_follows_the_configs_and_the_kernel():
    a, b = _tuner([]), _tuner([])
    assert autotune_cache.store_key(a, "g") == autotune_cache.store_key(b, "g")
    assert autotune_cache.store_key(a, "g") != autotune_cache.store_key(a, "h")
    b.configs = b.configs[:2]
    assert autotune_cache.store_key(a, "g") != autotune_cache.store_key(b, "g")


def test_a_torn_file_is_tuned_over(cache_dir):
    log = []
    _launch(Persisted(_tuner(log)), 64)
    (path,) = cache_dir.rglob(FILE_NAME)
    path.write_text('[[[64, "torch.fl')
    _launch(Persisted(_tuner(log)), 64)
    assert [tuned for *_, tuned in log] == [True, True]
    assert json.loads(path.read_text()) == [[[64, "torch.float32"], 1]]


def test_off_keeps_the_picks_in_the_process(cache_dir):
    log = []
    with options.override(autotune_cache=False):
        _launch(Persisted(_tuner(log)), 64)
        _launch(Persisted(_tuner(log)), 64)
    assert [tuned for *_, tuned in log] == [True, True]
    assert not list(cache_dir.rglob(FILE_NAME))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the MoE autotuners run on CUDA only")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_moe_picks_come_back_in_a_new_process_without_tuning(fmt, monkeypatch):
    """The real MoE tuners: their keys survive the JSON file, and a process that finds them runs
    the same configs (the same bits) without timing any. The compiled kernels stay in the
    machine's Triton cache; a new process is stood in for by emptying each tuner's memory."""
    from mimo_fn.kernels.moe import gemm, mxfp4
    from mimo_fn.kernels.moe.dispatch import fused_moe_mxfp4
    from mimo_fn.quant import quantize_fp8_block, quantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    t, h, i, e, k = 512, 256, 256, 8, 2
    x_TH = torch.randn(t, h, generator=gen).cuda().bfloat16()
    w13_E2IH, w2_EHI = torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5
    ids_TK = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].cuda()
    weights_TK = (torch.rand(t, k, generator=gen) + 0.1).cuda()
    if fmt == "bf16":
        w13, w2 = w13_E2IH.cuda().bfloat16(), w2_EHI.cuda().bfloat16()
        run = lambda: gemm.fused_moe(x_TH, w13, w2, ids_TK, weights_TK)  # noqa: E731
    elif fmt == "fp8":
        w13, w2 = quantize_fp8_block(w13_E2IH.cuda()), quantize_fp8_block(w2_EHI.cuda())
        run = lambda: gemm.fused_moe_fp8(x_TH, w13.data, w13.scale, w2.data, w2.scale, ids_TK, weights_TK)  # noqa: E731
    else:
        w13, w2 = quantize_mxfp4(w13_E2IH.cuda()), quantize_mxfp4(w2_EHI.cuda())
        run = lambda: fused_moe_mxfp4(x_TH, w13, w2, ids_TK, weights_TK, dequantize=False)  # noqa: E731
    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, moe_autotune=True,
                                                                autotune_cache=True))
    wrappers = [w for mod in (gemm, mxfp4) for tuned in (mod._TUNED, mod._TUNED_SMALL_M)
                for pair in tuned.values() for w in pair]

    def new_process():  # nothing in memory, the picks on disk
        for w in wrappers:
            w.tuner.cache.clear()
            w._store = None

    new_process()
    first_TH = run()
    used = [w for w in wrappers if w.tuner.cache]
    assert used
    new_process()
    benched = []
    for w in wrappers:
        monkeypatch.setattr(w.tuner, "_bench", lambda *a, **kw: benched.append(1) or [1.0, 1.0, 1.0])
    again_TH = run()
    assert not benched, "a stored pick was not found: the launch timed configs again"
    assert all(w.tuner.cache for w in used)
    assert torch.equal(first_TH, again_TH)


def test_the_wrapper_reads_through_to_the_tuner():
    """Benchmarks read the tuners' picks (`kernel.cache`) and configs through the wrapper."""
    tuner = _tuner([])
    wrapped = Persisted(tuner)
    assert wrapped.cache is tuner.cache and wrapped.configs is tuner.configs
