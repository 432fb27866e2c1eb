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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_fused_residual_adds_keep_the_bits(dtype):
    """decoder_layer adds its residuals inside other passes (add_rms_norm; the experts' sum over k
    through moe's residual_TH): every layer's output has the bits of the unfused steps."""
    from mimo_fn.layers.attention import attend_dense, project_out, project_qkv
    from mimo_fn.layers.mlp import dense_mlp
    from mimo_fn.layers.moe import moe
    from mimo_fn.layers.norm import rms_norm
    from mimo_fn.model import decoder_layer
    from mimo_fn.params import DenseMLP

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the fused kernels against the steps
    cfg = mf.ModelConfig.tiny()
    params = mf.init_params(cfg, seed=5, dtype=dtype, device=dev)
    tokens_T = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(2)).to(dev)
    pos_T = torch.arange(13, device=dev)

    def attn_fn(i, q_TND, k_TGD, v_TGE):
        return attend_dense(q_TND, k_TGD, v_TGE, pos_T, cfg, i, params.layers[i].attn.sinks)

    def unfused(x_TH, layer, i):
        h_TH = rms_norm(x_TH, layer.attn_norm, cfg.rms_norm_eps)
        x_TH = x_TH + project_out(attn_fn(i, *project_qkv(h_TH, layer.attn, cfg, i, pos_T)), layer.attn)
        h_TH = rms_norm(x_TH, layer.mlp_norm, cfg.rms_norm_eps)
        if isinstance(layer.mlp, DenseMLP):
            return x_TH + dense_mlp(h_TH, layer.mlp)
        return x_TH + moe(h_TH, layer.mlp, cfg)[0]

    x_TH = params.embed[tokens_T] * 8  # a residual stream larger than a layer's output: the adds round
    with torch.no_grad():
        for i, layer in enumerate(params.layers):
            want_TH = unfused(x_TH, layer, i)
            got_TH, _ = decoder_layer(x_TH, layer, cfg, i, pos_T, attn_fn)
            assert torch.equal(got_TH, want_TH), f"layer {i}"
            x_TH = got_TH
