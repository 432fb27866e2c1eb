"""The warp-specialised FP8 GEMM (mimo_fn.kernels.fp8_gemm_ws).

Gluon has no interpreter, so on any machine the kernel is compiled for sm_90 ahead of time (as
test_deterministic_tiles.py does; in a process of its own, without TRITON_INTERPRET) and the PTX
and ptxas's report are read: the MMAs, the TMA loads, the register hand-over, and that ptxas kept
the wgmmas asynchronous (it serialises them all, saying so, if any other instruction touches a
pending MMA's registers) without spilling. The numerics run on a Hopper GPU only, against
fp8_linear_ref on fresh random inputs with the output poisoned first. The ValueErrors raise
before any launch, so they run everywhere.

    python tests/test_fp8_gemm_ws.py   # the compile probe alone, e.g. under another Triton
"""

import json
import os

import pytest
import torch

from mimo_fn.kernels import fp8_gemm_ws as fgw
from mimo_fn.kernels.fp8_linear import fp8_linear_ref
from mimo_fn.quant import quantize_fp8_act_ref, quantize_fp8_block

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and fgw.HAS_GLUON


def probe(runtime_like: bool) -> dict:
    """Compile the kernel for sm_90 (no GPU needed); facts of its PTX and of ptxas's report.
    runtime_like: specialised as a launch at MiMo's shapes would be (16-byte aligned pointers,
    integers divisible by 16, contiguous scales' unit strides as constants), else generic."""

    fn = fgw._fp8_gemm_ws_kernel
    x_layout, w_layout = fgw.descriptor_layouts()
    types = dict(x_desc=f"tensordesc<fp8e4nv[{fgw.HALF_M},{fgw.BLOCK_K}],{x_layout!r}>",
                 w_desc=f"tensordesc<fp8e4nv[{fgw.BLOCK_N},{fgw.BLOCK_K}],{w_layout!r}>",
                 y_ptr="*bf16", xs_ptr="*fp32", ws_ptr="*fp32")
    consts = dict(NS=fgw.STAGES, GROUP=fgw.GROUP_M, CONSUMER_REGS=fgw.CONSUMER_REGS, num_warps=4)
    attrs = {}
    if runtime_like:  # T = 16384, N = 1536, K = 4096: every integer left is a multiple of 16
        consts.update(stride_xsg=1, stride_wsk=1)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and n not in ("x_desc", "w_desc")}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    from compile_util import gluon_sm90_facts

    return gluon_sm90_facts(fn, sig, consts, attrs, fgw.MAX_REGS)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from compile_util import run_probe

    return run_probe(os.path.abspath(__file__), timeout=300, cache_dir=str(tmp_path_factory.mktemp("triton_cache")))


@pytest.mark.skipif(not fgw.HAS_GLUON, reason="Gluon needs Triton >= 3.6")
@pytest.mark.parametrize("variant", ["generic", "runtime_like"])
def test_compiles_for_sm90(compiled, variant):
    compiled = compiled[variant]
    assert compiled["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"], compiled["wgmma"]
    assert compiled["tma"] and all(".2d." in t for t in compiled["tma"]), compiled["tma"]
    assert "24" in compiled["setmaxnreg"], compiled["setmaxnreg"]  # the producer hands its registers back
    assert compiled["waits"] == ["0", "1"], compiled["waits"]  # one MMA stays in flight while the other is scaled
    assert compiled["shared"] <= 227 * 1024, compiled["shared"]
    log = compiled["ptxas"]
    assert "0 bytes spill stores" in log, log
    assert "serialized" not in log and "C751" not in log, log  # C7514 / C7515: every wgmma made synchronous


def _case(t: int, n: int, k: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    x_TK = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    w = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g))
    q_TK, s_TG = quantize_fp8_act_ref(x_TK)
    return q_TK.to(device), s_TG.to(device), w.data.to(device), w.scale.to(device)


