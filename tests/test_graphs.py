"""CUDA-graph decode and verify steps (mimo_fn.graphs) against eager ones: tokens, log-probs,
routed experts, across batch sizes and page-table widths, weight sync and memory release. GPU
only: on the CPU the engine never captures (test_cpu_engine_runs_eagerly)."""

import dataclasses
import gc

import pytest
import torch
from safetensors.torch import load_file

import mimo_fn as mf
from mimo_fn import graphs as graphs_mod
from mimo_fn.batch import StepMeta, step_meta
from mimo_fn.cache import extend
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.params import quantize_params

CFG = mf.ModelConfig.tiny()
# 3..90 tokens: with pages of 4 the tables grow through the widths 16, 32 and 64 while decoding
PROMPTS = [[(7 * i + 3 * j) % CFG.vocab_size for j in range(n)] for i, n in enumerate((3, 90, 17, 41, 60))]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _engine(params, graphs: bool):
    return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=2048, page_size=4, chunk_size=64, cuda_graphs=graphs))


def _run(engine, stops=()):
    return engine.generate(PROMPTS, 40, return_logprobs=True, stop_token_ids=stops, return_routed_experts=True)


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert torch.equal(g.routed_experts, w.routed_experts)


@needs_gpu
def test_graph_decode_equals_eager():
    params = mf.init_params(CFG, seed=1, device="cuda")
    eager = _run(_engine(params, False))
    # stop tokens end three sequences early, so the batch shrinks 5 -> 2 while decoding: graphs of
    # 8, 4 and 2 sequences, the first two padded
    stops = (eager[0].tokens[4], eager[2].tokens[11], eager[3].tokens[25])
    want = _run(_engine(params, False), stops)
    assert len({len(o.tokens) for o in want}) >= 3
    engine = _engine(params, True)
    _assert_same(_run(engine, stops), want)
    st = dict(engine.graphs.stats)
    assert st["captures"] >= 4 and st["replays"] > 3 * st["captures"], st
    again = _run(engine, stops)  # replayed, no new captures, and bit for bit the same
    assert [(o.tokens, o.logprobs) for o in again] == [(o.tokens, o.logprobs) for o in _run(engine, stops)]
    _assert_same(again, want)
    assert engine.graphs.stats["captures"] == st["captures"]


@needs_gpu
def test_overlapped_graph_decode_equals_step_by_step():
    """EngineConfig.overlap on CUDA: decode steps replayed from graphs and fed the last step's
    tokens on the device, before the host has read them, give the step-by-step engine's tokens,
    log-probs and routed experts, greedy and sampled, with stop tokens ending requests early."""
    params = mf.init_params(CFG, seed=1, device="cuda")

    def engine(overlap: bool):
        return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=2048, page_size=4, chunk_size=64, overlap=overlap))

    plain = _run(engine(False))
    stops = (plain[0].tokens[4], plain[2].tokens[11], plain[3].tokens[25])
    _assert_same(_run(engine(True), stops), _run(engine(False), stops))
    sp = mf.SamplingParams(temperature=1.0, top_p=0.9, seed=2)
    got, want = (engine(on).generate(PROMPTS, 40, sampling=sp, stop_token_ids=stops, return_logprobs=True,
                                     return_routed_experts=True) for on in (True, False))
    _assert_same(got, want)


class FixedDrafts:
    """k drafts every step (a uniform verify step, which graphs replay), deterministic, mostly wrong."""

    def propose(self, rid, tokens, k):
        return [(tokens[-1] * 31 + i) % CFG.vocab_size for i in range(k)]


@needs_gpu
def test_graph_decode_equals_eager_fp8():
    """FP8 block weights: the activation quantiser, the FP8 linears and the FP8 MoE in graphs.
    Four sequences, a bucket size: no padding rows, so the FP8 GEMMs see the eager row count."""
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128)
    params = quantize_params(cfg, mf.init_params(cfg, seed=1, device="cuda"))

    def run(graphs):
        engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=2048, page_size=4, chunk_size=64,
                                                        cuda_graphs=graphs))
        return engine, engine.generate(PROMPTS[:4], 24, return_logprobs=True)

    (_, want), (engine, got) = run(False), run(True)
    assert engine.graphs.stats["captures"] > 0 and not engine.graphs.failed
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


