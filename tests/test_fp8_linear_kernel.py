"""The few-rows FP8 linear kernel (mimo_fn.kernels.fp8_linear) against the dequantised fp32
product, on fresh random inputs with the output poisoned first; under the interpreter on CPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. at import below

import pytest  # noqa: E402

from mimo_fn.kernels import fp8_linear as fl  # noqa: E402
from mimo_fn.quant import quantize_fp8_act_ref, quantize_fp8_block  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(t: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x_TK = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    w = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g))
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    return q_TK.to(DEV), s_TG.to(DEV), w.data.to(DEV), w.scale.to(DEV), w


@pytest.mark.parametrize("t,k,n,splits", [
    (1, 256, 128, 1),  # one row, aligned
    (5, 384, 200, 2),  # N off 128 (a partial weight block), split K
    (16, 200, 96, None),  # K off 128 (a partial group), one BLOCK_M tile
    (19, 640, 136, 3),  # two row tiles, uneven slices (5 K blocks over 3)
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantised_product(t, k, n, splits, out_dtype, monkeypatch):
    q_TK, s_TG, w_NK, ws, w = _case(t, k, n, seed=t * 1000 + k + n)
    poison = torch.full((t, n), float("nan"), dtype=out_dtype, device=DEV)
    monkeypatch.setattr(fl.torch, "empty", lambda *a, **kw: poison if a == (t, n) else torch.full(
        a, float("nan"), dtype=kw.get("dtype"), device=kw.get("device")))
    y_TN = fl.fp8_linear(q_TK, s_TG, w_NK, ws, out_dtype, splits=splits)
    monkeypatch.undo()
    assert y_TN.shape == (t, n) and y_TN.dtype == out_dtype and not y_TN.isnan().any()
    ref = fl.fp8_linear_ref(q_TK.cpu(), s_TG.cpu(), w.data, w.scale, torch.float32)  # fp32, one matmul over K
    tol = 1e-5 if out_dtype == torch.float32 else 2**-8  # fp32: the order of sums; bf16: one rounding
    torch.testing.assert_close(y_TN.float().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_strided_scales_and_split_invariance():
    """M-major activation scales (a gathered packet's layout) give the same bits, and so does any
    number of K slices in fp32 up to the order of the slices' sums."""
    q_TK, s_TG, w_NK, ws, _ = _case(8, 512, 192, seed=3)
    y = fl.fp8_linear(q_TK, s_TG, w_NK, ws, torch.float32, splits=1)
    assert torch.equal(fl.fp8_linear(q_TK, s_TG.t().contiguous().t(), w_NK, ws, torch.float32, splits=1), y)
    for splits in (2, 4):
        torch.testing.assert_close(fl.fp8_linear(q_TK, s_TG, w_NK, ws, torch.float32, splits=splits), y,
                                   rtol=1e-6, atol=1e-6 * y.abs().max().item())
    assert fl.num_splits(1, 768, 4096, 132) == 22 and fl.num_splits(1, 12288, 4096, 132) == 2
    assert fl.num_splits(64, 12288, 4096, 132) == 1  # 768 tiles already


def test_bad_inputs_raise():
    q_TK, s_TG, w_NK, ws, _ = _case(2, 256, 128, seed=4)
    with pytest.raises(ValueError, match="float8"):
        fl.fp8_linear(q_TK.float(), s_TG, w_NK, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        fl.fp8_linear(q_TK, s_TG, w_NK, ws[:, :1], torch.bfloat16)
    k = 2**15  # a weight of 2^31 elements (on the meta device: nothing allocated) would wrap int32 offsets
    meta = {"dtype": q_TK.dtype, "device": "meta"}
    with pytest.raises(ValueError, match="2\\^31 elements"):
        fl.fp8_linear(torch.empty(2, k, **meta), torch.empty(2, k // 128, device="meta"), torch.empty(2**16, k, **meta),
                      torch.empty(512, k // 128, device="meta"), torch.bfloat16)


def test_linears_of_one_input_share_one_quantisation(monkeypatch):
    """Where `linear` runs this kernel (a scaled_mm GPU, <= SMALL_M_ROWS rows), quantize_once
    hands q / k / v (or gate / up) one QActs: the same outputs as each linear quantising x. From
    SMALL_M_ROWS + 1 rows on it keeps scaled_mm's padded buffers instead."""
    import mimo_fn.layers.linear as lin
    from mimo_fn.quant import QActs

    monkeypatch.setattr(lin, "default_backend", lambda device: "scaled_mm_v2")  # as on an H200
    g = torch.Generator().manual_seed(7)
    x_TK = torch.randn(3, 256, generator=g).to(torch.bfloat16).to(DEV)
    ws = [quantize_fp8_block(torch.randn(n, 256, generator=g) * 0.02) for n in (192, 64)]
    ws = [type(w)(w.data.to(DEV), w.scale.to(DEV), w.fmt) for w in ws]
    shared = lin.quantize_once(x_TK, tuple(ws))
    assert isinstance(shared, QActs)
    for w in ws:
        assert torch.equal(lin.linear(shared, w), lin.linear(x_TK, w))
    many = x_TK.repeat(6, 1)  # 18 rows: scaled_mm, whose padded buffers it keeps whole (test_linear.py)
    shared = lin.quantize_once(many, tuple(ws))
    assert isinstance(shared, QActs) and shared.q.shape == (18, 256) and shared.q.untyped_storage().nbytes() == 128 * 256
    if lin._block_scaled_mm_available(torch.device(DEV)):  # the real scaled_mm
        for w in ws:
            assert torch.equal(lin.linear(shared, w), lin.linear(many, w))
    assert lin.quantize_once(x_TK, (ws[0], torch.ones(4, 256, device=DEV))) is x_TK  # a plain weight
