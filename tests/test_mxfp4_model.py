"""The model with MXFP4 routed experts (the RL release's layout): against its dequantised twin,
through the engine, and MXFP4 checkpoints read per rank."""

import pytest
import torch

import mimo_fn as mf
from mimo_fn.params import describe, from_flat, quantize_params, to_flat
from mimo_fn.quant import FP8_BLOCK, MXFP4, QTensor, dequantize, quantize_mxfp4

CFG = mf.ModelConfig.tiny()  # hidden 64, intermediates 96 / 32: every GEMM's K a multiple of 32
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the experts run fused_moe_mxfp4


def mxfp4_weights(cfg, params, experts_only=True):
    """The routed expert stacks (or, experts_only=False, every quantizable GEMM weight) as MXFP4;
    everything else as it is."""
    infos = describe(cfg)
    picked = {k for k, info in infos.items() if info.quantizable and (len(info.shape) == 3 or not experts_only)}
    return from_flat(cfg, {k: quantize_mxfp4(v) if k in picked else v for k, v in to_flat(params).items()})


def dequantized(cfg, params, dtype):
    return from_flat(cfg, {k: dequantize(v, dtype) if isinstance(v, QTensor) else v
                           for k, v in to_flat(params).items()})


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("experts_only", [True, False], ids=["experts", "every_gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_dequantised_twin(dtype, experts_only):
    """MXFP4 experts run through moe_experts' MXFP4 path (every_gemm: the other GEMMs through
    `linear`'s) and give what the same model with the weights dequantised to `dtype` gives:
    dequantisation is exact, so only the dispatch is under test. The quantisation itself shows."""
    base = mf.init_params(CFG, seed=3, dtype=dtype, device=DEV)
    params = mxfp4_weights(CFG, base, experts_only)
    assert params.layers[1].mlp.w13.fmt == MXFP4 and isinstance(params.layers[1].attn.wq, QTensor) != experts_only
    twin = dequantized(CFG, params, dtype)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 9, 33):
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=gen).to(DEV)
        got, want = mf.forward(params, CFG, tokens), mf.forward(twin, CFG, tokens)
        assert got.dtype == dtype
        # CPU: the same arithmetic; CUDA: the MXFP4 kernel against the bf16 / fp32 MoE kernel
        fp32_bound = 1e-6 if DEV == "cpu" else 1e-5
        assert rel_err(got, want) <= (fp32_bound if dtype == torch.float32 else 1e-2), n
        assert rel_err(got, mf.forward(base, CFG, tokens)) > 1e-4  # 4-bit weights do change the logits


def test_engine_generate_greedy_is_deterministic():
    """Greedy generation on MXFP4 experts (paged prefill and decode; on CUDA the Triton kernels,
    decode in CUDA graphs) repeats itself, and on the CPU equals greedy on `forward`."""
    params = quantize_params(CFG, mf.init_params(CFG, seed=4, device=DEV), experts="mxfp4")  # FP8 attn + MXFP4
    assert params.layers[2].mlp.w2.fmt == MXFP4 and params.layers[2].attn.wo.fmt == FP8_BLOCK
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2], list(range(20, 41))]
    config = mf.EngineConfig(max_tokens=256, page_size=4)
    runs = [mf.Engine(CFG, params, config).generate(prompts, max_new_tokens=8, return_logprobs=True)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert len(a.tokens) == 8 and a.tokens == b.tokens and torch.equal(torch.tensor(a.logprobs),
                                                                           torch.tensor(b.logprobs))
    if DEV != "cpu":
        return
    # the last prompt's tokens equal greedy on `forward`, one token at a time
    seq = torch.tensor(prompts[2])
    for t in runs[0][2].tokens:
        assert int(mf.forward(params, CFG, seq)[-1].argmax()) == t
        seq = torch.cat([seq, torch.tensor([t])])


def test_quantize_params_experts_argument():
    base = mf.init_params(CFG, seed=5)
    fp8, mx = quantize_params(CFG, base), quantize_params(CFG, base, experts="mxfp4")
    assert fp8.layers[1].mlp.w13.fmt == FP8_BLOCK and mx.layers[1].mlp.w13.fmt == MXFP4
    assert torch.equal(mx.layers[1].mlp.w13.data, quantize_mxfp4(base.layers[1].mlp.w13).data)
    assert mx.layers[0].mlp.w_gate.fmt == FP8_BLOCK and torch.equal(mx.lm_head, base.lm_head)
    assert quantize_params(CFG, mx).layers[1].mlp.w13.fmt == MXFP4  # QTensors are kept as they are
    with pytest.raises(ValueError, match=r"experts = 'nvfp4'; expected one of \('fp8', 'mxfp4'\)"):
        quantize_params(CFG, base, experts="nvfp4")
    odd = mf.ModelConfig.tiny(moe_intermediate_size=48)
    with pytest.raises(ValueError, match=r"'layers.1.mlp.w2' is \[8, 64, 48\]; MXFP4 needs its last dim"):
        quantize_params(odd, mf.init_params(odd), experts="mxfp4")


@pytest.mark.parametrize("f4", [False, True], ids=["uint8", "float4_e2m1fn_x2"])
def test_mxfp4_shards_read_per_rank(tmp_path, f4):
    """Under a mesh a rank reads only its experts, and its rows (q, k, v) or columns (o) of the
    other MXFP4 weights: row shards stay MXFP4; o's 16-column shards cut through 32-column
    groups and are dequantised. All equal the full weights' slices. With f4 the bytes are stored
    as float4_e2m1fn_x2, which safetensors cannot slice (read whole, then sliced)."""
    from safetensors.torch import load_file, save_file

    from mimo_fn.parallel.mesh import Mesh
    from mimo_fn.parallel.sharding import slice_of

    if f4 and not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    mf.save_checkpoint(mxfp4_weights(CFG, mf.init_params(CFG, seed=6), experts_only=False), CFG, tmp_path)
    if f4:
        tensors = load_file(tmp_path / "model.safetensors")
        for k in [k for k in tensors if k.endswith("_scale")]:
            tensors[k.removesuffix("_scale")] = tensors[k.removesuffix("_scale")].view(torch.float4_e2m1fn_x2)
        save_file(tensors, tmp_path / "model.safetensors")
    _, full = mf.load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    full_flat = to_flat(full)
    kinds = set()
    for rank in range(4):
        mesh = Mesh(dp=1, tp=4, ep=4, rank=rank)
        _, local = mf.load_checkpoint(tmp_path, dtype=torch.float32, mesh=mesh, progress=False)
        for name, w in to_flat(local).items():
            f = full_flat[name]
            sl = slice_of(name, tuple(f.shape), CFG, mesh)
            kinds.add((type(w).__name__, type(f).__name__))
            if isinstance(w, QTensor):  # the bytes and scales of the full weight's rows
                dim, start, stop = sl or (0, 0, f.shape[0])
                assert dim == 0 and w.fmt == MXFP4, name
                assert torch.equal(w.data, f.data.narrow(0, start, stop - start)), (rank, name)
                assert torch.equal(w.scale, f.scale.narrow(0, start, stop - start)), (rank, name)
                if name.endswith("w13"):
                    assert w.shape[0] == CFG.num_experts // 4
                continue
            dense = dequantize(f, torch.float32) if isinstance(f, QTensor) else f
            want = dense if sl is None else dense.narrow(sl[0], sl[1], sl[2] - sl[1])
            assert torch.equal(w, want), (rank, name)
    assert kinds == {("QTensor", "QTensor"), ("Tensor", "QTensor"), ("Tensor", "Tensor")}
