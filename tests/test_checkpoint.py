"""Checkpoint loading/saving: hub layout, sharded files, MTP skip, malformed input, config keys."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from hf_ref import random_hf_model
from mimo_fn.config import FULL, SWA
from mimo_fn.params import quantize_params, to_flat
from mimo_fn.quant import QTensor


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = mf.ModelConfig.tiny(n_group=1, topk_group=1)
    params = mf.init_params(cfg, seed=7)
    d = tmp_path_factory.mktemp("ckpt")
    mf.save_checkpoint(params, cfg, d)
    return cfg, params, d


def test_round_trip_and_transformers_loads_ours(saved):
    from transformers import MiMoV2FlashForCausalLM

    cfg, params, d = saved
    cfg2, params2 = mf.load_checkpoint(d, dtype=torch.float32)
    assert cfg2 == cfg
    tokens = torch.randint(0, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    ours = mf.forward(params2, cfg2, tokens)
    assert torch.equal(ours, mf.forward(params, cfg, tokens))
    model = MiMoV2FlashForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens[None]).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    _, named = mf.load_checkpoint(d, dtype="float32", progress=False)  # the dtype's name works too
    assert torch.equal(mf.forward(named, cfg, tokens), ours)
    with pytest.raises(ValueError, match=r"load_checkpoint: dtype = 'auto'; expected one of"):
        mf.load_checkpoint(d, dtype="auto")  # a TypeError from torch before


def test_sharded_with_index_and_mtp_skipped(saved, tmp_path, caplog):
    cfg, params, _ = saved
    mf.save_checkpoint(params, cfg, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    save_file({"model.mtp.layers.0.weight": torch.randn(3)}, tmp_path / "mtp.safetensors")
    index["weight_map"]["model.mtp.layers.0.weight"] = "mtp.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="mimo_fn"):
        cfg2, params2 = mf.load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    assert "skipped 1 multi-token-prediction" in caplog.text
    assert torch.equal(params2.layers[2].mlp.w13, params.layers[2].mlp.w13)


def test_fused_qkv_layout(saved, tmp_path):
    """save_checkpoint(fused_qkv=True) writes each layer's q, k and v rows as one qkv_proj; it
    loads to the same weights, bf16 and FP8 (q and k rows in whole 128-row blocks here)."""
    cfg, params, _ = saved
    mf.save_checkpoint(params, cfg, tmp_path / "bf16", fused_qkv=True)
    keys = load_file(tmp_path / "bf16" / "model.safetensors").keys()
    assert "model.layers.1.self_attn.qkv_proj.weight" in keys and not any("q_proj" in k for k in keys)
    _, got = mf.load_checkpoint(tmp_path / "bf16", dtype=torch.float32, progress=False)
    for name, w in to_flat(params).items():
        assert torch.equal(to_flat(got)[name], w), name

    cfg = mf.ModelConfig.tiny(hidden_size=128, num_heads=2, num_kv_heads=1, num_swa_kv_heads=2, head_dim=128,
                              v_head_dim=64, intermediate_size=128, moe_intermediate_size=128)
    fp8 = quantize_params(cfg, mf.init_params(cfg, seed=2))
    mf.save_checkpoint(fp8, cfg, tmp_path / "fp8", fused_qkv=True)
    _, got = mf.load_checkpoint(tmp_path / "fp8", dtype=torch.float32, progress=False)
    for name, w in to_flat(fp8).items():
        g = to_flat(got)[name]
        assert isinstance(g, QTensor) == isinstance(w, QTensor), name
        assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)) if isinstance(w, QTensor) \
            else torch.equal(g, w), name
        if isinstance(w, QTensor):
            assert torch.equal(g.scale, w.scale), name
    odd = mf.ModelConfig.tiny(hidden_size=128, intermediate_size=128, moe_intermediate_size=128)  # 96-row q
    with pytest.raises(ValueError, match=r"FP8 q/k projections of layer 0 have \[96, 24\] rows"):
        mf.save_checkpoint(quantize_params(odd, mf.init_params(odd)), odd, tmp_path / "odd", fused_qkv=True)


def test_fused_and_split_qkv_in_one_layer(saved, tmp_path):
    _, _, d = saved
    _tamper(d, tmp_path / "both", lambda t: t.update(
        {"model.layers.2.self_attn.qkv_proj.weight": torch.cat([t[f"model.layers.2.self_attn.{k}_proj.weight"]
                                                                for k in "qkv"])}))
    with pytest.raises(ValueError, match=r"holds both 'model.layers.2.self_attn.qkv_proj.weight' and "
                                         r"'model.layers.2.self_attn.q_proj.weight'"):
        mf.load_checkpoint(tmp_path / "both", dtype=torch.float32)


def _tamper(src, dst, fn):
    tensors = load_file(src / "model.safetensors")
    fn(tensors)
    dst.mkdir(exist_ok=True)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("case, edit, message", [
    ("missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     r"missing tensor 'model.layers.1.self_attn.k_proj.weight' \(expected shape \[48, 64\]\)"),
    ("shape", lambda t: t.update({"model.layers.2.mlp.experts.3.up_proj.weight": torch.randn(31, 64)}),
     r"'model.layers.2.mlp.experts.3.up_proj.weight' has shape \[31, 64\], expected \[32, 64\]"),
    ("unknown", lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.randn(4)}),
     r"does not use, e.g. \['model.layers.0.self_attn.q_norm.weight'\]"),
])
def test_malformed_checkpoint(saved, tmp_path, case, edit, message):
    _, _, d = saved
    _tamper(d, tmp_path / case, edit)
    with pytest.raises(ValueError, match=message):
        mf.load_checkpoint(tmp_path / case, dtype=torch.float32)


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, r"'num_kv_heads' = 3: expected a divisor of num_heads=4"),
    ("sliding_window", 0, r"'sliding_window' = 0: expected a positive int"),
    ("topk_group", 5, r"'topk_group' = 5: expected in \[1, n_group=2\]"),
    ("layer_types", ["full_attention"], r"'layer_types' = \('full_attention',\): expected 4 entries"),
])
def test_bad_config_value(saved, tmp_path, field, value, message):
    _, _, d = saved
    hf = json.loads((d / "config.json").read_text())
    hf[field] = value
    if field == "topk_group":
        hf["n_group"] = 2
    with pytest.raises(ValueError, match=message):
        mf.ModelConfig.from_hf(hf)


def test_released_config_keys():
    """The originally released config.json names (hybrid pattern, swa_* keys, null scaling)."""
    released = {
        "vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
        "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
        "hybrid_layer_pattern": [0] + [0 if (i + 1) % 6 == 0 else 1 for i in range(1, 48)],
        "moe_layer_freq": [0] + [1] * 47, "sliding_window_size": 128, "sliding_window": None,
        "rope_theta": 5000000, "swa_rope_theta": 10000, "partial_rotary_factor": 0.334,
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.707, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "routed_scaling_factor": None, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "layernorm_epsilon": 1e-5,
        "tie_word_embeddings": False,
    }
    assert mf.ModelConfig.from_hf(released) == mf.ModelConfig.flash()
    hf = random_hf_model(num_hidden_layers=48, hidden_size=32, intermediate_size=16).config.to_dict()
    cfg = mf.ModelConfig.from_hf(hf)
    assert cfg.layer_types == mf.ModelConfig.flash().layer_types and cfg.num_swa_kv_heads == 2
    first6 = mf.ModelConfig.flash(num_layers=6)  # the released model's first six layers: the benchmarks' slice
    assert first6.layer_types == mf.ModelConfig.flash().layer_types[:6] == (FULL,) + (SWA,) * 4 + (FULL,)
    assert first6.mlp_types == mf.ModelConfig.flash().mlp_types[:6] and first6.hidden_size == 4096
