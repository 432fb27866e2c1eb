"""The warp-specialised FP8 MoE down GEMM (mimo_fn.kernels.moe.down_ws) and its opt-in in gemm.py.

Gluon has no interpreter: on any machine the kernel is compiled for sm_90 ahead of time (in a
process of its own, without TRITON_INTERPRET: tests/compile_util.py) and the PTX and ptxas's report
are read, as tests/test_fp8_gemm_ws.py does. Numerics run on a Hopper GPU only, against a float64
dequantise-and-matmul per pair on fresh random inputs, the output poisoned first.

    python tests/test_moe_down_ws.py   # the compile probe alone, e.g. under another Triton
"""

import contextlib
import json
import os

import pytest
import torch

from mimo_fn import options
from mimo_fn.kernels.moe import down_ws as dws
from mimo_fn.kernels.moe import gemm as moe_gemm
from mimo_fn.kernels.moe.align import moe_align, moe_align_ref
from mimo_fn.quant import FP8_DTYPE, quantize_fp8_act_ref, quantize_fp8_block

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and dws.HAS_GLUON
GPU_ONLY = pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # fused_moe_fp8's quantiser: compiled on a GPU machine
# Hopper's FP8 MMA accumulates each 128-deep K step at reduced precision: up to ~2^-13 of
# sum_k |h_k w_k| measured on an H200 (test_moe_kernels.FP8_ACC_REL says more); 2^-11 bounds it.
ACC_REL = 2.0**-11


def probe(runtime_like: bool) -> dict:
    """Compile the kernel for sm_90 (no GPU needed); facts of its PTX and of ptxas's report.
    runtime_like: specialised as a launch at MiMo's shapes would be (16-byte aligned pointers,
    integers divisible by 16, the M-major h scales' unit stride a constant), else generic."""

    from mimo_fn.kernels import fp8_gemm_ws as fgw

    fn = dws._moe_down_ws_kernel
    h_layout, w_layout = fgw.descriptor_layouts()
    types = dict(h_desc=f"tensordesc<fp8e4nv[{fgw.HALF_M},{fgw.BLOCK_K}],{h_layout!r}>",
                 w_desc=f"tensordesc<fp8e4nv[{dws.HALF_N},{fgw.BLOCK_K}],{w_layout!r}>",
                 y_ptr="*bf16", hs_ptr="*fp32", ws_ptr="*fp32", topk_w_ptr="*fp32", sorted_ids_ptr="*i32",
                 expert_of_block_ptr="*i32", num_post_pad_ptr="*i32")
    consts = dict(NS=dws.STAGES, GROUP=dws.GROUP_M, CONSUMER_REGS=dws.CONSUMER_REGS, num_warps=4)
    attrs = {}
    if runtime_like:  # H = 4096, I = 2048, M = P + E * 127 rounded to blocks: every integer left divisible by 16
        consts.update(stride_hsm=1, stride_wsk=1)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and n not in ("h_desc", "w_desc", "num_post_pad_ptr")}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    from compile_util import gluon_sm90_facts

    return gluon_sm90_facts(fn, sig, consts, attrs, dws.MAX_REGS)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from compile_util import run_probe

    return run_probe(os.path.abspath(__file__), timeout=300, cache_dir=str(tmp_path_factory.mktemp("triton_cache")))


@pytest.mark.skipif(not dws.HAS_GLUON, reason="Gluon needs Triton >= 3.6")
@pytest.mark.parametrize("variant", ["generic", "runtime_like"])
def test_compiles_for_sm90(compiled, variant):
    compiled = compiled[variant]
    assert compiled["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"], compiled["wgmma"]
    assert compiled["tma"] and all(".2d." in t for t in compiled["tma"]), compiled["tma"]
    assert "24" in compiled["setmaxnreg"], compiled["setmaxnreg"]  # the producer hands its registers back
    assert compiled["waits"] == ["0"], compiled["waits"]  # a partial is scaled once its MMA is done
    assert compiled["shared"] <= 227 * 1024, compiled["shared"]
    log = compiled["ptxas"]
    assert "0 bytes spill stores" in log, log
    assert "serialized" not in log and "C751" not in log, log  # C7514 / C7515: every wgmma made synchronous


# ------------------------------------------------------------------------------- inputs


