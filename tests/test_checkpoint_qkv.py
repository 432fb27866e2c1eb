"""Fused qkv_proj as the releases store it (checkpoint_qkv.py): the interleaved order, per-shard
FP8 scales, the config rules, the writer, and the same logits from every layout at TP 1, 2, 4."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mimo_fn as mf
from dist_util import run_ranks
from mimo_fn.checkpoint_qkv import QKVLayout, layer_fused_qkv, qkv_layout, row_ranges
from mimo_fn.parallel.mesh import Mesh, init_mesh
from mimo_fn.parallel.sharding import slice_of
from mimo_fn.params import from_flat, quantize_params, to_flat
from mimo_fn.quant import QTensor, dequantize, quantize_mxfp4

# T = num_key_value_heads = 4 checkpoint shards; 2 query heads, and 1 (full) or 2 (SWA) KV heads
# per shard. D = Dv = 128: every projection's rows per shard are whole 128-row blocks, so each
# layout (and every rank's slice at TP 1, 2, 4) holds the same FP8 codes and scales.
ALIGNED = mf.ModelConfig.tiny(hidden_size=128, num_heads=8, num_kv_heads=4, num_swa_kv_heads=8, head_dim=128,
                              v_head_dim=128, intermediate_size=128, moe_intermediate_size=128)
# The released proportions (64 query heads over 4 shards of 192-dim heads, 4 / 8 KV heads, v 128)
# at 8 query heads: a full layer's shard is 384 q + 192 k + 128 v = 704 rows, 5.5 blocks, so its
# k and v share a block and the shard has ceil(704 / 128) = 6 scale rows: 24 for the 4 shards,
# where one grid over the whole 2,816 rows would have 22.
RELEASED = mf.ModelConfig.tiny(hidden_size=256, num_heads=8, num_kv_heads=4, num_swa_kv_heads=8, head_dim=192,
                               v_head_dim=128, intermediate_size=128, moe_intermediate_size=128)
LAYOUTS = ("split", "plain", "interleaved")


def test_layout_rules():
    """Interleaved unless config.json says plain, or (without the field) ModelOpt wrote it; an
    explicit order wins either way; text_config is read too; a bad value names its field."""
    fused = {"attention_projection_layout": "fused_qkv"}
    assert qkv_layout({}) == QKVLayout(None, "plain")  # mimo_fn's own older fused files
    assert qkv_layout(fused) == QKVLayout("fused_qkv", "interleaved")
    assert qkv_layout({**fused, "quantization_config": {"quant_method": "fp8"}}).order == "interleaved"
    assert qkv_layout({**fused, "quantization_config": {"quant_method": "modelopt"}}).order == "plain"
    assert qkv_layout({**fused, "fused_qkv_weight_order": "interleaved",
                       "quantization_config": {"quant_method": "modelopt"}}).order == "interleaved"
    assert qkv_layout({**fused, "fused_qkv_weight_order": "plain"}).order == "plain"
    assert qkv_layout({"text_config": {**fused, "fused_qkv_weight_order": "plain"}}) == QKVLayout("fused_qkv", "plain")
    with pytest.raises(ValueError, match=r"'fused_qkv_weight_order' = 'zigzag': expected one of \('plain', "):
        qkv_layout({**fused, "fused_qkv_weight_order": "zigzag"})
    with pytest.raises(ValueError, match=r"'attention_projection_layout' = 'qkv': expected one of \('split', "):
        qkv_layout({"attention_projection_layout": "qkv"})


def test_released_dims_plan():
    """At the released dims: 3,392-row shards with 27 scale rows each on full layers (108 in
    all, not 106), 3,712 rows (29 blocks) on SWA layers; a TP-2 rank's KV heads come from two
    checkpoint shards."""
    cfg = mf.ModelConfig.flash()
    full, swa = layer_fused_qkv(cfg, 0, "interleaved"), layer_fused_qkv(cfg, 1, "interleaved")
    assert (full.shards, full.shard_rows, full.scale_rows) == (4, 3392, 108)
    assert layer_fused_qkv(cfg, 0, "plain").scale_rows == 106
    assert (swa.shards, swa.shard_rows, swa.scale_rows) == (4, 3712, 116)
    # rank 1 of TP 2 holds KV heads 2, 3 of a full layer: k rows [384, 768), in shards 2 and 3
    assert row_ranges(full, 1, 384, 768) == [(2 * 3392 + 3072, 2 * 3392 + 3264), (3 * 3392 + 3072, 3 * 3392 + 3264)]
    assert row_ranges(layer_fused_qkv(cfg, 0, "plain"), 2, 0, 512) == [(12288 + 768, 12288 + 768 + 512)]


def _block_quantize(w):
    """Per 128x128 block of w: scale = amax / 448 (1 for an all-zero block), q = w / scale in e4m3."""
    n, m = w.shape
    nb, mb = -(-n // 128), -(-m // 128)
    padded = torch.zeros(nb * 128, mb * 128)
    padded[:n, :m] = w.float()
    amax = padded.view(nb, 128, mb, 128).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (padded.view(nb, 128, mb, 128) / scale[:, None, :, None]).view(nb * 128, mb * 128)[:n, :m]
    return q.to(torch.float8_e4m3fn), scale


def _dequant_rows(q, scale):
    return q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]


def write_release(cfg, params, d, fp8=False, order_field=None):
    """A fused interleaved checkpoint written by hand (not by save_checkpoint's fuse): per layer,
    T = num_key_value_heads shards of [q_s; k_s; v_s]; with fp8, each shard quantised on its own
    128x128 grid. Returns the q/k/v weights the file holds (fp8: dequantised per shard)."""
    mf.save_checkpoint(params, cfg, d)
    tensors = load_file(d / "model.safetensors")
    held = {}
    T = cfg.num_kv_heads
    for i in range(cfg.num_layers):
        h = f"model.layers.{i}.self_attn."
        qkv = [tensors.pop(h + f"{p}_proj.weight") for p in "qkv"]
        per = [w.shape[0] // T for w in qkv]
        shards = [torch.cat([w[s * n:(s + 1) * n] for w, n in zip(qkv, per)]) for s in range(T)]
        if fp8:
            quantised = [_block_quantize(m) for m in shards]
            tensors[h + "qkv_proj.weight"] = torch.cat([q for q, _ in quantised])
            tensors[h + "qkv_proj.weight_scale_inv"] = torch.cat([sc for _, sc in quantised])
            shards = [_dequant_rows(q, sc) for q, sc in quantised]
        else:
            tensors[h + "qkv_proj.weight"] = torch.cat(shards)
        bounds = [0, per[0], per[0] + per[1], sum(per)]
        for j, name in enumerate(("wq", "wk", "wv")):
            held[f"layers.{i}.attn.{name}"] = torch.cat([m[bounds[j]:bounds[j + 1]] for m in shards])
    save_file(tensors, d / "model.safetensors")
    hf = json.loads((d / "config.json").read_text())
    hf["attention_projection_layout"] = "fused_qkv"  # as released: no order field
    if order_field:
        hf["fused_qkv_weight_order"] = order_field
    if fp8:
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(hf))
    return held


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_released_interleaved_loads_as_released(tmp_path):
    """A hand-written interleaved checkpoint (as released: no order field) loads to the weights it
    was written from, with split's logits; read as plain (what mimo_fn did before) it is a
    different model (relative logits error ~1)."""
    cfg = ALIGNED
    params = mf.init_params(cfg, seed=21)
    write_release(cfg, params, tmp_path / "release")
    _, got = mf.load_checkpoint(tmp_path / "release", dtype=torch.float32, progress=False)
    for name, w in to_flat(params).items():
        assert torch.equal(to_flat(got)[name], w), name
    tokens = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    want = mf.forward(params, cfg, tokens)
    assert torch.equal(mf.forward(got, cfg, tokens), want)
    write_release(cfg, params, tmp_path / "as_plain", order_field="plain")
    _, wrong = mf.load_checkpoint(tmp_path / "as_plain", dtype=torch.float32, progress=False)
    err = _rel(mf.forward(wrong, cfg, tokens), want)
    print(f"interleaved read as plain: relative logits error {err:.2f}")
    assert err > 0.3


def test_released_fp8_per_shard_scales(tmp_path):
    """FP8 at the released proportions: the scales are per shard (24 rows, not 22). q stays FP8;
    a full layer's k and v, which share a block of their shard, are dequantised with that
    shard's scales; SWA layers (whole blocks) stay FP8. Every weight equals what the file holds,
    whole and in each rank's slice at TP 2, 4, 8; quant="dequantize" gives the split logits."""
    cfg = RELEASED
    params = mf.init_params(cfg, seed=22)
    held = write_release(cfg, params, tmp_path, fp8=True)
    scale = load_file(tmp_path / "model.safetensors")["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert scale.shape == (24, 2)
    _, full = mf.load_checkpoint(tmp_path, dtype=torch.float32, progress=False)
    a0, a1 = full.layers[0].attn, full.layers[1].attn
    assert isinstance(a0.wq, QTensor) and not isinstance(a0.wk, QTensor) and not isinstance(a0.wv, QTensor)
    assert all(isinstance(w, QTensor) for w in (a1.wq, a1.wk, a1.wv))
    full_flat = {k: dequantize(v, torch.float32) if isinstance(v, QTensor) else v for k, v in to_flat(full).items()}
    for name, w in held.items():
        assert torch.equal(full_flat[name], w), name
    for tp in (2, 4, 8):
        for rank in range(tp):
            mesh = Mesh(dp=1, tp=tp, ep=1, rank=rank)
            _, local = mf.load_checkpoint(tmp_path, dtype=torch.float32, mesh=mesh, progress=False)
            for name, w in to_flat(local).items():
                if ".attn.w" not in name:
                    continue
                sl = slice_of(name, tuple(full_flat[name].shape), cfg, mesh)
                want = full_flat[name] if sl is None else full_flat[name].narrow(sl[0], sl[1], sl[2] - sl[1])
                got = dequantize(w, torch.float32) if isinstance(w, QTensor) else w
                assert torch.equal(got, want), (tp, rank, name)
    twin = from_flat(cfg, {**to_flat(params), **held})  # the held q/k/v, every other weight as written
    _, dq = mf.load_checkpoint(tmp_path, dtype=torch.float32, quant="dequantize", progress=False)
    tokens = torch.randint(0, cfg.vocab_size, (17,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(mf.forward(dq, cfg, tokens), mf.forward(twin, cfg, tokens))


def _edit(src, dst, tensors_fn=None, config_fn=None):
    tensors = load_file(src / "model.safetensors")
    hf = json.loads((src / "config.json").read_text())
    if tensors_fn:
        tensors_fn(tensors)
    if config_fn:
        config_fn(hf)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(hf))


def test_malformed_fused_qkv(tmp_path):
    """Rows, scales or heads that do not split into the config's shards are ValueErrors naming
    the tensor; so are a split layer under "fused_qkv" and a bad order field."""
    cfg = RELEASED
    write_release(cfg, mf.init_params(cfg, seed=23), tmp_path / "ok", fp8=True)
    key = "model.layers.0.self_attn.qkv_proj.weight"
    cases = {
        "plain_grid": (lambda t: t.update({key + "_scale_inv": t[key + "_scale_inv"][:22]}), None,
                       rf"'{key}_scale_inv' has shape \[22, 2\], expected \[24, 2\]"),
        "rows": (lambda t: t.update({key: t[key][:-64]}), None,
                 rf"'{key}' has shape \[2752, 256\], expected \[2816, 256\]"),
        "heads": (None, lambda hf: hf.update({"swa_num_key_value_heads": 2}),
                  r"'model.layers.1.self_attn.qkv_proj.weight': an interleaved qkv_proj holds num_key_value_heads = 4 "
                  r"shards of whole heads, but layer 1 has 8 query heads and 2 KV heads"),
        "split_layer": (lambda t: t.update({"model.layers.2.self_attn.q_proj.weight": torch.zeros(1)}), None,
                        r"holds both 'model.layers.2.self_attn.qkv_proj.weight' and 'model.layers.2.self_attn.q_proj"),
        "order": (None, lambda hf: hf.update({"fused_qkv_weight_order": "rows"}),
                  r"config field 'fused_qkv_weight_order' = 'rows': expected one of \('plain', 'interleaved'\)"),
    }
    for case, (tensors_fn, config_fn, message) in cases.items():
        _edit(tmp_path / "ok", tmp_path / case, tensors_fn, config_fn)
        with pytest.raises(ValueError, match=message):
            mf.load_checkpoint(tmp_path / case, dtype=torch.float32, progress=False)
    split = tmp_path / "split"
    mf.save_checkpoint(mf.init_params(cfg, seed=23), cfg, split)
    _edit(split, tmp_path / "says_fused", config_fn=lambda hf: hf.update({"attention_projection_layout": "fused_qkv"}))
    with pytest.raises(ValueError, match=r"holds 'model.layers.0.self_attn.q_proj.weight', but config.json says "
                                         r"'attention_projection_layout' = 'fused_qkv'"):
        mf.load_checkpoint(tmp_path / "says_fused", dtype=torch.float32, progress=False)


def save_layouts(d, cfg=ALIGNED, seed=24):
    """The same bf16 weights, and their FP8 quantisation, saved in each qkv layout."""
    bf16 = mf.init_params(cfg, seed=seed, dtype=torch.bfloat16)
    fp8 = quantize_params(cfg, bf16)
    paths = {}
    for kind, params in (("bf16", bf16), ("fp8", fp8)):
        for layout in LAYOUTS:
            paths[kind, layout] = str(d / f"{kind}_{layout}")
            mf.save_checkpoint(params, cfg, paths[kind, layout], fused_qkv=False if layout == "split" else layout)
    return bf16, fp8, paths


def test_writer_writes_each_layout(tmp_path):
    """save_checkpoint writes split, plain and interleaved, bf16 and FP8; each loads to the same
    weights (FP8: the same codes and scales) and names its layout in config.json. The interleaved
    file is the hand-written release's bytes. FP8 rows that do not fall on blocks per shard are a
    ValueError, as is an unknown layout."""
    bf16, fp8, paths = save_layouts(tmp_path)
    for kind, want in (("bf16", bf16), ("fp8", fp8)):
        for layout in LAYOUTS:
            hf = json.loads(open(f"{paths[kind, layout]}/config.json").read())
            assert hf.get("fused_qkv_weight_order") == (None if layout == "split" else layout)
            _, got = mf.load_checkpoint(paths[kind, layout], dtype=torch.bfloat16, progress=False)
            for name, w in to_flat(want).items():
                g = to_flat(got)[name]
                assert isinstance(g, QTensor) == isinstance(w, QTensor), (kind, layout, name)
                if isinstance(w, QTensor):
                    assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)), (kind, layout, name)
                    assert torch.equal(g.scale, w.scale), (kind, layout, name)
                else:
                    assert torch.equal(g, w), (kind, layout, name)
    # MXFP4 q/k/v (per-row scales, so shards of any rows fuse)
    mx = from_flat(ALIGNED, {k: quantize_mxfp4(v) if ".attn.w" in k else v for k, v in to_flat(bf16).items()})
    mf.save_checkpoint(mx, ALIGNED, tmp_path / "mxfp4", fused_qkv="interleaved")
    _, got = mf.load_checkpoint(tmp_path / "mxfp4", dtype=torch.bfloat16, progress=False)
    for name, w in to_flat(mx).items():
        g = to_flat(got)[name]
        assert torch.equal(g.data, w.data) and torch.equal(g.scale, w.scale) if isinstance(w, QTensor) \
            else torch.equal(g, w), name
    write_release(ALIGNED, bf16, tmp_path / "by_hand")
    ours = load_file(f"{paths['bf16', 'interleaved']}/model.safetensors")
    assert all(torch.equal(v, ours[k]) for k, v in load_file(tmp_path / "by_hand" / "model.safetensors").items())
    released = quantize_params(RELEASED, mf.init_params(RELEASED, seed=25))
    with pytest.raises(ValueError, match=r"FP8 q/k/v projections of layer 0 have \[384, 192, 128\] rows per "
                                         r"checkpoint shard \(4 shards\)"):
        mf.save_checkpoint(released, RELEASED, tmp_path / "odd", fused_qkv="interleaved")
    with pytest.raises(ValueError, match=r"fused_qkv='zigzag', expected False, True \(= 'plain'\) or one of"):
        mf.save_checkpoint(bf16, ALIGNED, tmp_path / "bad", fused_qkv="zigzag")


def layout_logits(paths, mesh=None):
    """Per checkpoint: prefill of two sequences (19 tokens: not a multiple of TP 2 or 4) and one
    decode step, logits [4, V] fp32."""
    out = {}
    for key, path in paths.items():
        cfg, params = mf.load_checkpoint(path, dtype=torch.float32, mesh=mesh, progress=False)
        state = mf.init_state(cfg, params, max_tokens=128, page_size=4, mesh=mesh)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (13, 6)]
        state, pre = mf.prefill(state, mf.Batch.from_tokens([0, 1], prompts))
        state, dec = mf.decode(state, mf.Batch.from_tokens([0, 1], [[5], [9]]))
        out[key] = torch.cat([pre.logits_BV, dec.logits_BV])
    return out