def test_bad_inputs_raise():
    q_TK, s_TG, w_NK, ws = _case(2, 256, 256, seed=1, device="cpu")
    with pytest.raises(ValueError, match="multiples of 128"):  # N off 128
        fgw.fp8_gemm_ws(q_TK, s_TG, w_NK[:200], ws, torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):  # K off 128
        fgw.fp8_gemm_ws(q_TK[:, :192], s_TG, w_NK[:, :192], ws, torch.bfloat16)
    with pytest.raises(ValueError, match="float8"):
        fgw.fp8_gemm_ws(q_TK.float(), s_TG, w_NK, ws, torch.bfloat16)
    with pytest.raises(ValueError, match="weight scale"):
        fgw.fp8_gemm_ws(q_TK, s_TG, w_NK, ws[:, :1], torch.bfloat16)
    if not ON_HOPPER:  # CPU tensors (or no Gluon): the caller's cue to fall back
        with pytest.raises(ValueError, match="unsupported call"):
            fgw.fp8_gemm_ws(q_TK, s_TG, w_NK, ws, torch.bfloat16)
        assert fgw.unsupported_reason(q_TK) is not None


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
@pytest.mark.parametrize("t", [1, 100, 1000, 4096])
def test_matches_dequantised_product(t, monkeypatch):
    n, k = 1536, 4096
    q_TK, s_TG, w_NK, ws = _case(t, n, k, seed=t, device="cuda")
    poison = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(fgw.torch, "empty", lambda *a, **kw: poison if a == (t, n) else torch.full(
        a, float("nan"), dtype=kw.get("dtype"), device=kw.get("device")))
    y_TN = fgw.fp8_gemm_ws(q_TK, s_TG, w_NK, ws, torch.bfloat16)
    monkeypatch.undo()
    assert y_TN.data_ptr() == poison.data_ptr() and not y_TN.isnan().any()
    ref = fp8_linear_ref(q_TK, s_TG, w_NK, ws, torch.float32)
    tol = 2**-8  # bf16: one rounding of the fp32 sum
    torch.testing.assert_close(y_TN.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
def test_rows_do_not_depend_on_t():
    """No split-K and one K order: a row's bits are the same in a 4096-row call and in a 100-row one,
    and with strided (M-major) activation scales."""
    q_TK, s_TG, w_NK, ws = _case(4096, 1536, 4096, seed=5, device="cuda")
    y_TN = fgw.fp8_gemm_ws(q_TK, s_TG, w_NK, ws, torch.bfloat16)
    assert torch.equal(fgw.fp8_gemm_ws(q_TK[:100], s_TG[:100], w_NK, ws, torch.bfloat16), y_TN[:100])
    assert torch.equal(fgw.fp8_gemm_ws(q_TK[1000:1001], s_TG[1000:1001], w_NK, ws, torch.bfloat16), y_TN[1000:1001])
    assert torch.equal(fgw.fp8_gemm_ws(q_TK, s_TG.t().contiguous().t(), w_NK, ws, torch.bfloat16), y_TN)


def test_deterministic_fp8_linear_takes_it_by_weight_shape():
    """Deterministic mode's FP8 linear runs this kernel for 128-multiple weights on Hopper at every T
    (so a decode step's rows and a prefill chunk's round alike), fp8_linear's tiles otherwise."""
    from mimo_fn.kernels.fp8_linear import fp8_linear, ws_serves

    device = "cuda" if ON_HOPPER else "cpu"
    q_TK, s_TG, w_NK, ws = _case(300, 256, 384, seed=7, device=device)
    assert ws_serves(q_TK, 256, 384) == ON_HOPPER
    assert not ws_serves(q_TK, 200, 384) and not ws_serves(q_TK, 256, 320)
    if not ON_HOPPER:
        return
    for t in (1, 300):
        y_TN = fp8_linear(q_TK[:t], s_TG[:t], w_NK, ws, torch.bfloat16, deterministic=True)
        assert torch.equal(y_TN, fgw.fp8_gemm_ws(q_TK[:t], s_TG[:t], w_NK, ws, torch.bfloat16))


if __name__ == "__main__":
    print(json.dumps({"generic": probe(False), "runtime_like": probe(True)}))
