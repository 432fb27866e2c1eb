"""Numerics of the Triton paged attention kernels against `paged_attention_ref`.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set below, before
triton is imported), so shapes stay tiny; with CUDA they run natively and one test also
covers the production tile configs at the model's head dims. The Gluon kernel of
kernels/attention/ws.py has no interpreter: its tests run on a Hopper GPU and skip elsewhere.

Every check draws fresh random inputs, fills the output with NaN before the launch, and
fills every pool slot a valid call must not read (free pages, slots past kv_len, slots
below the window) with NaN, so a kernel that reads them or skips a row fails.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn.kernels import attention as attn  # noqa: E402  (the package: its public entry points)
from mimo_fn.kernels.attention import decode as attn_decode  # noqa: E402
from mimo_fn.kernels.attention import swa as attention_swa  # noqa: E402
from mimo_fn.kernels.attention import ws as attention_ws  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
SMALL = attn.PrefillConfig(block_m=16, block_n=16, h_pack=1, num_warps=4, num_stages=2)


def make_problem(seqs, num_heads, num_kv_heads, head_d, head_e, page_size, window, dtype, sinks, seed):
    """seqs: [(prefix_len, q_len)]. Physical pages are shuffled; pages wholly below the window are -1."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + q for p, q in seqs]
    num_logical = max(1, max(-(-n // page_size) for n in kv_lens))
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 3  # spare pages stay NaN
    free = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((len(seqs), num_logical), -1, dtype=torch.int32)
    k_pages = torch.full((num_pages, page_size, num_kv_heads, head_d), float("nan"))
    v_pages = torch.full((num_pages, page_size, num_kv_heads, head_e), float("nan"))
    for b, (prefix, q_len) in enumerate(seqs):
        kv_len = prefix + q_len
        lo = max(0, prefix - window + 1) if window > 0 else 0  # first key any query of b reads
        for j in range(-(-kv_len // page_size)):
            if (j + 1) * page_size <= lo:
                continue  # freed: outside the window of every query
            page = free.pop()
            page_table[b, j] = page
            s0, s1 = max(lo - j * page_size, 0), min(kv_len - j * page_size, page_size)
            k_pages[page, s0:s1] = torch.randn(s1 - s0, num_kv_heads, head_d, generator=gen)
            v_pages[page, s0:s1] = torch.randn(s1 - s0, num_kv_heads, head_e, generator=gen)
    num_tokens = sum(q for _, q in seqs)
    q = torch.randn(num_tokens, num_heads, head_d, generator=gen)
    cu_q = torch.tensor([0] + torch.tensor([q for _, q in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    sinks_N = torch.randn(num_heads, generator=gen) if sinks else None
    to = dict(device=DEVICE)
    return dict(
        q_TND=q.to(dtype=dtype, **to), k_pages_PSGD=k_pages.to(dtype=dtype, **to),
        v_pages_PSGE=v_pages.to(dtype=dtype, **to), page_table_BL=page_table.to(**to),
        cu_q_B1=cu_q.to(**to), kv_lens_B=torch.tensor(kv_lens, dtype=torch.int32, **to),
        scale=head_d**-0.5, window=window, sinks_N=None if sinks_N is None else sinks_N.to(**to),
    )


def check(launch, problem, dtype, **kw):
    q = problem["q_TND"]
    out = torch.full((q.shape[0], q.shape[1], problem["v_pages_PSGE"].shape[-1]), float("nan"),
                     dtype=q.dtype, device=q.device)
    out = launch(**problem, out_TNE=out, **kw)
    ref = attn.paged_attention_ref(**problem)
    assert torch.isfinite(out).all(), "kernel left rows unwritten or produced NaN"
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


SEQS = [(0, 9), (4, 0), (5, 20), (13, 1)]  # fresh prompt, empty chunk, chunk after a prefix, one token


@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("window", [0, 4, 8, 16])
def test_prefill_fp32_split_head_dim(window, sinks):
    # D=48 splits into 32 + 16; pages of 4 put four pages in one key block (per-row gather)
    p = make_problem(SEQS, 4, 2, 48, 32, 4, window, torch.float32, sinks, seed=window + 100 * sinks)
    check(attn.launch_prefill, p, torch.float32, config=SMALL)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("h_pack,block_n,page_size", [(1, 32, 8), (4, 16, 16), (2, 16, 32)])
def test_prefill_gqa4_packed_heads(window, h_pack, block_n, page_size):
    # GQA 4; packing h_pack heads per program; block_n > page (gather) and block_n | page (one page)
    p = make_problem([(3, 17), (0, 6), (21, 12)], 8, 2, 32, 16, page_size, window, torch.float32, True,
                     seed=7 * h_pack + window)
    cfg = attn.PrefillConfig(block_m=16, block_n=block_n, h_pack=h_pack, num_warps=4, num_stages=2)
    check(attn.launch_prefill, p, torch.float32, config=cfg)


@pytest.mark.parametrize("window", [0, 16])
def test_prefill_bf16_model_head_dims(window):
    # the model's D=192 (128 + 64) and E=128, GQA 4, prefix > 0, bf16
    p = make_problem([(0, 33), (40, 7)], 4, 1, 192, 128, 16, window, torch.bfloat16, True, seed=window)
    check(attn.launch_prefill, p, torch.bfloat16, config=SMALL)


def test_prefill_public_default_config():
    # paged_attention's own tile choice: the production tiles on CUDA, the interpreter's on CPU
    if DEVICE == "cuda":
        seqs, heads = [(0, 300), (77, 129), (500, 1), (1000, 64)], (16, 2)
    else:
        seqs, heads = [(0, 20), (11, 9)], (4, 2)
    for window, sinks in [(0, False), (128, True), (16, True)]:
        p = make_problem(seqs, *heads, 192, 128, 16, window, torch.bfloat16, sinks, seed=window)
        out = attn.paged_attention(**p)
        err = ((out.float() - attn.paged_attention_ref(**p).float()).abs().max()).item()
        assert torch.isfinite(out).all() and err <= TOL[torch.bfloat16] * 10, err


@pytest.mark.parametrize("seed", range(6))
def test_prefill_random_configs(seed):
    # random ragged batches, windows (1 = only the token itself), odd page sizes, tiles and
    # head packing, with q a strided view of a fused qkv buffer as the model produces it
    rng = torch.Generator().manual_seed(1000 + seed)
    pick = lambda xs: xs[torch.randint(len(xs), (1,), generator=rng).item()]  # noqa: E731
    seqs = [(pick([0, 0, 3, 17, 40]), pick([0, 1, 5, 16, 23, 37])) for _ in range(pick([1, 2, 3, 4]))]
    seqs[0] = (seqs[0][0], max(seqs[0][1], 1))
    num_kv_heads, gqa = pick([1, 2]), pick([1, 2, 4])
    cfg = attn.PrefillConfig(block_m=pick([16, 32]), block_n=pick([16, 32]), h_pack=pick([1, 2, 4][: gqa.bit_length()]),
                             num_warps=4, num_stages=2)
    window = pick([0, 1, 5, 16, 33])
    p = make_problem(seqs, num_kv_heads * gqa, num_kv_heads, 48, 32, pick([4, 5, 16, 32]), window,
                     torch.float32, seed % 2 == 0, seed=seed)
    q = p["q_TND"]
    qkv = torch.randn(q.shape[0], 2 * q.shape[1], q.shape[2], device=q.device)
    qkv[:, : q.shape[1]] = q
    p["q_TND"] = qkv[:, : q.shape[1]]
    check(attn.launch_prefill, p, torch.float32, config=cfg)


@pytest.mark.parametrize("seed", range(4))
def test_decode_random(seed):
    rng = torch.Generator().manual_seed(2000 + seed)
    lens = torch.randint(1, 90, (torch.randint(1, 5, (1,), generator=rng).item(),), generator=rng).tolist()
    window = [0, 1, 7, 32][seed]
    p = make_problem([(n - 1, 1) for n in lens], 8, 2, 32, 32, [3, 8, 16, 64][seed], window, torch.float32,
                     seed % 2 == 1, seed=seed)
    check(attn_decode.launch_decode, p, torch.float32, config=attn_decode.DecodeConfig(block_n=16, num_splits=[1, 2, 5, 8][seed]))


@pytest.mark.parametrize("window,page_size,dtype", [
    (w, s, torch.bfloat16) for w in (0, 16, 128) for s in (16, 128)] + [(0, 128, torch.float32)])
def test_prefill_production_tiles(window, page_size, dtype):
    # the CUDA tile configs (128 x 128 full, 64 x 32 with 8 packed heads for SWA, 64 x 32 for
    # full fp32), interpreted on CPU; pages of 128 hold whole key blocks (page read a step
    # ahead), pages of 16 do not
    cfg = attn.default_prefill_config(16, 2, window, on_cuda=True, page_size=page_size, dtype=dtype)
    p = make_problem([(0, 70), (130, 20), (3, 1)], 16, 2, 192, 128, page_size, window, dtype, window > 0,
                     seed=window)
    check(attn.launch_prefill, p, dtype, config=cfg)


# the one-pass sliding-window kernel (kernels/attention/swa.py): fresh prompts, prefixes, an empty chunk,
# one token, chunks shorter than the band (its start clamped at key 0) and longer ones
BAND_SEQS = [(0, 9), (4, 0), (2, 5), (5, 20), (13, 1), (40, 17), (0, 40), (70, 33)]


@pytest.mark.parametrize("window,page_size,sinks,dtype", [
    (1, 4, True, torch.float32), (8, 5, False, torch.float32), (16, 16, True, torch.float32),
    (25, 32, True, torch.float32), (17, 16, True, torch.bfloat16),
])
def test_swa_band_kernel(window, page_size, sinks, dtype):
    # the default config of this device (interpreted on CPU: 8 tokens, a band of 16 + 16 keys, so
    # windows up to 25 fit; 16 and above exercise tile A's causal-only mask)
    cfg = attention_swa.default_band_config(8, 2, on_cuda=DEVICE == "cuda")
    assert window <= cfg.max_window()
    p = make_problem(BAND_SEQS, 8, 2, 48, 32, page_size, window, dtype, sinks, seed=window + page_size)
    check(attention_swa.launch_swa_band, p, dtype, config=cfg)


@pytest.mark.parametrize("page_size", [16, 128])
def test_swa_band_production_tiles(page_size):
    # MiMo's SWA layer per kv head (8 query heads each, D=192, E=128, window 128, sinks) with the
    # CUDA config: 16 tokens x 8 heads, a band of 128 + 16 keys, slices of 64
    cfg = attention_swa.default_band_config(16, 2, on_cuda=True)
    assert (cfg.block_m, cfg.h_pack, cfg.max_window()) == (128, 8, 129)
    p = make_problem([(0, 70), (130, 20), (3, 1), (200, 45)], 16, 2, 192, 128, page_size, 128, torch.bfloat16, True,
                     seed=page_size)
    check(attention_swa.launch_swa_band, p, torch.bfloat16, config=cfg)


def test_swa_band_rejects_and_dispatch():
    p = make_problem([(5, 20)], 8, 2, 32, 16, 16, 8, torch.float32, True, seed=3)
    cfg = attention_swa.BandConfig(block_m=32, h_pack=4, band_a=16, band_b=16, block_c=16, num_warps=4,
                                   num_stages=1, max_regs=None)
    with pytest.raises(ValueError, match="window 26 > 25"):
        attention_swa.launch_swa_band(**{**p, "window": 26}, config=cfg)
    with pytest.raises(ValueError, match="no sliding window"):
        attention_swa.launch_swa_band(**{**p, "window": 0}, config=cfg)
    with pytest.raises(ValueError, match="h_pack=8"):
        attention_swa.launch_swa_band(**p, config=attention_swa.BandConfig(block_m=64, h_pack=8))
    if DEVICE != "cuda":
        return
    # on CUDA paged_attention takes the band kernel for windows that fit, the loop kernel beyond
    p = make_problem([(0, 70), (130, 20)], 16, 2, 192, 128, 128, 128, torch.bfloat16, True, seed=4)
    assert torch.equal(attn.paged_attention(**p), attention_swa.launch_swa_band(**p))
    p = make_problem([(0, 70), (130, 200)], 16, 2, 192, 128, 128, 130, torch.bfloat16, True, seed=5)
    assert torch.equal(attn.paged_attention(**p), attn.launch_prefill(**p))
    p = make_problem([(0, 70), (130, 20)], 16, 2, 192, 128, 128, 128, torch.float32, True, seed=6)  # fp32: loop
    assert torch.equal(attn.paged_attention(**p), attn.launch_prefill(**p))


def _ws_or_skip(p):
    reason = attention_ws.unsupported_reason(p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], p["window"])
    if reason is not None:
        pytest.skip(f"warp-specialised kernel not available: {reason}")


# fresh prompts, prefixes, an empty chunk, one token, lengths off the 64-token and 128-key grids
WS_SEQS = [(0, 200), (130, 70), (4, 0), (3, 1), (300, 64), (0, 129), (255, 300)]


@pytest.mark.parametrize("head_d,page_size,sinks,dtype", [
    (192, 128, False, torch.bfloat16), (192, 256, True, torch.bfloat16), (128, 128, True, torch.float16),
    (64, 128, False, torch.bfloat16),
])
def test_prefill_ws_kernel(head_d, page_size, sinks, dtype):
    p = make_problem(WS_SEQS, 16, 2, head_d, 128, page_size, 0, dtype, sinks, seed=head_d + page_size)
    _ws_or_skip(p)
    check(attention_ws.launch_prefill_ws, p, torch.bfloat16)


def test_prefill_ws_dispatch():
    # paged_attention runs the Gluon kernel for full attention it supports, the Triton one otherwise
    p = make_problem(WS_SEQS[:3], 16, 2, 192, 128, 128, 0, torch.bfloat16, False, seed=1)
    _ws_or_skip(p)
    assert torch.equal(attn.paged_attention(**p), attention_ws.launch_prefill_ws(**p))
    # q whose heads are not contiguous rows (a slice of a wider projection): Triton, still correct
    q_wide = torch.randn(p["q_TND"].shape[0], 16, 256, device=DEVICE, dtype=torch.bfloat16)
    q_wide[..., :192] = p["q_TND"]
    p_view = {**p, "q_TND": q_wide[..., :192]}
    assert "q_TND" in attention_ws.unsupported_reason(p_view["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], 0)
    assert torch.equal(attn.paged_attention(**p_view), attn.launch_prefill(**p))
    windowed = make_problem(WS_SEQS[:3], 16, 2, 192, 128, 128, 16, torch.bfloat16, True, seed=2)
    with pytest.raises(ValueError, match="sliding window"):
        attention_ws.launch_prefill_ws(**windowed)


def test_ws_unsupported_reasons():
    # runs everywhere: what keeps the Gluon kernel off a call is named
    p = make_problem([(2, 3)], 4, 2, 32, 16, 4, 0, torch.float32, False, seed=0)
    reason = attention_ws.unsupported_reason(p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], 0)
    assert reason is not None and reason
    if DEVICE == "cpu":
        assert "sm_90" in reason or "Gluon" in reason


DECODE_LENS = [1, 17, 40, 64]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("sinks", [True, False])
def test_decode_fp32(num_splits, window, sinks):
    p = make_problem([(n - 1, 1) for n in DECODE_LENS], 4, 2, 48, 32, 4, window, torch.float32, sinks,
                     seed=num_splits + window)
    check(attn_decode.launch_decode, p, torch.float32, config=attn_decode.DecodeConfig(block_n=16, num_splits=num_splits))


@pytest.mark.parametrize("window", [0, 16])
def test_decode_bf16_model_head_dims(window):
    p = make_problem([(n - 1, 1) for n in [5, 70]], 8, 2, 192, 128, 16, window, torch.bfloat16, True,
                     seed=3)
    check(attn_decode.launch_decode, p, torch.bfloat16)  # default split count
    out = attn_decode.paged_decode_attention(**p)
    assert torch.isfinite(out).all()


def test_dispatcher():
    p = make_problem([(5, 1), (0, 1)], 4, 2, 32, 16, 4, 0, torch.float32, True, seed=1)
    ref = attn.paged_attention_ref(**p)
    assert torch.equal(attn.attention(**p, use_reference=True), ref)
    for max_q_len in (None, 1):
        out = attn.attention(**p, max_q_len=max_q_len)
        if DEVICE == "cpu":
            assert torch.equal(out, ref)  # CPU always takes the reference
        else:
            assert ((out - ref).abs().max() / ref.abs().max()).item() <= TOL[torch.float32]


def _bad(p, **changes):
    return {**p, **changes}


def _three_kv_heads(p):
    k, v = p["k_pages_PSGD"][:, :, :1], p["v_pages_PSGE"][:, :, :1]
    return _bad(p, k_pages_PSGD=k.expand(-1, -1, 3, -1).contiguous(), v_pages_PSGE=v.expand(-1, -1, 3, -1).contiguous())


@pytest.mark.parametrize("mutate,match", [
    (lambda p: _bad(p, k_pages_PSGD=p["k_pages_PSGD"][..., :16]), "head dim"),
    (lambda p: _bad(p, page_table_BL=p["page_table_BL"].float()), "page_table_BL.dtype"),
    (lambda p: _bad(p, q_TND=p["q_TND"].transpose(1, 2).contiguous().transpose(1, 2)), "q_TND must be contiguous"),
    (lambda p: _bad(p, cu_q_B1=p["cu_q_B1"][:-1]), "cu_q_B1"),
    (lambda p: _bad(p, sinks_N=p["sinks_N"][:3]), "sinks_N"),
    (lambda p: _bad(p, v_pages_PSGE=p["v_pages_PSGE"].double()), "v_pages_PSGE.dtype"),
    (lambda p: _bad(p, window=-1), "window"),
    (_three_kv_heads, "G=3"),
])
def test_bad_inputs_raise(mutate, match):
    # the launchers check without beartype (production runs unchecked @typed)
    p = make_problem([(2, 3)], 4, 2, 32, 16, 4, 0, torch.float32, True, seed=0)
    with pytest.raises(ValueError, match=match):
        attn.launch_prefill(**mutate(p))


def test_decode_rejects_multi_token_sequences():
    p = make_problem([(2, 3)], 4, 2, 32, 16, 4, 0, torch.float32, True, seed=0)
    with pytest.raises(ValueError, match="one query per sequence"):
        attn_decode.launch_decode(**p)
