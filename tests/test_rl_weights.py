"""In-place weight sync: new weights land in the same storage and the model computes with them."""

import pytest
import torch
from safetensors.torch import load_file

import mimo_fn as mf
from mimo_fn.params import from_flat, quantize_params, to_flat
from mimo_fn.quant import MXFP4, QTensor, quantize_mxfp4
from mimo_fn.rl.weights import hub_names, hub_tensors, update_weights


def _ptrs(params):
    return {k: (v.data.data_ptr(), v.scale.data_ptr()) if isinstance(v, QTensor) else v.data_ptr()
            for k, v in to_flat(params).items()}


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4"])
def test_update_in_place_equals_loading_the_new_weights(tmp_path, fmt):
    """fp8: every GEMM weight FP8 (quantised at load); mxfp4: the RL release's layout, FP8
    attention and dense MLP with MXFP4 experts, loaded as stored and re-quantised in place."""
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128) if fmt == "fp8" \
        else mf.ModelConfig.tiny()
    quant = "fp8" if fmt == "fp8" else "auto"
    old = mf.init_params(cfg, seed=1)
    mf.save_checkpoint(quantize_params(cfg, old, experts="mxfp4") if fmt == "mxfp4" else old, cfg, tmp_path / "old")
    mf.save_checkpoint(mf.init_params(cfg, seed=2), cfg, tmp_path / "new")
    _, params = mf.load_checkpoint(tmp_path / "old", dtype=torch.float32, quant=quant)
    before = _ptrs(params)
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=128, page_size=4))
    new = load_file(tmp_path / "new" / "model.safetensors")
    assert engine.update_weights(new) == len(new)  # a state_dict as it is, or its items()
    assert _ptrs(engine.state.params) == before
    _, want = mf.load_checkpoint(tmp_path / "new", dtype=torch.float32, quant=quant)
    if fmt == "mxfp4":
        dense_w2 = want.layers[3].mlp.w2
        want = quantize_params(cfg, want, experts="mxfp4")
        got_w2 = engine.state.params.layers[3].mlp.w2
        assert got_w2.fmt == MXFP4 and torch.equal(got_w2.data, quantize_mxfp4(dense_w2).data)
        assert torch.equal(got_w2.scale, quantize_mxfp4(dense_w2).scale)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    assert torch.equal(mf.forward(engine.state.params, cfg, tokens), mf.forward(want, cfg, tokens))
    assert engine.generate([tokens.tolist()], 4)[0].tokens == \
        mf.Engine(cfg, want, mf.EngineConfig(max_tokens=128, page_size=4)).generate([tokens.tolist()], 4)[0].tokens