@needs_gpu
def test_graph_verify_steps_equal_eager():
    params = mf.init_params(CFG, seed=1, device="cuda")

    def spec_engine(graphs):
        return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=2048, page_size=4, chunk_size=64, cuda_graphs=graphs,
                                                      num_draft_tokens=3, proposer=FixedDrafts()))

    want = _run(spec_engine(False))
    engine = spec_engine(True)
    _assert_same(_run(engine), want)
    assert engine.graphs.stats["captures"] >= 2 and engine.spec_stats()["steps"] > 0


@needs_gpu
def test_graphs_follow_weight_sync_and_memory_release(tmp_path):
    params = mf.init_params(CFG, seed=1, device="cuda")
    engine = _engine(params, True)
    _run(engine)
    mf.save_checkpoint(mf.init_params(CFG, seed=2), CFG, tmp_path / "new")
    engine.update_weights(load_file(tmp_path / "new" / "model.safetensors").items())  # in place: graphs stay
    assert len(engine.graphs) > 0
    _, new_params = mf.load_checkpoint(tmp_path / "new", dtype=torch.float32, device="cuda", progress=False)
    want = _run(_engine(new_params, False))
    _assert_same(_run(engine), want)
    captures = engine.graphs.stats["captures"]
    assert engine.release_memory(backup=True) > 0
    assert len(engine.graphs) == 0  # they hold the old addresses
    engine.resume_memory()
    _assert_same(_run(engine), want)  # captured again at the new addresses
    assert engine.graphs.stats["captures"] > captures


@needs_gpu
def test_uncapturable_forward_falls_back_to_eager(monkeypatch):
    """The reference attention reads lengths on the host, which a capture forbids: a warning,
    then eager steps with the eager engine's results."""
    from mimo_fn import options

    monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, attention_ref=True))
    params = mf.init_params(CFG, seed=1, device="cuda")
    want = _run(_engine(params, False))
    engine = _engine(params, True)
    with pytest.warns(RuntimeWarning, match="capturing a step failed .* steps run eagerly"):
        got = _run(engine)
    _assert_same(got, want)
    assert engine.graphs.failed and engine.graphs.stats == {"captures": 0, "replays": 0}


@needs_gpu
def test_a_capture_survives_garbage_graphs():
    """A graph that becomes unreachable in a reference cycle (as a dropped engine's graphs do)
    while another is captured stays until a collection after the capture: destroying a graph
    inside a capture fails and invalidates it. Here the cycle forms inside the captured
    function, and its allocations pass the collection threshold (1) many times over."""
    dev = torch.device("cuda")
    x_N = torch.randn(64, device=dev)
    old = [graphs_mod.capture(lambda: x_N * 2, dev, None)[0]]

    class Holder:
        pass

    def fn():
        h = Holder()
        h.me, h.graph = h, old.pop()  # now only the cycle holds the old graph
        del h
        junk = [[i] for i in range(1000)]
        return x_N * 3 + len(junk)

    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph, out_N = graphs_mod.capture(fn, dev, None)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()  # the old graph goes now, outside any capture
    x_N.copy_(torch.randn(64, device=dev))
    graph.replay()
    torch.testing.assert_close(out_N, x_N * 3 + 1000)


