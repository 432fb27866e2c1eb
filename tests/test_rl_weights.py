"""In-place weight sync: new weights land in the same storage and the model computes with them."""

import pytest
import torch
from safetensors.torch import load_file

import mimo_fn as mf
from mimo_fn.params import to_flat
from mimo_fn.quant import QTensor
from mimo_fn.rl.weights import update_weights


def _ptrs(params):
    return {k: (v.data.data_ptr(), v.scale.data_ptr()) if isinstance(v, QTensor) else v.data_ptr()
            for k, v in to_flat(params).items()}


@pytest.mark.parametrize("fp8", [False, True])
def test_update_in_place_equals_loading_the_new_weights(tmp_path, fp8):
    cfg = mf.ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, intermediate_size=128) if fp8 \
        else mf.ModelConfig.tiny()
    quant = "fp8" if fp8 else "auto"
    mf.save_checkpoint(mf.init_params(cfg, seed=1), cfg, tmp_path / "old")
    mf.save_checkpoint(mf.init_params(cfg, seed=2), cfg, tmp_path / "new")
    _, params = mf.load_checkpoint(tmp_path / "old", dtype=torch.float32, quant=quant)
    before = _ptrs(params)
    engine = mf.Engine(cfg, params, mf.EngineConfig(max_tokens=128, page_size=4))
    new = load_file(tmp_path / "new" / "model.safetensors")
    assert engine.update_weights(new) == len(new)  # a state_dict as it is, or its items()
    assert _ptrs(engine.state.params) == before
    _, want = mf.load_checkpoint(tmp_path / "new", dtype=torch.float32, quant=quant)
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    assert torch.equal(mf.forward(engine.state.params, cfg, tokens), mf.forward(want, cfg, tokens))
    assert engine.generate([tokens.tolist()], 4)[0].tokens == \
        mf.Engine(cfg, want, mf.EngineConfig(max_tokens=128, page_size=4)).generate([tokens.tolist()], 4)[0].tokens


def test_bad_update_writes_nothing():
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=1)
    wq = params.layers[1].attn.wq.clone()
    good = ("model.layers.1.self_attn.q_proj.weight", torch.randn_like(wq))
    with pytest.raises(ValueError, match=r"unknown weight 'model.layers.1.self_attn.q_norm.weight'"):
        update_weights(params, cfg, [good, ("model.layers.1.self_attn.q_norm.weight", torch.randn(4))])
    with pytest.raises(ValueError, match=r"'model.layers.2.mlp.experts.3.up_proj.weight' has shape \[3, 64\], expected \[32, 64\]"):
        update_weights(params, cfg, [good, ("model.layers.2.mlp.experts.3.up_proj.weight", torch.randn(3, 64))])
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
