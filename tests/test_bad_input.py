"""Bad input from issue 44's table: each gets a ValueError naming what was wrong, and leaves
every other piece of state as it was."""

import pytest
import torch

import mimo_fn as mf


@pytest.fixture(scope="module")
def tiny():
    cfg = mf.ModelConfig.tiny()
    return cfg, mf.init_params(cfg, seed=0)


def test_release_repeated_id_keeps_state(tiny):
    cfg, params = tiny
    state = mf.init_state(cfg, params, max_tokens=64, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0, 1], [[1, 2, 3], [4, 5]]))
    free_before = (len(state.cache.full.free), len(state.cache.swa.free))
    with pytest.raises(ValueError, match=r"release: sequence ids \[0\] repeat"):
        mf.release(state, [0, 0])
    # the state was not donated: it still works, and nothing was freed
    assert (len(state.cache.full.free), len(state.cache.swa.free)) == free_before
    state = mf.release(state, [0])
    state, out = mf.decode(state, mf.Batch.from_tokens([1], [[6]]))
    ref = mf.forward(params, cfg, torch.tensor([4, 5, 6]))[-1]
    torch.testing.assert_close(out.logits_BV[0], ref, atol=1e-4, rtol=1e-4)


def test_batch_built_directly_with_repeated_id():
    with pytest.raises(ValueError, match="repeat an id"):
        mf.Batch((0, 0), torch.tensor([1, 2]), (1, 1))


@pytest.mark.parametrize("key", ["sliding_window", "vocab_size", "hidden_size", "n_routed_experts", "layer_types",
                                 "num_hidden_layers", "head_dim", "num_experts_per_tok"])
def test_config_without_a_shaping_field(key):
    hf = mf.ModelConfig.tiny().to_hf()
    assert mf.ModelConfig.from_hf(dict(hf)) == mf.ModelConfig.tiny()
    del hf[key]
    with pytest.raises(ValueError, match=f"config.json has no '{key}'"):
        mf.ModelConfig.from_hf(hf)


def test_config_defaults_are_transformers():
    """Fields left out take transformers' MiMoV2FlashConfig defaults, not the released model's."""
    from transformers import MiMoV2FlashConfig

    hf = mf.ModelConfig.tiny().to_hf()
    del hf["max_position_embeddings"], hf["rms_norm_eps"], hf["n_group"], hf["topk_group"]
    cfg = mf.ModelConfig.from_hf(hf)
    ref = MiMoV2FlashConfig()
    assert cfg.max_position_embeddings == ref.max_position_embeddings
    assert (cfg.rms_norm_eps, cfg.n_group, cfg.topk_group) == (ref.rms_norm_eps, ref.n_group, ref.topk_group)


def test_config_layer_types_as_string():
    hf = mf.ModelConfig.tiny().to_hf()
    hf["layer_types"] = "full_attention"
    with pytest.raises(ValueError, match=r"'layer_types' = 'full_attention': expected a list"):
        mf.ModelConfig.from_hf(hf)


def test_prompt_past_max_position_embeddings():
    cfg = mf.ModelConfig.tiny(max_position_embeddings=12)
    params = mf.init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="forward: 13 tokens, past max_position_embeddings = 12"):
        mf.forward(params, cfg, torch.arange(13) % cfg.vocab_size)
    state = mf.init_state(cfg, params, max_tokens=64, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [list(range(10))]))
    with pytest.raises(ValueError, match=r"prefill: sequence 0 would reach 13 tokens \(10 in cache \+ 3 new\), "
                                         "past max_position_embeddings = 12"):
        mf.prefill(state, mf.Batch.from_tokens([0], [[1, 2, 3]]))
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [[1]]))  # the state is still whole
    state, _ = mf.decode(state, mf.Batch.from_tokens([0], [[4]]))
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64, page_size=4))
    with pytest.raises(ValueError, match=r"generate: prompt 1 \(10 tokens\) \+ max_new_tokens \(3\) = 13 tokens, "
                                         "past the model's max_position_embeddings = 12"):
        engine.generate([[1, 2], list(range(10))], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"add_request: prompt \(12 tokens\) \+ max_new_tokens \(1\)"):
        engine.add_request(list(range(12)), max_new_tokens=1)
    assert not engine.has_unfinished()
    assert len(engine.generate([list(range(10))], max_new_tokens=2)[0].tokens) == 2


def test_generate_over_capacity_names_the_prompt(tiny):
    cfg, params = tiny
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64, page_size=4, chunk_size=8))
    with pytest.raises(ValueError) as e:
        engine.generate([[1, 2, 3], list(range(1, 60))], max_new_tokens=10)
    assert str(e.value) == ("generate: prompt 1: 59 prompt tokens + max_new_tokens 10 = 69 tokens exceeds the KV "
                            "capacity of 64 tokens (pages of 4 tokens) (EngineConfig.max_tokens = 64)")
    with pytest.raises(ValueError, match=r"^add_request: prompt: 60 prompt tokens \+ max_new_tokens 5 = 65 tokens "):
        engine.add_request(list(range(1, 61)), max_new_tokens=5)
    assert not engine.has_unfinished()
    assert len(engine.state.cache.full.free) == engine.state.cache.full.num_pages


@pytest.mark.parametrize("tokens, shown", [(torch.tensor([[1, 2, 3]]), r"a torch.int64 tensor of shape \(1, 3\)"),
                                           (torch.tensor([1.0, 2.0]), r"a torch.float32 tensor of shape \(2,\)"),
                                           (torch.tensor([True, False]), "a torch.bool tensor"),
                                           ([1, 2, 3], "a list")])
def test_forward_wants_1d_integer_tokens(tiny, tokens, shown):
    cfg, params = tiny
    with pytest.raises(ValueError, match=f"forward: tokens is {shown}.*; expected a 1-D integer tensor"):
        mf.forward(params, cfg, tokens)


def test_stop_token_ids_outside_the_vocabulary(tiny):
    cfg, params = tiny
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=64, page_size=4, chunk_size=8))
    for stops in ([cfg.vocab_size], [3, -1], cfg.vocab_size + 5):
        bad = stops if isinstance(stops, int) else stops[-1]
        with pytest.raises(ValueError, match=rf"generate: stop_token_ids holds {bad}, outside the vocabulary "
                                             rf"\[0, {cfg.vocab_size}\)"):
            engine.generate([[1, 2]], max_new_tokens=2, stop_token_ids=stops)
        with pytest.raises(ValueError, match=rf"add_request: stop_token_ids holds {bad}"):
            engine.add_request([1, 2], max_new_tokens=2, stop_token_ids=stops)
    assert not engine.has_unfinished()
    assert len(engine.generate([[1, 2]], max_new_tokens=2, stop_token_ids=[cfg.vocab_size - 1])[0].tokens) >= 1