def _routing(kind: str, t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK int32, weights_TK fp32): balanced or Zipf-skewed distinct experts, ~5% dropped (-1)."""
    if kind == "balanced":
        ids_TK = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    else:
        popularity = 1.0 / torch.arange(1, e + 1, dtype=torch.float32)
        ids_TK = torch.multinomial(popularity.expand(t, e).contiguous(), k, replacement=False, generator=g)
    ids_TK[torch.rand(t, k, generator=g) < 0.05] = -1
    return ids_TK.to(torch.int32), torch.rand(t, k, generator=g) + 0.1


def _case(kind: str, t: int, e: int, k: int, hid: int, inter: int, seed: int):
    """Routing, per-pair FP8 h (q_PI with 1x128 scales s_PG) and block-quantised w2, on CPU."""
    g = torch.Generator().manual_seed(seed)
    ids_TK, weights_TK = _routing(kind, t, e, k, g)
    h_PI = torch.randn(t * k, inter, generator=g) * (torch.rand(t * k, 1, generator=g) * 4 + 0.1)
    q_PI, s_PG = quantize_fp8_act_ref(h_PI)
    w2 = quantize_fp8_block(torch.randn(e, hid, inter, generator=g) * 0.05 * (torch.rand(e, hid, 1, generator=g) + 0.5))
    return ids_TK, weights_TK, q_PI, s_PG, w2


def _slots(al, q_PI: torch.Tensor, s_PG: torch.Tensor, g: torch.Generator):
    """h in the alignment's slot order, as the up GEMM leaves it: [M, I] codes and [M, Ib] scales
    stored [Ib, M] (M-major). Padding slots hold random codes and NaN scales: their rows must not
    reach y."""
    m, dev = al.sorted_ids_M.numel(), al.sorted_ids_M.device
    pair_M = al.sorted_ids_M.long().cpu()
    # slots past num_tokens_post_pad hold garbage ids (moe_align leaves them unwritten)
    real_M = (torch.arange(m) < int(al.num_tokens_post_pad_1)) & (pair_M < al.num_pairs)
    h_MI = torch.randn(m, q_PI.shape[1], generator=g).to(FP8_DTYPE)
    h_MI[real_M] = q_PI[pair_M[real_M]]
    hs_MIb = torch.full((s_PG.shape[1], m), float("nan")).t()
    hs_MIb[real_M] = s_PG[pair_M[real_M]]
    return h_MI.to(dev), hs_MIb.to(dev)


def _reference(ids_TK, weights_TK, q_PI, s_PG, w2) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_PH, bound_PH) in float64 on CPU: y[p] = w_p * dequant(h[p]) @ dequant(W2[e_p]).T, and the
    error a GPU may make there (accumulation, then one bf16 rounding); NaN rows for dropped pairs."""
    h_PI = q_PI.double() * s_PG.double().repeat_interleave(128, dim=1)
    w_EHI = w2.data.double() * w2.scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    ids_P, wt_P = ids_TK.reshape(-1).long(), weights_TK.reshape(-1).double()
    y_PH = torch.full((ids_P.numel(), w_EHI.shape[1]), float("nan"), dtype=torch.float64)
    bound_PH = torch.zeros_like(y_PH)
    for e in ids_P.unique().tolist():
        if e < 0:
            continue
        p = torch.nonzero(ids_P == e).view(-1)
        y_PH[p] = (h_PI[p] @ w_EHI[e].T) * wt_P[p, None]
        bound_PH[p] = ACC_REL * (h_PI[p].abs() @ w_EHI[e].abs().T) * wt_P[p, None]
    return y_PH, bound_PH + 2.0**-8 * y_PH.abs().nan_to_num() + 1e-30


@contextlib.contextmanager
def _poisoned(monkeypatch):
    """torch.empty fills floating tensors with NaN inside the block: unwritten rows show."""
    real = torch.empty

    def empty(*size, **kw):
        out = real(*size, **kw)
        if out.dtype in (torch.float32, torch.bfloat16, torch.float16):
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", empty)
    yield
    monkeypatch.setattr(torch, "empty", real)


def _run(ids_TK, weights_TK, q_PI, s_PG, w2, e: int, seed: int, monkeypatch) -> torch.Tensor:
    al = moe_align(ids_TK.cuda(), e, 128)
    h_MI, hs_MIb = _slots(al, q_PI, s_PG, torch.Generator().manual_seed(seed))
    with _poisoned(monkeypatch):
        return dws.moe_down_fp8_ws(h_MI, hs_MIb, w2.data.cuda(), w2.scale.cuda(), al, weights_TK.cuda(), torch.bfloat16)


# ------------------------------------------------------------------------------- CPU


