"""MTP drafts (mimo_fn.speculative.mtp, mtp_checkpoint): the chain's drafts equal a dense reference,
speculative decoding with them equals plain greedy (batching, chunking, prompt sharing, the prefix
cache, DP 2 on gloo), and the released layout's tensors load and save.
"""

import json
import logging
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from dist_util import run_ranks
from mimo_fn.checkpoint_qkv import fuse
from mimo_fn.kernels.attention.ref import attend
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.model import decoder_layer
from mimo_fn.parallel.mesh import init_mesh
from mimo_fn.quant import QTensor, quantize_fp8_block
from mimo_fn.speculative import mtp_checkpoint
from mimo_fn.speculative.mtp import MTPProposer, describe_mtp, init_mtp, mtp_model_config, mtp_to_flat

CFG = mf.ModelConfig.tiny()  # sliding window 8: the MTP layer's attention window bites
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [11, 12]]


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=3)


def _hidden(params, tokens):
    """The target's last-layer residual stream [T, 1, H] of one sequence."""
    state = mf.init_state(CFG, params, 256, page_size=4)
    _, out = mf.prefill(state, mf.Batch.from_tokens([0], [tokens]), capture_hidden=(CFG.num_layers - 1,))
    return out.hidden_TLH


def _dense_drafts(mtp, params, tokens, k, probs=False):
    """The chain of one MTP layer computed the plain way: the layer over the whole sequence of
    rows (x_{p+1}, h_p) for p < n and then its own chain rows, with no cache; with probs, also
    each draft's probability under its step's logits."""
    layer, mcfg, eps = mtp.layers[0], mtp_model_config(CFG), CFG.rms_norm_eps
    h = rms_norm(_hidden(params, tokens[:-1])[:, 0], params.norm, eps)  # [n, H] post-norm
    toks, drafts, beliefs = list(tokens[1:]), [], []
    for _ in range(k):
        pos = torch.arange(len(toks))
        x = linear(torch.cat([rms_norm(params.embed[torch.tensor(toks)], layer.enorm, eps),
                              rms_norm(h, layer.hnorm, eps)], dim=-1), layer.eh_proj)
        y, _ = decoder_layer(x, layer.block, mcfg, 0, pos, lambda i, q, kk, v: attend(
            q, kk, v, pos, pos, mcfg.scale, mcfg.window(0), layer.block.attn.sinks))
        out = rms_norm(y, layer.final_norm, eps)
        logits = linear(out[-1:], params.lm_head)[0]
        d = int(logits.argmax())
        drafts.append(d)
        beliefs.append(float(torch.softmax(logits.double(), dim=-1)[d]))
        toks.append(d)
        h = torch.cat([h, out[-1:]])  # the next chain row reads the last output
    return (drafts, beliefs) if probs else drafts


def test_drafts_equal_a_dense_reference(params):
    """One MTP layer: the proposer's chain (context observed in pieces, rows cached over several
    proposals, a fork of part of a sequence) gives the drafts of the plain computation."""
    mtp = init_mtp(CFG, 1, seed=4)
    tokens = torch.randint(0, CFG.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    hidden = _hidden(params, tokens)
    prop = MTPProposer(mtp, params, CFG)
    prop.observe(0, hidden[:5])
    prop.observe(0, hidden[5:12])
    assert prop.propose(0, tokens[:13], 4) == _dense_drafts(mtp, params, tokens[:13], 4)
    prop.observe(0, hidden[12:20])  # after a "verify step": 8 more kept
    assert prop.propose(0, tokens[:21], 3) == _dense_drafts(mtp, params, tokens[:21], 3)
    assert prop.propose(0, tokens[:21], 3) == _dense_drafts(mtp, params, tokens[:21], 3)  # asked again: the same
    other = tokens[:15] + [(t + 1) % CFG.vocab_size for t in tokens[15:]]
    prop.fork({1: 0}, {1: 15})  # shares 15 tokens: its row 14 reads its own token 15
    prop.observe(1, _hidden(params, other)[15:18])
    assert prop.propose(1, other[:19], 3) == _dense_drafts(mtp, params, other[:19], 3)
    with pytest.raises(ValueError, match="has 20 observed tokens, expected 21"):
        prop.propose(0, tokens[:22], 2)
    with pytest.raises(ValueError, match="sequence 1 holds context already"):
        prop.fork({1: 0})
    prop.forget(0)
    assert prop.context_len(0) == 0 and prop.context_len(1) == 18


@pytest.mark.parametrize("chunk, k, layers", [(16384, 3, 2), (4, 4, 2), (4, 2, 3)])
def test_mtp_speculative_equals_plain_greedy(params, chunk, k, layers):
    """Batched requests, prompts in one pass or chunked over several, chains shorter and longer
    than the layers (a longer one repeats the last layer): greedy's tokens and log-probs."""
    plain = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=chunk)).generate(
        PROMPTS, 16, return_logprobs=True)
    proposer = MTPProposer(init_mtp(CFG, layers, seed=5), params, CFG)
    engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, chunk_size=chunk,
                                                    num_draft_tokens=k, proposer=proposer))
    got = engine.generate(PROMPTS, 16, return_logprobs=True)
    for g, w in zip(got, plain):
        assert g.tokens == w.tokens
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
        assert sum(g.accept_lengths) == 15
    stats = engine.spec_stats()
    assert stats["drafted"] > 0 and stats["verified"] == sum(len(o.accept_lengths) for o in got)
    assert proposer._seqs == {}  # every request forgotten when generate ended