def check_same_logits(logits, ref):
    """Every layout gives its kind's split logits (exactly: the same weights and arithmetic), and
    those are the 1-rank split logits up to fp32 rounding."""
    for (kind, layout), got in logits.items():
        assert torch.equal(got, logits[kind, "split"]), (kind, layout, _rel(got, logits[kind, "split"]))
        assert _rel(got, ref[kind]) <= 1e-5, (kind, layout, _rel(got, ref[kind]))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    _, _, paths = save_layouts(tmp_path_factory.mktemp("layouts"))
    return paths


def test_layouts_same_logits_one_rank(layouts):
    logits = layout_logits(layouts)
    check_same_logits(logits, {kind: logits[kind, "split"] for kind in ("bf16", "fp8")})


def _tp_worker(rank, world, paths):
    ref = layout_logits({kind: paths[kind, "split"] for kind in ("bf16", "fp8")})
    check_same_logits(layout_logits(paths, init_mesh(1, world, world)), ref)


@pytest.mark.parametrize("tp", [2, 4])
def test_layouts_same_logits_under_tp(layouts, tp, tmp_path):
    """Attention TP 2 and 4 (EP over the same ranks), gloo processes: each rank reads its slices
    of every layout (TP 2: a rank's heads span two checkpoint shards; TP 4: one each)."""
    run_ranks(tp, _tp_worker, layouts, tmp_dir=str(tmp_path))