def test_bad_inputs_raise():
    ids_TK, weights_TK, q_PI, s_PG, w2 = _case("balanced", 3, 4, 2, 256, 256, seed=1)
    al = moe_align_ref(ids_TK, 4, 128)
    h_MI, hs_MIb = _slots(al, q_PI, s_PG, torch.Generator().manual_seed(1))
    args = (h_MI, hs_MIb, w2.data, w2.scale, al, weights_TK, torch.bfloat16)
    with pytest.raises(ValueError, match="block_m is 64, expected 128"):
        al64 = moe_align_ref(ids_TK, 4, 64)
        dws.moe_down_fp8_ws(*_slots(al64, q_PI, s_PG, torch.Generator()), *args[2:4], al64, *args[5:])
    with pytest.raises(ValueError, match="float8"):
        dws.moe_down_fp8_ws(h_MI.bfloat16(), *args[1:])
    with pytest.raises(ValueError, match="float32"):
        dws.moe_down_fp8_ws(h_MI, hs_MIb.double(), *args[2:])
    with pytest.raises(ValueError, match="H a multiple of 256"):  # H = 192
        dws.moe_down_fp8_ws(h_MI, hs_MIb, w2.data[:, :192], w2.scale, *args[4:])
    with pytest.raises(ValueError, match="one per slot"):
        dws.moe_down_fp8_ws(torch.cat([h_MI, h_MI[:128]]), torch.cat([hs_MIb, hs_MIb[:128]]), *args[2:])
    with pytest.raises(ValueError):  # the scale's shape disagrees with h's or w2's
        dws.moe_down_fp8_ws(h_MI, hs_MIb[:, :1], *args[2:])
    with pytest.raises(ValueError, match="one per pair"):
        dws.moe_down_fp8_ws(*args[:5], weights_TK[:2], torch.bfloat16)
    if not ON_HOPPER:  # CPU tensors (or no Gluon): the caller's cue to keep the Triton kernel
        with pytest.raises(ValueError, match="unsupported call"):
            dws.moe_down_fp8_ws(*args)
        assert dws.unsupported_reason(h_MI) is not None and not dws.serves(h_MI, w2.data, 128)


def test_moe_down_takes_it_only_where_it_serves(monkeypatch):
    """_moe_down(ws=True) hands the launch to the WS kernel where `serves` says so, never with a
    forced config or pointer weights, nor in deterministic mode; off by default."""
    taken = []
    monkeypatch.setattr(dws, "serves", lambda h, w2, block_m: block_m == 128)
    monkeypatch.setattr(dws, "moe_down_fp8_ws", lambda *a: taken.append(a) or "ws")
    monkeypatch.setattr(moe_gemm, "_kernel", lambda *a: (_ for _ in ()).throw(RuntimeError("triton")))
    al = moe_align_ref(torch.zeros(2, 1, dtype=torch.int32), 1, 128)
    h = torch.zeros(al.sorted_ids_M.numel(), 128).to(FP8_DTYPE)
    args = (h, None, torch.zeros(1, 128, 128).to(FP8_DTYPE), None, al, torch.ones(2, 1), torch.bfloat16)
    assert moe_gemm._moe_down(*args, ws=True) == "ws" and len(taken) == 1
    for kw in (dict(), dict(ws=True, deterministic=True), dict(ws=True, tma=False), dict(ws=True, cfg=object())):
        with pytest.raises(RuntimeError, match="triton"):  # the Triton path (stubbed)
            moe_gemm._moe_down(*args, **kw)
    al64 = moe_align_ref(torch.zeros(2, 1, dtype=torch.int32), 1, 64)
    with pytest.raises(RuntimeError, match="triton"):
        moe_gemm._moe_down(h[:64], *args[1:4], al64, *args[5:], ws=True)
    assert len(taken) == 1


def test_fused_moe_fp8_reads_the_option_unless_told(monkeypatch):
    seen = []
    monkeypatch.setattr(moe_gemm, "_run_moe", lambda *a, **kw: seen.append(a[-1]) or torch.zeros(2, 128, dtype=a[8]))
    g = torch.Generator().manual_seed(3)
    w = quantize_fp8_block(torch.randn(2, 128, 128, generator=g))
    args = tuple(a.to(DEV) for a in (torch.randn(2, 128, generator=g).bfloat16(), w.data, w.scale, w.data[:, :, :64],
                                     w.scale[:, :, :1], torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)))
    moe_gemm.fused_moe_fp8(*args)  # on by default
    with options.override(moe_down_ws=False):
        moe_gemm.fused_moe_fp8(*args)
        moe_gemm.fused_moe_fp8(*args, down_ws=True)
    moe_gemm.fused_moe_fp8(*args, down_ws=False)
    assert seen == [True, False, True, False]


# ------------------------------------------------------------------------------- GPU