def test_mtp_drafts_left_on_the_device_verify_as_the_listed_ones(params):
    """propose_device (the chain's drafts queued on the device) gives propose_many's tokens and
    acceptance, and is what the engine takes where every request asks for the same k."""
    used = []

    class Listed(MTPProposer):
        def propose_device(self, asks):
            return None

    class Counted(MTPProposer):
        def propose_device(self, asks):
            out = super().propose_device(asks)
            used.append(out is not None)
            return out

    def run(cls):
        engine = mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3,
                                                        proposer=cls(init_mtp(CFG, 2, seed=5), params, CFG)))
        return [(o.tokens, o.accept_lengths) for o in engine.generate(PROMPTS, 16)]

    assert run(Listed) == run(Counted) and any(used)


def test_mtp_with_prompt_sharing_and_the_prefix_cache(params):
    """Copies of a prompt fork its MTP state, and a later turn forks a prefix cache entry's: the
    tokens are those of an engine that shares nothing."""
    talks = [PROMPTS[1] * 2, PROMPTS[0], PROMPTS[1] * 2]
    engines = [mf.Engine(CFG, params, mf.EngineConfig(
        max_tokens=1024, page_size=4, chunk_size=8, num_draft_tokens=3, share_prompts=share, prefix_cache=share,
        proposer=MTPProposer(init_mtp(CFG, 2, seed=6), params, CFG))) for share in (False, True)]
    for turn in range(3):
        outs = [e.generate(talks, 6) for e in engines]
        assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]
        talks = [t + o.tokens + [turn + 1, 2] for t, o in zip(talks, outs[0])]
    assert engines[1].prefix_stats["hits"] > 0


def _write(params, mtp, path, **kw):
    mf.save_checkpoint(params, CFG, path, **kw)
    mtp_checkpoint.save_mtp(mtp, CFG, path)


def test_mtp_checkpoint_round_trip(params, tmp_path, caplog):
    """save_mtp writes the released names beside save_checkpoint's files; load_checkpoint skips
    them (with a warning), load_mtp reads every tensor back; sharded with an index too."""
    mtp = init_mtp(CFG, 2, seed=7)
    mtp = replace(mtp, layers=(replace(mtp.layers[0], enorm=mtp.layers[0].enorm + 0.5),) + mtp.layers[1:])
    _write(params, mtp, tmp_path / "one")
    saved = load_file(tmp_path / "one" / mtp_checkpoint.MTP_FILE)
    assert len(saved) == len(describe_mtp(CFG, 2)) == 2 * 14  # 4 + the decoder layer's 10 (sinks included)
    for name in ("enorm.weight", "hnorm.weight", "final_layernorm.weight", "input_layernorm.weight",
                 "pre_mlp_layernorm.weight", "self_attn.attention_sink_bias", "mlp.down_proj.weight"):
        assert f"model.mtp.layers.1.{name}" in saved
    assert list(saved["model.mtp.layers.0.eh_proj.weight"].shape) == [64, 128]
    assert list(saved["model.mtp.layers.0.self_attn.k_proj.weight"].shape) == [2 * 24, 64]  # the SWA KV heads
    assert list(saved["model.mtp.layers.0.mlp.gate_proj.weight"].shape) == [CFG.intermediate_size, 64]
    assert json.load(open(tmp_path / "one" / "config.json"))["num_nextn_predict_layers"] == 2
    with caplog.at_level(logging.WARNING, logger="mimo_fn"):
        cfg, loaded_params = mf.load_checkpoint(tmp_path / "one", dtype=torch.float32, progress=False)
    assert "skipped 28 multi-token-prediction tensors" in caplog.text
    for where in ("one", "sharded"):
        if where == "sharded":
            _write(params, mtp, tmp_path / where, max_shard_bytes=20_000)
            assert mtp_checkpoint.MTP_FILE in json.load(open(tmp_path / where / "model.safetensors.index.json"))[
                "weight_map"].values()
        got_cfg, got = mtp_checkpoint.load_mtp(tmp_path / where, dtype=torch.float32)
        assert got_cfg == CFG
        a, b = mtp_to_flat(mtp), mtp_to_flat(got)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    tokens = [9, 8, 7, 6, 5, 4, 3]
    drafts = []
    for m in (mtp, got):
        prop = MTPProposer(m, loaded_params, cfg)
        prop.observe(0, _hidden(loaded_params, tokens[:-1]))
        drafts.append(prop.propose(0, tokens, 3))
    assert drafts[0] == drafts[1]


