"""forward() against transformers' MiMoV2FlashForCausalLM, through save_pretrained + load_checkpoint."""

import pytest
import torch

import mimo_fn as mf
from hf_ref import random_hf_model

FULL, SWA = "full_attention", "sliding_attention"

CONFIGS = {
    "n_group1": dict(layer_types=[FULL, SWA, SWA, FULL]),
    "grouped_router": dict(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           layer_types=[FULL, SWA, FULL, SWA]),
    "many_full_gqa2": dict(num_hidden_layers=5, num_key_value_heads=2, num_experts_per_tok=3,
                           layer_types=[FULL, FULL, SWA, FULL, SWA], sliding_window=3, n_group=2, topk_group=1),
    "no_norm_topk_wide_window": dict(norm_topk_prob=False, sliding_window=16, head_dim=32, v_head_dim=8,
                                     layer_types=[FULL, SWA, SWA, SWA]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_transformers(name, tmp_path):
    model = random_hf_model(seed=len(name), **CONFIGS[name])
    model.save_pretrained(tmp_path)
    cfg, params = mf.load_checkpoint(tmp_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    window = model.config.sliding_window
    for length in (2, window - 1, 4 * window + 3):  # shorter than and several times the window
        tokens = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
        ours = mf.forward(params, cfg, tokens)
        with torch.no_grad():
            ref = model(tokens[None]).logits[0]
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-4, f"{name} T={length}: relative error {err:.2e}"


def test_init_params_deterministic():
    cfg = mf.ModelConfig.tiny()
    a, b = mf.init_params(cfg, seed=3), mf.init_params(cfg, seed=3)
    c = mf.init_params(cfg, seed=4)
    assert torch.equal(a.layers[1].mlp.w13, b.layers[1].mlp.w13)
    assert not torch.equal(a.layers[1].mlp.w13, c.layers[1].mlp.w13)
    tokens = torch.tensor([1, 5, 7, 2])
    assert torch.equal(mf.forward(a, cfg, tokens), mf.forward(b, cfg, tokens))
    named = mf.init_params(cfg, seed=3, dtype="bfloat16")  # the dtype's name, as transformers takes it
    assert named.layers[1].mlp.w13.dtype == torch.bfloat16
    assert torch.equal(named.layers[1].mlp.w13, mf.init_params(cfg, seed=3, dtype=torch.bfloat16).layers[1].mlp.w13)
    for kw, match in ((dict(dtype="bf16"), r"dtype = 'bf16'; expected one of \['float32', 'bfloat16', 'float16'\]"),
                      (dict(dtype=torch.int32), "dtype = torch.int32; expected one of"),
                      (dict(seed="3"), "seed = '3'; expected an int")):
        with pytest.raises(ValueError, match=f"init_params: {match}"):
            mf.init_params(cfg, **kw)


def test_bad_tokens_raise():
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mf.forward(params, cfg, torch.tensor([1, cfg.vocab_size]))


def test_params_are_pytrees():
    from torch.utils import _pytree as pytree

    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg)
    halved = pytree.tree_map(lambda t: t.to(torch.bfloat16), params)
    assert isinstance(halved, mf.Params) and halved.layers[1].attn.wq.dtype == torch.bfloat16
    assert len(pytree.tree_leaves(params)) == len(mf.params.to_flat(params))


def test_shape_annotations_are_checked():
    """conftest turns on jaxtyping + beartype: a public function called with inconsistent shapes fails."""
    from mimo_fn.layers.norm import rms_norm

    with pytest.raises(Exception, match="H"):
        rms_norm(torch.randn(3, 4), torch.randn(5), 1e-5)