def test_mxfp4_experts_update_per_expert_and_under_ep(tmp_path):
    """One expert projection lands in its rows of the MXFP4 stack (bytes and per-row scales) and
    nowhere else; a wrong shape raises before anything is written; under EP (shard_params splits
    quantised stacks over experts) each rank writes its experts only."""
    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.parallel.sharding import shard_params

    cfg = mf.ModelConfig.tiny()
    base = mf.init_params(cfg, seed=1)
    params = from_flat(cfg, {k: quantize_mxfp4(v) if k.endswith(("mlp.w13", "mlp.w2")) else v
                             for k, v in to_flat(base).items()})
    w13 = params.layers[2].mlp.w13
    data, scale = w13.data.clone(), w13.scale.clone()
    up = torch.randn(32, 64)
    good = ("model.layers.2.mlp.experts.5.up_proj.weight", up)
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.experts.3.gate_proj.weight' has shape \[32, 48\], "
                                         r"expected \[32, 64\]"):
        update_weights(params, cfg, [good, ("model.layers.2.mlp.experts.3.gate_proj.weight", torch.randn(32, 48))])
    assert torch.equal(w13.data, data) and torch.equal(w13.scale, scale)
    ptrs = _ptrs(params)
    assert update_weights(params, cfg, [good]) == 1 and _ptrs(params) == ptrs
    q = quantize_mxfp4(up)
    data[5, 32:], scale[5, 32:] = q.data, q.scale  # up rows follow the 32 gate rows
    assert torch.equal(w13.data, data) and torch.equal(w13.scale, scale)

    new = {f"model.layers.1.mlp.experts.{e}.down_proj.weight": torch.randn(64, 32) for e in range(cfg.num_experts)}
    for rank in range(4):
        mesh = Mesh(2, 2, 4, rank)  # dp 2, tp 2, ep 4: two experts per rank
        local = shard_params(params, cfg, mesh)
        assert local.layers[1].mlp.w2.fmt == MXFP4 and local.layers[1].mlp.w2.data.shape == (2, 64, 16)
        assert update_weights(local, cfg, new, mesh) == 2
        mine = torch.stack([new[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in (2 * rank, 2 * rank + 1)])
        assert torch.equal(local.layers[1].mlp.w2.data, quantize_mxfp4(mine).data)
        assert torch.equal(local.layers[1].mlp.w2.scale, quantize_mxfp4(mine).scale)


def test_bad_update_writes_nothing():
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    wq = params.layers[1].attn.wq.clone()
    good = ("model.layers.1.self_attn.q_proj.weight", torch.randn_like(wq))
    with pytest.raises(ValueError, match=r"unknown weight 'model.layers.1.self_attn.q_norm.weight'"):
        update_weights(params, cfg, [good, ("model.layers.1.self_attn.q_norm.weight", torch.randn(4))])
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.experts.3.up_proj.weight' has shape \[3, 64\], expected \[32, 64\]"):
        update_weights(params, cfg, [good, ("model.layers.2.mlp.experts.3.up_proj.weight", torch.randn(3, 64))])
    experts = cfg.num_experts
    with pytest.raises(ValueError, match=rf"'model.layers.2.mlp.experts.{experts}.up_proj.weight' names expert "
                                         rf"{experts}; the model has {experts}"):
        update_weights(params, cfg, [good, (f"model.layers.2.mlp.experts.{experts}.up_proj.weight",
                                            torch.randn(32, 64))])
    with pytest.raises(ValueError, match=r"unknown weight 'model.layers.2.mlp.experts.3.proj.weight'"):
        update_weights(params, cfg, [good, ("model.layers.2.mlp.experts.3.proj.weight", torch.randn(32, 64))])
    for bad, what in (([good, "model.norm.weight"], "entry 1 is a str"),
                      ([good, ("model.norm.weight", [1.0])], r"entry 1 is a \(str, list\)")):
        with pytest.raises(ValueError, match=f"{what}; expected \\(hub name, tensor\\) pairs, or a dict"):
            update_weights(params, cfg, bad)
    assert torch.equal(params.layers[1].attn.wq, wq)
    assert update_weights(params, cfg, dict([good])) == 1 and torch.equal(params.layers[1].attn.wq, good[1])


def test_hub_names_are_what_each_rank_writes(tmp_path):
    """hub_names(cfg, mesh): all names but other EP ranks' experts; update_weights writes exactly those."""
    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.parallel.sharding import shard_params
    from mimo_fn.rl.weights import hub_names

    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    mf.save_checkpoint(params, cfg, tmp_path / "c")
    new = load_file(tmp_path / "c" / "model.safetensors")
    meshes = [Mesh(2, 2, 2, r) for r in range(4)]  # dp 2, tp 2, ep 2
    names = [hub_names(cfg, m) for m in meshes]
    assert set.union(*names) == set(new) == hub_names(cfg)
    experts = {n for n in new if ".experts." in n}
    assert experts and set.intersection(*names) == set(new) - experts
    assert names[0] == names[2] != names[1] == names[3]  # ep_rank = rank % ep
    for m, mine in zip(meshes, names):
        local = shard_params(params, cfg, m)
        assert update_weights(local, cfg, new.items(), m) == len(mine)


def test_hub_tensors_are_what_save_checkpoint_writes_and_update_weights_takes(tmp_path):
    """A trainer's sync: hub_tensors of its params, as update_weights takes them, make the
    engine's weights the trainer's, bit for bit; the names and tensors are save_checkpoint's."""
    cfg = mf.ModelConfig.tiny()
    trainer = mf.init_params(cfg, seed=3)
    trainer = from_flat(cfg, {k: v.requires_grad_() for k, v in to_flat(trainer).items()})  # as a trainer holds them
    pairs = list(hub_tensors(trainer, cfg))
    assert all(not t.requires_grad for _, t in pairs)
    mf.save_checkpoint(trainer, cfg, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(n for n, _ in pairs) == sorted(saved) and {n for n, _ in pairs} == hub_names(cfg)
    assert all(torch.equal(t, saved[n]) for n, t in pairs)
    engine = mf.init_params(cfg, seed=4)
    assert update_weights(engine, cfg, pairs) == len(pairs)
    for k, v in to_flat(engine).items():
        assert torch.equal(v, to_flat(trainer)[k]), k
    with pytest.raises(ValueError, match=r"hub_tensors: 'layers.0.attn.wq' is a '\w+' QTensor; expected the dense"):
        list(hub_tensors(quantize_params(cfg, trainer), cfg))