def test_mtp_checkpoint_variants_and_errors(params, tmp_path):
    """The released checkpoint's variants load (post_attention_layernorm for pre_mlp_layernorm,
    a fused qkv_proj, FP8 weights with their scales); a tensor of the wrong shape, a missing one
    and an unknown one are ValueErrors naming it."""
    mtp = init_mtp(CFG, 1, seed=8)
    _write(params, mtp, tmp_path)
    file = tmp_path / mtp_checkpoint.MTP_FILE
    weights = load_file(file)
    h = "model.mtp.layers.0."
    variant = dict(weights)
    variant[h + "post_attention_layernorm.weight"] = variant.pop(h + "pre_mlp_layernorm.weight")
    qkv = {h + f"self_attn.{p}.weight": variant.pop(h + f"self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")}
    variant.update(fuse(qkv, h + "self_attn.", CFG.num_kv_heads, 0))
    save_file(variant, file)
    _, got = mtp_checkpoint.load_mtp(tmp_path, dtype=torch.float32)
    a, b = mtp_to_flat(mtp), mtp_to_flat(got)
    assert all(torch.equal(a[n], b[n]) for n in a)
    fp8 = replace(mtp, layers=(replace(mtp.layers[0], eh_proj=quantize_fp8_block(mtp.layers[0].eh_proj)),))
    mtp_checkpoint.save_mtp(fp8, CFG, tmp_path)
    assert h + "eh_proj.weight_scale_inv" in load_file(file)
    _, got = mtp_checkpoint.load_mtp(tmp_path, dtype=torch.float32)
    assert isinstance(got.layers[0].eh_proj, QTensor)
    _, deq = mtp_checkpoint.load_mtp(tmp_path, dtype=torch.float32, quant="dequantize")
    torch.testing.assert_close(deq.layers[0].eh_proj, mtp.layers[0].eh_proj, atol=2e-3, rtol=0.1)

    bad = dict(weights)
    bad[h + "eh_proj.weight"] = bad[h + "eh_proj.weight"][:, :-1].contiguous()
    save_file(bad, file)
    with pytest.raises(ValueError, match=r"'model.mtp.layers.0.eh_proj.weight' has shape \[64, 127\], expected \[64, 128\]"):
        mtp_checkpoint.load_mtp(tmp_path)
    bad = dict(weights)
    bad[h + "self_attn.o_proj.weight"] = torch.zeros(64, 65)
    save_file(bad, file)
    with pytest.raises(ValueError, match=r"'model.mtp.layers.0.self_attn.o_proj.weight' has shape \[64, 65\]"):
        mtp_checkpoint.load_mtp(tmp_path)
    bad = dict(weights)
    del bad[h + "hnorm.weight"]
    save_file(bad, file)
    with pytest.raises(ValueError, match=r"missing tensor 'model.mtp.layers.0.hnorm.weight'"):
        mtp_checkpoint.load_mtp(tmp_path)
    save_file({**weights, h + "shared_head.weight": torch.zeros(3)}, file)
    with pytest.raises(ValueError, match=r"MTP tensors this layout does not know, e.g. \['model.mtp.layers.0.shared_head"):
        mtp_checkpoint.load_mtp(tmp_path)
    hf = json.load(open(tmp_path / "config.json"))
    hf["num_nextn_predict_layers"] = 0
    json.dump(hf, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="declares no MTP layers"):
        mtp_checkpoint.load_mtp(tmp_path)
    with pytest.raises(ValueError, match=r"eh_proj is \[64, 128\], expected \[32, 64\]"):
        MTPProposer(mtp, params, mf.ModelConfig.tiny(hidden_size=32))


def _dp_worker(rank, world, path):
    """DP 2 (EP 2) on gloo: each DP group's prompts (group 1's fewer, so it idles while group 0
    decodes) decoded with MTP drafts give the 1-rank engine's tokens and log-probs."""
    mesh = init_mesh(2, 1, 2)
    cfg, local = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
    _, full = mf.load_checkpoint(path, dtype=torch.float32, progress=False)
    mtp = init_mtp(cfg, 2, seed=9)  # the same draft weights on every rank
    gen = torch.Generator().manual_seed(40 + mesh.dp_rank)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in ((9, 17) if rank == 0 else (5,))]
    new = [12, 9] if rank == 0 else [4]
    config = mf.EngineConfig(max_tokens=256, page_size=4, chunk_size=8, cuda_graphs=False, num_draft_tokens=3)
    engine = mf.Engine(cfg, local, replace(config, proposer=MTPProposer(mtp, local, cfg)), mesh=mesh)
    got = engine.generate(prompts, new, return_logprobs=True)
    assert engine.spec_stats()["drafted"] > 0, f"rank {rank}: no drafts"
    want = mf.Engine(cfg, full, replace(config, proposer=MTPProposer(mtp, full, cfg))).generate(
        prompts, new, return_logprobs=True)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens, f"rank {rank}"
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) <= 1e-4, f"rank {rank}"


@pytest.mark.slow  # two gloo processes, ~20 s on CI's 2 cores: scripts/gpu_tests.py runs it
def test_mtp_on_dp2_gloo(tmp_path):
    from test_parallel import write_checkpoint

    run_ranks(2, _dp_worker, write_checkpoint(tmp_path / "ckpt"), tmp_dir=str(tmp_path))