def test_static_inputs_pad_with_sequence_zero():
    """A graph's inputs for 3 sequences of Q = 2 tokens in a bucket of 4: the step's rows, then
    a copy of sequence 0's; tables padded with -1 to the graph's width, then sequence 0's row."""
    params = mf.init_params(CFG, seed=1)
    state = mf.init_state(CFG, params, 512, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([4, 5, 6], [[1] * 9, [2] * 3, [3] * 14]))
    batch = mf.Batch.from_tokens([4, 5, 6], [[7, 8], [9, 10], [11, 12]])
    cache, seqs = extend(state.cache, dict(state.seqs), dict(zip(batch.seq_ids, batch.lens)))
    meta = step_meta(batch, dict(state.seqs), seqs, cache, torch.device("cpu"))
    graphs = DecodeGraphs()
    padded, width = graphs_mod.batch_bucket(3), 16
    assert padded == 4

    def buf(name, shape, dtype):
        return graphs._buffer(name, shape, dtype, "cpu").fill_(-7)  # poisoned: load writes every element

    static = StepMeta(buf("pos", (8,), torch.long), meta.cu_q_B1, buf("kv", (4,), torch.int32),
                      buf("ft", (4, width), torch.int32), buf("st", (4, width), torch.int32),
                      buf("fs", (8,), torch.long), buf("ss", (8,), torch.long), 2)
    g = graphs_mod._Graph(None, 2, buf("tok", (8,), torch.long), static, None)
    g.load(batch, meta)
    assert g.tokens_T.tolist() == [7, 8, 9, 10, 11, 12, 7, 8]
    w = meta.full_table_BL.shape[1]
    for got, want in ((static.pos_T, meta.pos_T), (static.full_slot_T, meta.full_slot_T),
                      (static.swa_slot_T, meta.swa_slot_T)):
        assert torch.equal(got, torch.cat([want, want[:2]]))
    assert torch.equal(static.kv_lens_B, torch.cat([meta.kv_lens_B, meta.kv_lens_B[:1]]))
    for got, want in ((static.full_table_BL, meta.full_table_BL), (static.swa_table_BL, meta.swa_table_BL)):
        full = torch.cat([want, torch.full((3, width - w), -1, dtype=torch.int32)], dim=1)
        assert torch.equal(got, torch.cat([full, full[:1]]))


def test_batch_buckets():
    """Every batch size pads to a bucket at least as large, by fewer than 8 sequences up to 256
    and fewer than 32 past it, and a rollout shrinking from 1024 sequences to 1 needs few shapes."""
    buckets = [graphs_mod.batch_bucket(n) for n in range(1, 1025)]
    assert all(0 <= b - n < (8 if n <= 256 else 32) for n, b in enumerate(buckets, 1))
    assert buckets[:9] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [graphs_mod.batch_bucket(n) for n in (256, 257, 288, 289, 1000)] == [256, 288, 288, 320, 1024]
    assert len(set(buckets)) == 3 + 32 + 24


def test_graphs_are_dropped_for_another_state():
    """Graphs captured against one state's weights and pools are never replayed on another's."""
    params = mf.init_params(CFG, seed=1)
    a, b = (mf.init_state(CFG, params, 64, page_size=4) for _ in range(2))
    graphs = DecodeGraphs()
    graphs.bind(a, a.cache)
    graphs._graphs["stand-in"] = object()
    graphs.bind(a, a.cache)  # the same state: kept
    assert len(graphs) == 1
    graphs.bind(b, b.cache)  # other KV pools: dropped
    assert len(graphs) == 0
    graphs._graphs["stand-in"] = object()
    graphs.bind(mf.init_state(CFG, mf.init_params(CFG, seed=2), 64, page_size=4), b.cache)  # other weights
    assert len(graphs) == 0
    graphs.bind(b, b.cache)
    graphs._graphs["stand-in"] = object()
    b.cache.full.k[0].untyped_storage().resize_(0)  # released and resumed: maybe at another address
    b.cache.full.k[0].untyped_storage().resize_(b.cache.full.k[0].numel() * b.cache.full.k[0].element_size())
    graphs.bind(b, b.cache)
    assert len(graphs) == 0 or b.cache.full.k[0].data_ptr() == graphs._bound[1][1]


def test_cpu_engine_runs_eagerly():
    params = mf.init_params(CFG, seed=1)
    engine = _engine(params, True)
    engine.generate(PROMPTS[:2], 3)
    assert engine.graphs.stats == {"captures": 0, "replays": 0}
