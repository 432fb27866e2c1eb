"""Checkpoint loading/saving: hub layout, sharded files, MTP skip, malformed input, config keys,
MXFP4 experts."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from hf_ref import random_hf_model
from mimo_fn.config import FULL, SWA
from mimo_fn.params import describe, from_flat, quantize_params, to_flat
from mimo_fn.quant import FP8_BLOCK, MXFP4, QTensor, dequantize, quantize_mxfp4


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
    tiny = mf.ModelConfig.tiny()  # MXFP4 q/k/v: per-row scales, so any row counts fuse
    infos = describe(tiny)
    mx = from_flat(tiny, {k: quantize_mxfp4(v) if infos[k].quantizable else v
                          for k, v in to_flat(mf.init_params(tiny, seed=3)).items()})
    mf.save_checkpoint(mx, tiny, tmp_path / "mxfp4", fused_qkv=True)
    assert "model.layers.1.self_attn.qkv_proj.weight_scale" in load_file(tmp_path / "mxfp4" / "model.safetensors")
    assert_same_weights(mf.load_checkpoint(tmp_path / "mxfp4", dtype=torch.float32, progress=False)[1], mx)
    odd = mf.ModelConfig.tiny(hidden_size=128, intermediate_size=128, moe_intermediate_size=128)  # 96-row q
    with pytest.raises(ValueError, match=r"FP8 q/k/v projections of layer 0 have \[96, 24, 16\] rows per checkpoint shard \(1 shard\)"):
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
        "tie_word_embeddings": False, "max_position_embeddings": 262144,
    }
    assert mf.ModelConfig.from_hf(released) == mf.ModelConfig.flash()
    hf = random_hf_model(num_hidden_layers=48, hidden_size=32, intermediate_size=16).config.to_dict()
    cfg = mf.ModelConfig.from_hf(hf)
    assert cfg.layer_types == mf.ModelConfig.flash().layer_types and cfg.num_swa_kv_heads == 2
    first6 = mf.ModelConfig.flash(num_layers=6)  # the released model's first six layers: the benchmarks' slice
    assert first6.layer_types == mf.ModelConfig.flash().layer_types[:6] == (FULL,) + (SWA,) * 4 + (FULL,)
    assert first6.mlp_types == mf.ModelConfig.flash().mlp_types[:6] and first6.hidden_size == 4096


# ---------------------------------------------------------------------------------------------
# MXFP4 experts (the RL release): `weight` uint8 [N, K/2] + `weight_scale` uint8 [N, K/32]
# ---------------------------------------------------------------------------------------------

E3 = "model.layers.2.mlp.experts.3."  # one expert's hub prefix (tiny: gate/up [32, 64], down [64, 32])


def mxfp4_experts(cfg, params):
    """The routed expert stacks as MXFP4, every other weight as it is (a bf16 + MXFP4 model)."""
    return from_flat(cfg, {k: quantize_mxfp4(v) if k.endswith(("mlp.w13", "mlp.w2")) else v
                           for k, v in to_flat(params).items()})


def assert_same_weights(got, want):
    """Bit-identical params: same kinds, formats, bytes and scales."""
    got, want = to_flat(got), to_flat(want)
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert isinstance(g, QTensor) == isinstance(w, QTensor), name
        if isinstance(w, QTensor):
            assert g.fmt == w.fmt and g.data.dtype == w.data.dtype and g.scale.dtype == w.scale.dtype, name
            assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)), name
            assert torch.equal(g.scale, w.scale), name
        else:
            assert torch.equal(g, w), name


@pytest.fixture(scope="module")
def mxfp4_saved(tmp_path_factory):
    """tiny (hidden 64, expert intermediate 32: multiples of the 32-wide groups) with MXFP4 experts."""
    cfg = mf.ModelConfig.tiny(n_group=1, topk_group=1)
    params = mxfp4_experts(cfg, mf.init_params(cfg, seed=11))
    d = tmp_path_factory.mktemp("mxfp4")
    mf.save_checkpoint(params, cfg, d)
    return cfg, params, d


@pytest.mark.parametrize("attention", ["dense", "fp8"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "index"])
def test_mxfp4_round_trip(tmp_path, attention, sharded):
    """save -> load gives bit-identical MXFP4 experts, next to dense or FP8 attention / dense MLP;
    the experts are written as the RL release stores them."""
    cfg = mf.ModelConfig.tiny()
    base = mf.init_params(cfg, seed=12)
    params = quantize_params(cfg, base, experts="mxfp4") if attention == "fp8" else mxfp4_experts(cfg, base)
    assert isinstance(params.layers[1].mlp.w13, QTensor) and params.layers[1].mlp.w13.fmt == MXFP4
    mf.save_checkpoint(params, cfg, tmp_path, max_shard_bytes=20_000 if sharded else None)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == ("fp8" if attention == "fp8" else "mxfp4")
    tensors = {}
    for f in tmp_path.glob("*.safetensors"):
        tensors.update(load_file(f))
    e = "model.layers.2.mlp.experts.5."
    shapes = {k: (tensors[e + k].dtype, tuple(tensors[e + k].shape)) for k in (
        "up_proj.weight", "up_proj.weight_scale", "down_proj.weight", "down_proj.weight_scale")}
    assert shapes == {"up_proj.weight": (torch.uint8, (32, 32)), "up_proj.weight_scale": (torch.uint8, (32, 2)),
                      "down_proj.weight": (torch.uint8, (64, 16)), "down_proj.weight_scale": (torch.uint8, (64, 1))}
    assert not any(k.startswith(e) and k.endswith("_scale_inv") for k in tensors)
    want = quantize_mxfp4(base.layers[2].mlp.w13[5, 32:])  # gate rows then up rows: up is rows 32..63
    assert torch.equal(tensors[e + "up_proj.weight"], want.data)
    assert torch.equal(tensors[e + "up_proj.weight_scale"], want.scale)
    cfg2, got = mf.load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    assert cfg2 == cfg
    assert_same_weights(got, params)


@pytest.mark.parametrize("data_dtype, scale_dtype", [
    ("uint8", "uint8"), ("int8", "float8_e8m0fnu"), ("float4_e2m1fn_x2", "float8_e8m0fnu"),
])
def test_hand_written_mxfp4_checkpoint(mxfp4_saved, tmp_path, data_dtype, scale_dtype):
    """Expert bytes stored as int8 / float4_e2m1fn_x2 and scales as float8_e8m0fnu (the dtypes other
    writers use; safetensors names float4_e2m1fn_x2 "F4" and counts its elements) load as the same
    uint8 QTensors; a gpt-oss style quantization_config {"quant_method": "mxfp4"} is accepted."""
    if not hasattr(torch, data_dtype) or not hasattr(torch, scale_dtype):
        pytest.skip(f"this torch has no {data_dtype} / {scale_dtype}")
    cfg, params, d = mxfp4_saved
    tensors = load_file(d / "model.safetensors")
    for k in [k for k in tensors if k.endswith("_scale")]:
        weight = k.removesuffix("_scale")
        tensors[weight] = tensors[weight].view(getattr(torch, data_dtype))
        tensors[k] = tensors[k].view(getattr(torch, scale_dtype))
    (tmp_path / "c").mkdir()
    save_file(tensors, tmp_path / "c" / "model.safetensors")
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "c" / "config.json").write_text(json.dumps(hf))
    _, got = mf.load_checkpoint(tmp_path / "c", dtype=torch.float32, progress=False)
    assert_same_weights(got, params)


def _dense_expert(tensors, prefix):
    """One expert of an MXFP4 layer stored dense (fp32, no scales)."""
    for proj, shape in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32))):
        tensors.pop(f"{prefix}{proj}_proj.weight_scale")
        tensors[f"{prefix}{proj}_proj.weight"] = torch.randn(shape)


@pytest.mark.parametrize("case, edit, message", [
    ("scale_shape", lambda t: t.update({E3 + "up_proj.weight_scale": torch.zeros(32, 3, dtype=torch.uint8)}),
     rf"'{E3}up_proj.weight_scale' has shape \[32, 3\], expected \[32, 2\]"),
    ("data_shape", lambda t: t.update({E3 + "down_proj.weight": torch.zeros(64, 32, dtype=torch.uint8)}),
     rf"'{E3}down_proj.weight' has shape \[64, 32\], expected \[64, 16\]"),
    ("data_dtype", lambda t: t.update({E3 + "gate_proj.weight": torch.zeros(32, 32)}),
     rf"'{E3}gate_proj.weight' is part of an MXFP4 weight .* has dtype F32; expected one of \['U8', 'I8', 'F4'\]"),
    ("scale_dtype", lambda t: t.update({E3 + "gate_proj.weight_scale": torch.zeros(32, 2)}),
     rf"'{E3}gate_proj.weight_scale' is part of an MXFP4 weight .* has dtype F32; expected one of \['U8', 'F8_E8M0'\]"),
    ("two_scales", lambda t: t.update({E3 + "gate_proj.weight_scale_inv": torch.ones(1, 1)}),
     rf"'{E3}gate_proj.weight' has both '{E3}gate_proj.weight_scale_inv' \(FP8\) and"),
    ("mixed", lambda t: (t.pop(E3 + "up_proj.weight_scale"), t.update({E3 + "up_proj.weight": torch.randn(32, 64)})),
     rf"\['{E3}gate_proj.weight', '{E3}up_proj.weight'\] are stored as \['mxfp4', 'dense'\]"),
    ("mixed_experts", lambda t: _dense_expert(t, E3),
     rf"expert '{E3}gate_proj.weight' is stored as dense, expert 0's as mxfp4"),
])
def test_malformed_mxfp4_checkpoint(mxfp4_saved, tmp_path, case, edit, message):
    _, _, d = mxfp4_saved
    _tamper(d, tmp_path / case, edit)
    with pytest.raises(ValueError, match=message):
        mf.load_checkpoint(tmp_path / case, dtype=torch.float32, progress=False)


def test_mxfp4_dequantize_and_fp8_modes(mxfp4_saved):
    """quant="dequantize" gives `dequantize` of the MXFP4 QTensors in `dtype`; quant="fp8" keeps
    the MXFP4 experts as they are and quantises the dense GEMM weights to FP8 blocks."""
    cfg, params, d = mxfp4_saved
    for dtype in (torch.float32, torch.bfloat16):
        _, dq = mf.load_checkpoint(d, dtype=dtype, quant="dequantize", progress=False)
        for name, w in to_flat(params).items():
            g = to_flat(dq)[name]
            assert isinstance(g, torch.Tensor) and (not isinstance(w, QTensor) or g.dtype == dtype), name
            if isinstance(w, QTensor):
                assert torch.equal(g, dequantize(w, dtype)), name
    _, q = mf.load_checkpoint(d, dtype=torch.float32, quant="fp8", progress=False)
    assert_same_weights(q, quantize_params(cfg, params))  # experts kept as MXFP4, the rest FP8 as quantize_params
    assert q.layers[1].mlp.w2.fmt == MXFP4 and q.layers[1].attn.wq.fmt == FP8_BLOCK


@pytest.mark.parametrize("damage, what", [("truncate", "incomplete metadata"), ("garbage", "header")])
def test_corrupt_safetensors_names_the_file(saved, tmp_path, damage, what):
    _, _, d = saved
    for f in d.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            data = data[:len(data) // 2] if damage == "truncate" else b"not a safetensors file" * 4
        (tmp_path / f.name).write_bytes(data)
    name = next(f.name for f in d.iterdir() if f.suffix == ".safetensors")
    with pytest.raises(ValueError, match=rf"checkpoint file '.*{name}' is not a valid safetensors file.*{what}"):
        mf.load_checkpoint(tmp_path, dtype=torch.float32)
