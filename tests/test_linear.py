"""linear / linear_fp8 against a plain-torch simulation of W8A8 FP8 block quantisation.

Legend: T tokens, K input features, N output features, G = ceil(K / 128).

The simulation quantises the weight (128x128 blocks) and the activations (1x128 per
token) with the reference formats, dequantises both and multiplies in fp32. On CPU this
checks the dequant fallback; on an sm90 GPU every scaled_mm backend torch offers.
"""

import pytest
import torch
import torch.nn.functional as F

from mimo_fn.kernels.fp8_quant import (
    packet_bytes_per_row,
    quant_fp8_act,
    quant_fp8_into_packet,
    quant_fp8_into_packet_ref,
    unpack_packet,
)
from mimo_fn.layers.linear import (
    BACKENDS, _has_scaled_mm_v2, _scaled_mm_operands, _whole_rows, default_backend, linear, linear_fp8, quantize_once,
)
from mimo_fn.quant import QActs, dequantize, dequantize_fp8_act, quantize_fp8_act_ref, quantize_fp8_block

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_SM90 = default_backend(DEVICE) != "dequant"

SHAPES = [  # (T, K, N): aligned, K and N off 128, Kb % 4 != 0 (L4 padding), N % 16 != 0, odd T
    (1, 128, 128),
    (64, 512, 256),
    (37, 200, 192),
    (130, 640, 1000),
    (5, 1024, 384),
    (300, 512, 256),  # M > 128 and off a multiple of 128
    (256, 640, 1000),
]


def _backends() -> list[str]:
    if not ON_SM90:
        return ["dequant"]
    return [b for b in BACKENDS if b != "scaled_mm_v2" or _has_scaled_mm_v2()]


def _simulate(x_TK: torch.Tensor, w) -> torch.Tensor:
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    return dequantize_fp8_act(q_TK, s_TG, torch.float32) @ dequantize(w, torch.float32).T


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def _inputs(t: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x_TK = torch.randn(t, k, generator=g).to(torch.bfloat16).to(DEVICE)
    w_NK = (torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g)).to(torch.bfloat16).to(DEVICE)
    return x_TK, quantize_fp8_block(w_NK)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("t,k,n", SHAPES)