@GPU_ONLY
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
@pytest.mark.parametrize("t,e,inter", [(1, 16, 256), (100, 64, 256), (3000, 16, 256), (3000, 64, 256), (100, 16, 384)])
def test_matches_dequantised_product(kind, t, e, inter, monkeypatch):
    """Every valid pair's row within the FP8 accumulation bound of float64; dropped pairs' rows
    unwritten (NaN); I = 384 takes the odd-K-step tail of the pipeline."""
    seed = t * 7 + e + inter + len(kind)
    ids_TK, weights_TK, q_PI, s_PG, w2 = _case(kind, t, e, 4, 512, inter, seed)
    y_PH = _run(ids_TK, weights_TK, q_PI, s_PG, w2, e, seed, monkeypatch).cpu().double()
    ref_PH, bound_PH = _reference(ids_TK, weights_TK, q_PI, s_PG, w2)
    valid_P = ids_TK.reshape(-1) >= 0
    assert y_PH[~valid_P].isnan().all()
    assert not y_PH[valid_P].isnan().any()
    err_PH = (y_PH[valid_P] - ref_PH[valid_P]).abs()
    assert (err_PH <= bound_PH[valid_P]).all(), float((err_PH / bound_PH[valid_P]).max())


@GPU_ONLY
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
def test_rows_do_not_depend_on_the_token_count(kind, monkeypatch):
    """A pair's row has the same bits in a 3000-token call as in calls over a subset of its tokens
    (other slots, blocks and tile counts)."""
    t, e, k = 3000, 32, 4
    ids_TK, weights_TK, q_PI, s_PG, w2 = _case(kind, t, e, k, 512, 256, seed=11)
    y_TKH = _run(ids_TK, weights_TK, q_PI, s_PG, w2, e, 1, monkeypatch).view(t, k, -1)
    g = torch.Generator().manual_seed(12)
    for sub in (torch.randperm(t, generator=g)[:100], torch.tensor([1234]), torch.arange(2000)):
        q_sub = q_PI.view(t, k, -1)[sub].reshape(len(sub) * k, -1)
        s_sub = s_PG.view(t, k, -1)[sub].reshape(len(sub) * k, -1)
        y_sub = _run(ids_TK[sub], weights_TK[sub], q_sub, s_sub, w2, e, 2, monkeypatch).view(len(sub), k, -1)
        valid = (ids_TK[sub] >= 0).cuda()
        assert torch.equal(y_sub[valid], y_TKH[sub.cuda()][valid])


@GPU_ONLY
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
def test_fused_layer_matches_the_triton_path(kind, monkeypatch):
    """fused_moe_fp8 with the WS down GEMM (by argument and by option) against the Triton down GEMM:
    the same h codes, so only the down GEMM's accumulation and roundings differ."""
    g = torch.Generator().manual_seed(21)
    t, e, k, hid, inter = 2000, 16, 4, 512, 256
    x_TH = torch.randn(t, hid, generator=g).bfloat16().cuda()
    w13 = quantize_fp8_block(torch.randn(e, 2 * inter, hid, generator=g) / hid**0.5)
    w2 = quantize_fp8_block(torch.randn(e, hid, inter, generator=g) / inter**0.5)
    ids_TK, weights_TK = _routing(kind, t, e, k, g)
    args = (x_TH, w13.data.cuda(), w13.scale.cuda(), w2.data.cuda(), w2.scale.cuda(), ids_TK.cuda(), weights_TK.cuda())
    calls = []
    real = dws.moe_down_fp8_ws
    monkeypatch.setattr(dws, "moe_down_fp8_ws", lambda *a: calls.append(1) or real(*a))
    triton_TH = moe_gemm.fused_moe_fp8(*args, block_m=128, down_ws=False).float()
    assert not calls
    ws_TH = moe_gemm.fused_moe_fp8(*args, block_m=128, down_ws=True).float()
    assert len(calls) == 1
    with options.override(moe_down_ws=True):
        assert torch.equal(moe_gemm.fused_moe_fp8(*args, block_m=128).float(), ws_TH)
    assert len(calls) == 2
    assert not ws_TH.isnan().any()
    tol = 2.0**-6 * triton_TH.abs().max().item()  # bf16 y and out roundings + the MMAs' accumulation
    torch.testing.assert_close(ws_TH, triton_TH, rtol=2.0**-6, atol=tol)
    # deterministic mode keeps the Triton kernel whatever down_ws says
    moe_gemm.fused_moe_fp8(*args, deterministic=True, down_ws=True)
    assert len(calls) == 2


if __name__ == "__main__":
    print(json.dumps({"generic": probe(False), "runtime_like": probe(True)}))
