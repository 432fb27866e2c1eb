"""The model with FP8 block weights: against its dequantised twin, and FP8 checkpoints."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from mimo_fn.params import from_flat, quantize_params, to_flat
from mimo_fn.quant import QTensor, dequantize

MID = mf.ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=4, num_heads=4,
                          num_kv_heads=2, num_swa_kv_heads=4, head_dim=96, v_head_dim=32,
                          num_experts=16, top_k=4, moe_intermediate_size=128, n_group=4, topk_group=2,
                          sliding_window=16)


def quantized(cfg, params):
    return quantize_params(cfg, params)


def dequantized(cfg, params):
    return from_flat(cfg, {k: dequantize(v, torch.float32) if isinstance(v, QTensor) else v
                           for k, v in to_flat(params).items()})


def agreement(cfg, fp8, ref, prompts):
    cos, top1 = [], []
    for p in prompts:
        a, b = mf.forward(fp8, cfg, p), mf.forward(ref, cfg, p)
        cos.append(F.cosine_similarity(a, b, dim=-1))
        top1.append((a.argmax(-1) == b.argmax(-1)).float())
    return torch.cat(cos), torch.cat(top1)


@pytest.mark.parametrize("cfg", [mf.ModelConfig.tiny(), MID], ids=["tiny", "mid"])
def test_fp8_model_close_to_dequantised_twin(cfg):
    params = quantized(cfg, mf.init_params(cfg, seed=3))
    twin = dequantized(cfg, params)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (7, 40, 65)]
    cos, top1 = agreement(cfg, params, twin, prompts)
    print(f"mean cosine {cos.mean():.4f}, min {cos.min():.4f}, top-1 agreement {top1.mean():.1%}")
    assert cos.mean() >= 0.99
    assert top1.mean() >= 0.5  # random models have small logit margins: report, don't expect 100%


def _independent_fp8_checkpoint(cfg, params, d, fused_qkv=False):
    """Write the released FP8 layout by hand: per 128x128 block, scale = amax / 448 (with
    fused_qkv, the blocks of each layer's whole qkv_proj)."""
    mf.save_checkpoint(params, cfg, d, fused_qkv=fused_qkv)  # bf16 first, then quantise its GEMM weights
    tensors = load_file(d / "model.safetensors")
    out = {}
    for k, w in tensors.items():
        is_gemm = w.dim() == 2 and k.endswith("proj.weight")
        if not is_gemm:
            out[k] = w
            continue
        n, m = w.shape
        nb, mb = -(-n // 128), -(-m // 128)
        padded = torch.zeros(nb * 128, mb * 128)
        padded[:n, :m] = w
        amax = padded.view(nb, 128, mb, 128).abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (padded.view(nb, 128, mb, 128) / scale[:, None, :, None]).view(nb * 128, mb * 128)[:n, :m]
        out[k] = q.to(torch.float8_e4m3fn)
        out[k.replace(".weight", ".weight_scale_inv")] = scale
    save_file(out, d / "model.safetensors")
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(hf))


def test_independent_fp8_checkpoint_loads_and_round_trips(tmp_path):
    cfg = MID
    _independent_fp8_checkpoint(cfg, mf.init_params(cfg, seed=4), tmp_path / "a")
    cfg2, params = mf.load_checkpoint(tmp_path / "a", dtype=torch.float32)
    assert cfg2 == cfg
    assert isinstance(params.layers[1].attn.wq, QTensor) and params.layers[1].attn.wq.data.dtype == torch.float8_e4m3fn
    assert isinstance(params.layers[2].mlp.w13, QTensor) and params.layers[2].mlp.w13.data.shape == (16, 256, 256)
    _, twin = mf.load_checkpoint(tmp_path / "a", dtype=torch.float32, quant="dequantize")
    assert isinstance(twin.layers[2].mlp.w13, torch.Tensor)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 50)]
    cos, _ = agreement(cfg, params, twin, prompts)
    assert cos.mean() >= 0.99
    # our writer reproduces the same FP8 bytes and scales
    mf.save_checkpoint(params, cfg, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    # quantising a bf16 checkpoint at load gives FP8 weights too
    mf.save_checkpoint(twin, cfg, tmp_path / "c")
    _, q = mf.load_checkpoint(tmp_path / "c", dtype=torch.float32, quant="fp8")
    assert isinstance(q.layers[0].mlp.w_gate, QTensor) and not isinstance(q.lm_head, QTensor)


def test_bad_quantization_config(tmp_path):
    cfg = mf.ModelConfig.tiny()
    mf.save_checkpoint(mf.init_params(cfg), cfg, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"weight_block_size \[128, 128\]"):
        mf.load_checkpoint(tmp_path)
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"\{'quant_method': 'awq', 'bits': 4\} is not supported; expected "
                                         r"quant_method 'fp8' .*, or quant_method 'mxfp4'"):
        mf.load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="quant='int4'"):
        mf.load_checkpoint(tmp_path, quant="int4")


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_fp8_shards_read_per_rank(tmp_path, fused_qkv):
    """A rank reads its slice of FP8 weights: block-aligned shards stay FP8, shards that cut
    through 128-row blocks (a 96-row KV head here) are dequantised; both equal the full weight's rows.
    A fused qkv_proj (blocks of the whole matrix: q rows [0, 384), k [384, 576), v [576, 640) on
    the full-attention layers) reads the same way."""
    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.parallel.sharding import slice_of

    cfg = MID
    _independent_fp8_checkpoint(cfg, mf.init_params(cfg, seed=5), tmp_path, fused_qkv)
    assert ("model.layers.0.self_attn.qkv_proj.weight_scale_inv" in load_file(tmp_path / "model.safetensors")) \
        == fused_qkv
    _, full = mf.load_checkpoint(tmp_path, dtype=torch.float32)
    if fused_qkv:  # q's rows are whole blocks of the fused matrix, k's on a full layer are not
        assert isinstance(full.layers[0].attn.wq, QTensor) and not isinstance(full.layers[0].attn.wk, QTensor)
    full_flat = {k: dequantize(v, torch.float32) if isinstance(v, QTensor) else v for k, v in to_flat(full).items()}
    kinds = set()
    for rank in range(4):
        mesh = Mesh(dp=1, tp=4, ep=4, rank=rank)
        _, local = mf.load_checkpoint(tmp_path, dtype=torch.float32, mesh=mesh, progress=False)
        for name, w in to_flat(local).items():
            sl = slice_of(name, tuple(full_flat[name].shape), cfg, mesh)
            want = full_flat[name] if sl is None else full_flat[name].narrow(sl[0], sl[1], sl[2] - sl[1])
            kinds.add(type(w).__name__)
            got = dequantize(w, torch.float32) if isinstance(w, QTensor) else w
            assert torch.equal(got, want), (rank, name)
    assert kinds == {"QTensor", "Tensor"}