def test_fp8_linear_matches_simulation(t, k, n, backend):
    x_TK, w = _inputs(t, k, n, seed=t + k + n)
    y_TN = linear(x_TK, w, backend=backend)
    assert y_TN.shape == (t, n) and y_TN.dtype == torch.bfloat16 and y_TN.is_contiguous()
    ref = _simulate(x_TK, w)
    assert _rel_err(y_TN, ref) <= 1e-2
    assert (y_TN.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("backend", _backends())
def test_linear_fp8_prequantised_equals_linear(backend):
    """Gathered activations (strided packet views, row-major scales) give linear's result exactly."""
    t, k, n = 36, 512, 384
    x_TK, w = _inputs(t, k, n, seed=9)
    packet = torch.empty(t, packet_bytes_per_row(k), dtype=torch.uint8, device=DEVICE)
    quant = quant_fp8_into_packet if DEVICE.type == "cuda" else quant_fp8_into_packet_ref
    q_TK, s_TG = unpack_packet(quant(x_TK, packet), k)
    assert q_TK.stride() == (packet.shape[1], 1)  # strided views into the packet
    y_TN = linear_fp8(q_TK, s_TG, w, torch.bfloat16, backend=backend)
    assert torch.equal(y_TN, linear(x_TK, w, backend=backend))
    y2 = linear_fp8(q_TK, s_TG.t().contiguous().t(), w, torch.bfloat16, backend=backend)  # M-major scales
    assert torch.equal(y2, y_TN)


@pytest.mark.skipif(not ON_SM90, reason="the scaled_mm path needs an sm90 GPU (the CPU dequantises)")
@pytest.mark.parametrize("backend", [b for b in _backends() if b != "triton"])
def test_scaled_mm_reads_a_row_strided_packet_without_a_copy(backend):
    """A gathered packet's q (row stride R = H + 4G) goes into scaled_mm as it is: the call makes
    as many allocations as with a contiguous q (a .contiguous() copy would be one more), same bits."""
    t, k, n = 256, 512, 384
    x_TK, w = _inputs(t, k, n, seed=11)
    packet = quant_fp8_into_packet(x_TK, torch.empty(t, packet_bytes_per_row(k), dtype=torch.uint8, device=DEVICE))
    q_TK, s_TG = unpack_packet(packet, k)
    s_TG = s_TG.t().contiguous().t()  # M-major, as the gather hands it on
    dense_TK = q_TK.contiguous()
    assert q_TK.stride() == (packet.shape[1], 1) and packet.shape[1] % 16 == 0

    def allocations(q):
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        y = linear_fp8(q, s_TG, w, torch.bfloat16, backend=backend)
        torch.cuda.synchronize()
        return y, torch.cuda.memory_stats()["allocation.all.allocated"] - before

    allocations(q_TK)  # warm: cuBLAS workspaces, weight operands
    y_strided, n_strided = allocations(q_TK)
    y_dense, n_dense = allocations(dense_TK)
    assert n_strided == n_dense
    assert torch.equal(y_strided, y_dense)


def test_plain_weight_and_leading_dims():
    x = torch.randn(2, 3, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    assert torch.equal(linear(x, w), F.linear(x, w))
    wq = quantize_fp8_block(w)
    y = linear(x, wq)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert torch.allclose(y.reshape(6, 32), linear(x.reshape(6, 64), wq))


def test_mxfp4_weight_dequantised_into_x_dtype():
    """An MXFP4 weight: F.linear on the weight dequantised into x's dtype (any leading dims), also
    from pre-quantised FP8 activations; quantize_once leaves x alone for it (no FP8 GEMM reads it)."""
    from mimo_fn.layers.linear import quantize_once
    from mimo_fn.quant import QActs, quantize_mxfp4

    w = quantize_mxfp4(torch.randn(48, 64, device=DEVICE) * 0.02)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 64, device=DEVICE, dtype=dtype)
        y = linear(x, w)
        assert y.dtype == dtype and torch.equal(y, F.linear(x, dequantize(w, dtype)))
    x_TK = torch.randn(5, 64, device=DEVICE)
    assert quantize_once(x_TK, (w,)) is x_TK
    acts = QActs(*quantize_fp8_act_ref(x_TK), torch.float32)
    assert torch.equal(linear(acts, w), F.linear(dequantize_fp8_act(acts.q, acts.scale, torch.float32),
                                                 dequantize(w, torch.float32)))
    with pytest.raises(ValueError, match=r"x has K=32 features, MXFP4 weight must be \[N, K\], got \[48, 64\]"):
        linear(x_TK[:, :32], w)


def test_empty_batch():
    x_TK, w = _inputs(1, 256, 128, seed=0)
    assert linear(x_TK[:0], w).shape == (0, 128)


def test_bad_inputs_raise():
    x_TK, w = _inputs(4, 256, 128, seed=1)
    with pytest.raises(ValueError, match="K=200"):
        linear(x_TK[:, :200], w)
    with pytest.raises(ValueError, match="backend"):
        linear(x_TK, w, backend="cutlass")
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    with pytest.raises(ValueError, match="float32 scale"):
        linear_fp8(q_TK, s_TG.double(), w)


# --- CPU check of the scaled_mm operand layouts ------------------------------------------
# Without an sm90 GPU, stand in for torch's block-scaled GEMMs with an emulator that
# applies the shape / stride rules torch enforces (ScaledBlas.cpp: 1x128 x 128x128) and
# computes the same product, so the padding and scale layouts are checked everywhere.


def _expand(scale: torch.Tensor, rows: int, cols: int, block_r: int) -> torch.Tensor:
    return scale.repeat_interleave(block_r, 0).repeat_interleave(128, 1)[:rows, :cols]


def _emulated_scaled_mm(a, b, scale_a, scale_b, v2: bool, out_dtype):
    (m, k), n = a.shape, b.shape[1]
    kb, nb = -(-k // 128), -(-n // 128)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == 1 and b.stride(0) == 1
    assert k % 16 == 0 and n % 16 == 0 and k % 128 == 0 and m % 128 == 0  # the last two: linear's own guards
    assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1 and (scale_a.stride(1) == m or kb == 1)
    rows_b = -(-kb // 4) * 4 if v2 else kb  # v2 wants the L4-padded weight scale
    assert v2 or kb % 4 == 0  # v1 is only safe with Kb % 4 == 0
    assert scale_b.shape == (rows_b, nb) and scale_b.stride(0) == 1 and (scale_b.stride(1) == rows_b or nb == 1)
    a_f = a.float() * scale_a.repeat_interleave(128, 1)[:, :k]
    b_f = b.float() * _expand(scale_b.t(), n, k, 128).t()
    return (a_f @ b_f).to(out_dtype)


@pytest.mark.skipif(ON_SM90, reason="the real GEMMs run on this machine")
@pytest.mark.parametrize("backend", ["scaled_mm_v2", "scaled_mm_v1"])
@pytest.mark.parametrize("t,k,n", SHAPES)
def test_scaled_mm_layouts_on_emulator(t, k, n, backend, monkeypatch):
    import mimo_fn.kernels.fp8_quant as fq

    def quant_ref(x_TK, num_rows, num_cols):  # the reference quantiser, in the kernel's output layout
        q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn)
        s = torch.empty(-(-num_cols // 128), num_rows).t()
        return fq.quant_fp8_act_into_ref(x_TK, q, s)

    monkeypatch.setattr(fq, "quant_fp8_act", quant_ref)
    v2_args = {}

    def v2(a, b, sa, ra, sb, rb, output_dtype):
        v2_args["recipes"] = (ra, rb)
        return _emulated_scaled_mm(a, b, sa, sb, True, output_dtype)

    def v1(a, b, scale_a, scale_b, out_dtype):
        return _emulated_scaled_mm(a, b, scale_a, scale_b, False, out_dtype)

    monkeypatch.setattr(F, "scaled_mm", v2, raising=False)
    monkeypatch.setattr(torch, "_scaled_mm", v1)
    x_TK, w = _inputs(t, k, n, seed=t * k + n)
    y_TN = linear(x_TK, w, backend=backend)
    assert y_TN.shape == (t, n) and y_TN.is_contiguous()
    ref = _simulate(x_TK, w)
    assert _rel_err(y_TN, ref) <= 1e-2
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    assert torch.equal(linear_fp8(q_TK, s_TG, w, backend=backend), y_TN)
    if backend == "scaled_mm_v2":
        assert [r.name for r in v2_args["recipes"]] in (
            ["BlockWise1x128", "BlockWise128x128"],
            ["Blockwise_1x128", "Blockwise_128x128"],
        )


# --- quantize_once on the scaled_mm backends: one padded quantisation for q / k / v ------------


def _qkv(t: int, seed: int, k: int = 512, ns: tuple[int, ...] = (256, 128, 128)):
    """x and three FP8 weights of one input, MiMo's q / k / v scaled down (K = H = 4096 there)."""
    g = torch.Generator().manual_seed(seed)
    x_TK = (torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4).to(torch.bfloat16).to(DEVICE)
    ws = tuple(quantize_fp8_block((torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)) for n in ns)
    return x_TK, ws


@pytest.mark.parametrize("backend", ["scaled_mm_v2", "scaled_mm_v1"])
@pytest.mark.parametrize("t", [200, 256, 1])
def test_quantize_once_keeps_the_padded_buffers_whole(t, backend):
    """quantize_once's QActs are row views of one padded quantisation, which _whole_rows widens back
    with no copy to exactly the buffers `linear` quantises into itself (the same bytes)."""
    x_TK, ws = _qkv(t, seed=t)
    k, tp = x_TK.shape[1], -(-t // 128) * 128
    acts = quantize_once(x_TK, ws, backend=backend)
    assert isinstance(acts, QActs) and acts.dtype == x_TK.dtype
    assert acts.q.shape == (t, k) and acts.scale.shape == (t, k // 128)
    assert acts.q._base is not None and acts.q._base.shape == (tp, k)  # views of the padded buffers
    assert acts.scale._base is not None and acts.scale._base.shape == (k // 128, tp)
    whole = _whole_rows(acts.q, acts.scale, tp, k)
    assert whole is not None
    q_MK, scale_MG = whole
    assert q_MK.data_ptr() == acts.q.data_ptr() and scale_MG.data_ptr() == acts.scale.data_ptr()  # no copy
    assert q_MK.shape == (tp, k) and q_MK.stride() == (k, 1)
    assert scale_MG.shape == (tp, k // 128) and scale_MG.stride() == (1, tp)
    ops = _scaled_mm_operands(acts.q, acts.scale, backend)  # what linear_fp8 hands scaled_mm
    assert [o.data_ptr() for o in ops] == [q_MK.data_ptr(), scale_MG.data_ptr()]
    own_q, own_s = quant_fp8_act(x_TK, tp, k)  # linear's own quantisation
    assert torch.equal(q_MK.view(torch.uint8), own_q.view(torch.uint8)) and torch.equal(scale_MG, own_s)
    # the quantiser writes the padded rows: zero q and the finite scale of an all-zero row
    zero_scale = quantize_fp8_act_ref(torch.zeros(1, 128, device=DEVICE))[1][0, 0]
    assert not q_MK[t:].view(torch.uint8).any() and bool((scale_MG[t:] == zero_scale).all())


def test_whole_rows_refuses_other_tensors():
    """Anything but a row-prefix view with the room for Tp rows stays as it is (None): fresh tensors,
    column-cropped views (their neighbour columns would enter every row's sum), a gathered packet,
    and views whose storage ends before row Tp (the check counts the view's offset)."""
    t, k, tp = 200, 512, 256
    x_TK, _ = _qkv(t, seed=3)
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    assert _whole_rows(q_TK, s_TG, tp, k) is None
    assert _whole_rows(q_TK, s_TG.t().contiguous().t(), tp, k) is None  # M-major, but only T rows
    q_MK, s_MG = quant_fp8_act(x_TK, tp, k)
    assert _whole_rows(q_MK[:t], s_MG[:t], tp, k) is not None
    assert _whole_rows(q_MK[:t], s_TG, tp, k) is None and _whole_rows(q_TK, s_MG[:t], tp, k) is None
    assert _whole_rows(q_MK[:t, :384], s_MG[:t, :3], tp, 384) is None  # row stride 512, not 384
    assert _whole_rows(q_MK[1:t + 1], s_MG[1:t + 1], tp, k) is None  # from row 1: Tp rows overrun
    q_more, s_more = quant_fp8_act(x_TK, tp + 1, k)  # room for Tp rows after the offset, strides not
    assert _whole_rows(q_more[1:t + 1], s_more[1:t + 1], tp, k) is None
    q_room = torch.empty((tp + 1) * k, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    q_off = q_room[k:].view(tp, k)[:t]  # offset one row, room for exactly Tp rows
    assert _whole_rows(q_off, s_MG[:t], tp, k)[0].data_ptr() == q_off.data_ptr()
    assert _whole_rows(q_room[k + 16:].as_strided((t, k), (k, 1)), s_MG[:t], tp, k) is None  # 16 bytes short
    packet = quant_fp8_into_packet_ref(x_TK, torch.empty(t, packet_bytes_per_row(k), dtype=torch.uint8,
                                                         device=DEVICE))
    assert _whole_rows(*unpack_packet(packet, k), tp, k) is None


def test_quantize_once_leaves_x_where_no_shared_quantisation_fits():
    x_TK, ws = _qkv(200, seed=4, k=256)
    assert quantize_once(x_TK, ws, backend="scaled_mm_v1") is x_TK  # v1 pads K = 256 to 512
    assert quantize_once(x_TK, ws, backend="dequant") is x_TK
    empty = x_TK[:0]
    assert quantize_once(empty, ws, backend="scaled_mm_v2") is empty  # no rows: nothing to share
    _, other = _qkv(200, seed=4, k=384)
    assert quantize_once(x_TK, (ws[0], other[0]), backend="scaled_mm_v2") is x_TK  # a weight of another K
    acts = quantize_once(x_TK, ws, backend="scaled_mm_v2")
    assert quantize_once(acts, ws, backend="scaled_mm_v2") is acts


@pytest.mark.skipif(ON_SM90, reason="the real GEMMs run on this machine")
@pytest.mark.parametrize("backend", ["scaled_mm_v2", "scaled_mm_v1"])
def test_quantize_once_on_emulator_equals_per_linear_quantisation(backend, monkeypatch):
    """q / k / v from one quantize_once equal three linears that each quantise x, and scaled_mm
    reads the shared buffers themselves (the emulator sees their data pointers)."""
    seen = []

    def v2(a, b, sa, ra, sb, rb, output_dtype):
        seen.append((a.data_ptr(), sa.data_ptr(), a.shape))
        return _emulated_scaled_mm(a, b, sa, sb, True, output_dtype)

    def v1(a, b, scale_a, scale_b, out_dtype):
        seen.append((a.data_ptr(), scale_a.data_ptr(), a.shape))
        return _emulated_scaled_mm(a, b, scale_a, scale_b, False, out_dtype)

    monkeypatch.setattr(F, "scaled_mm", v2, raising=False)
    monkeypatch.setattr(torch, "_scaled_mm", v1)
    x_TK, ws = _qkv(200, seed=5)
    acts = quantize_once(x_TK, ws, backend=backend)
    for w in ws:
        y_TN = linear(acts, w, backend=backend)
        assert seen[-1] == (acts.q.data_ptr(), acts.scale.data_ptr(), (256, 512))  # widened, not copied
        assert torch.equal(y_TN, linear(x_TK, w, backend=backend))
        assert y_TN.shape == (200, w.shape[0]) and not y_TN.isnan().any()


@pytest.mark.skipif(not ON_SM90, reason="the scaled_mm path needs an sm90 GPU (the CPU dequantises)")
@pytest.mark.parametrize("backend", [None] + [b for b in _backends() if b.startswith("scaled_mm")])
def test_quantize_once_shares_one_quantisation_on_scaled_mm(backend):
    """On the GPU: q / k / v (MiMo's K, smaller N) through one quantize_once give three separate
    linears' bits, and each GEMM allocates no more than from whole padded buffers (no copy)."""
    x_TK, ws = _qkv(200, seed=6, k=4096, ns=(1024, 512, 512))
    acts = quantize_once(x_TK, ws, backend=backend)
    assert isinstance(acts, QActs) and acts.q.shape == (200, 4096)
    q_MK, s_MG = _whole_rows(acts.q, acts.scale, 256, 4096)

    def allocations(q, s, w):
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        y = linear_fp8(q, s, w, torch.bfloat16, backend=backend)
        torch.cuda.synchronize()
        return y, torch.cuda.memory_stats()["allocation.all.allocated"] - before

    for w in ws:
        assert torch.equal(linear(acts, w, backend=backend), linear(x_TK, w, backend=backend))
        allocations(acts.q, acts.scale, w)  # warm: cuBLAS workspaces, weight operands
        (y_views, n_views), (y_whole, n_whole) = allocations(acts.q, acts.scale, w), allocations(q_MK, s_MG, w)
        assert n_views == n_whole and torch.equal(y_views, y_whole[:200])
