"""The warp-specialised bf16 GEMM (mimo_fn.kernels.gemm_ws).

Gluon has no interpreter, so on any machine the kernel is compiled for sm_90 ahead of time (in a
process of its own, without TRITON_INTERPRET) and the PTX and ptxas's report are read: the MMA
instruction, the TMA loads, the register hand-over, and that ptxas kept the wgmmas asynchronous
(it serialises them all, saying so, if any other instruction touches a pending MMA's registers)
without spilling. The numerics run on a Hopper GPU only, against one fp32 torch matmul on fresh
random inputs with the output poisoned first, and so does the check that a row's bits do not
depend on M (and that deterministic `linear` runs this kernel). The ValueErrors raise before any
launch, so they run everywhere.

    python tests/test_gemm_ws.py   # the compile probe alone, e.g. under another Triton
"""

import json
import os

import pytest
import torch

from mimo_fn.kernels import gemm_ws as gw

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and gw.HAS_GLUON


def probe(aligned: bool, dtype: str = "bf16", out: str = "bf16", m_one: bool = False) -> dict:
    """Compile the kernel for sm_90 (no GPU needed); facts of its PTX and of ptxas's report.
    y's pointer is 16-byte aligned as every launch's is (gemm_ws allocates y); aligned: M, N, K
    divisible by 16 too, as a launch at MiMo's shapes specialises them, else generic. dtype / out:
    the operands' and the output's Triton dtypes. m_one: M == 1, which a launch specialises as a constant."""

    fn = gw._gemm_ws_kernel
    x_layout, w_layout = gw.descriptor_layouts(torch.float16 if dtype == "fp16" else torch.bfloat16)
    types = dict(x_desc=f"tensordesc<{dtype}[{gw.HALF_M},{gw.BLOCK_K}],{x_layout!r}>",
                 w_desc=f"tensordesc<{dtype}[{gw.BLOCK_N},{gw.BLOCK_K}],{w_layout!r}>", y_ptr=f"*{out}")
    consts = dict(NS=gw.STAGES, GROUP=gw.GROUP_M, CONSUMER_REGS=gw.CONSUMER_REGS, num_warps=4)
    if m_one:
        consts["M"] = 1
    divisible = ["y_ptr"] + (["M", "N", "K"] if aligned else [])
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in divisible and n not in consts}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    from compile_util import gluon_sm90_facts

    return gluon_sm90_facts(fn, sig, consts, attrs, gw.MAX_REGS)


# what a launch can compile: any M (one row too), bf16 / fp32 output, fp16 operands
VARIANTS = dict(generic=dict(aligned=False), runtime_like=dict(aligned=True), one_row=dict(aligned=False, m_one=True),
                fp32_out=dict(aligned=False, out="fp32"), fp16=dict(aligned=True, dtype="fp16", out="fp16"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    from compile_util import run_probe

    return run_probe(os.path.abspath(__file__), timeout=300, cache_dir=str(tmp_path_factory.mktemp("triton_cache")))


@pytest.mark.skipif(not gw.HAS_GLUON, reason="Gluon needs Triton >= 3.6")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiles_for_sm90(compiled, variant):
    ab = VARIANTS[variant].get("dtype", "bf16").replace("fp", "f")  # PTX spells fp16 f16
    compiled = compiled[variant]
    assert compiled["wgmma"] == [f"wgmma.mma_async.sync.aligned.m64n{gw.BLOCK_N}k16.f32.{ab}.{ab}"], compiled["wgmma"]
    assert compiled["tma"] and all(".2d." in t for t in compiled["tma"]), compiled["tma"]
    assert "24" in compiled["setmaxnreg"], compiled["setmaxnreg"]  # the producer hands its registers back
    assert compiled["waits"] == ["0", "1"], compiled["waits"]  # one MMA stays in flight; 0 ends a tile
    assert compiled["shared"] <= 227 * 1024, compiled["shared"]
    log = compiled["ptxas"]
    assert "0 bytes spill stores" in log, log
    assert "serialized" not in log and "C751" not in log, log  # C7514 / C7515: every wgmma made synchronous


def _case(m: int, n: int, k: int, seed: int, device: str, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x_MK = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    w_NK = torch.randn(n, k, generator=g) * 0.02 * torch.rand(n, 1, generator=g)
    return x_MK.to(device, dtype), w_NK.to(device, dtype)


def test_bad_inputs_raise():
    x_MK, w_NK = _case(2, 256, 128, seed=1, device="cpu")
    with pytest.raises(ValueError, match="multiple of 256.*fixed_gemm"):  # N off 256
        gw.gemm_ws(x_MK, w_NK[:128])
    with pytest.raises(ValueError, match="multiple of 64"):  # K off 64
        gw.gemm_ws(x_MK[:, :96], w_NK[:, :96])
    with pytest.raises(ValueError, match="K=64"):  # K of x and w differ (@typed or gemm_ws says so)
        gw.gemm_ws(x_MK[:, :64], w_NK)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gw.gemm_ws(x_MK.float(), w_NK.float())
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gw.gemm_ws(x_MK, w_NK.half())
    with pytest.raises(ValueError, match="out_dtype"):
        gw.gemm_ws(x_MK, w_NK, torch.int32)
    assert gw.supports(w_NK) and not gw.supports(w_NK[:128]) and not gw.supports(w_NK.float())
    if not ON_HOPPER:  # CPU tensors (or no Gluon): the caller's cue to fall back
        with pytest.raises(ValueError, match="unsupported call"):
            gw.gemm_ws(x_MK, w_NK)
        assert gw.unsupported_reason(x_MK) is not None


def test_deterministic_linear_picks_by_the_weight_and_rows(monkeypatch):
    """`linear`'s deterministic path takes gemm_ws from LARGE_M rows on where the weight fits it (a
    device it runs on: faked here), fixed_gemm below and for any M where it does not (N off 256, fp32)."""
    from mimo_fn.kernels import fixed_gemm as fg
    from mimo_fn.layers.linear import _fixed_linear

    calls = []

    def fake(name):
        return lambda x_MK, w_NK: calls.append(name) or x_MK.new_zeros(x_MK.shape[0], w_NK.shape[0])

    monkeypatch.setattr(gw, "unsupported_reason", lambda x_MK: None)
    monkeypatch.setattr(gw, "gemm_ws", fake("ws"))
    monkeypatch.setattr(fg, "fixed_gemm", fake("fixed"))
    x_MK, w_NK = _case(fg.LARGE_M, 512, 128, seed=2, device="cpu")
    for m, kernel in ((1, "fixed"), (7, "fixed"), (fg.LARGE_M - 1, "fixed"), (fg.LARGE_M, "ws")):
        assert _fixed_linear(x_MK[:m], w_NK).shape == (m, 512) and calls.pop() == kernel
        assert _fixed_linear(x_MK[:m], w_NK[:384]).shape == (m, 384) and calls.pop() == "fixed"
        assert _fixed_linear(x_MK[:m].float(), w_NK.float()).shape == (m, 512) and calls.pop() == "fixed"
    assert _fixed_linear(x_MK.view(2, fg.LARGE_M // 2, -1), w_NK).shape == (2, fg.LARGE_M // 2, 512)
    assert calls == ["ws"]


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
@pytest.mark.parametrize("n, k", [(512, 4096), (768, 4096), (1024, 4096), (1536, 4096), (4096, 8192),
                                  (4096, 16384), (12288, 4096), (16384, 4096), (152576, 4096)])
def test_same_bits_as_fixed_gemm(n, k):
    """What lets deterministic `linear` hand few-row calls to fixed_gemm: on Hopper its rows are
    gemm_ws's bits, at both of its tiles, for every weight shape of MiMo (the slice's and the head)."""
    from mimo_fn.kernels.fixed_gemm import CUDA_TILES, CUDA_TILES_LARGE_M, fixed_gemm

    x_MK, w_NK = _case(300, n, k, seed=n + k, device="cuda")
    y_MN = gw.gemm_ws(x_MK, w_NK)
    assert torch.equal(fixed_gemm(x_MK, w_NK, tiles=CUDA_TILES), y_MN)
    assert torch.equal(fixed_gemm(x_MK, w_NK, tiles=CUDA_TILES_LARGE_M), y_MN)
    assert torch.equal(fixed_gemm(x_MK[7:8], w_NK, tiles=CUDA_TILES), y_MN[7:8])


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 100, 1000, 4096])
def test_matches_fp32_matmul(m, out_dtype, monkeypatch):
    n, k = 1536, 4096
    x_MK, w_NK = _case(m, n, k, seed=m, device="cuda")
    poison = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
    monkeypatch.setattr(gw.torch, "empty", lambda *a, **kw: poison if a == (m, n) else torch.full(
        a, float("nan"), dtype=kw.get("dtype"), device=kw.get("device")))
    y_MN = gw.gemm_ws(x_MK, w_NK, out_dtype)
    monkeypatch.undo()
    assert y_MN.data_ptr() == poison.data_ptr() and not y_MN.isnan().any()
    ref = x_MK.float() @ w_NK.float().T
    # bf16: one rounding of the fp32 sum; fp32: only the order of fp32 sums differs
    tol = 2**-8 if out_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y_MN.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon kernel: a Hopper GPU (sm_90) and Triton >= 3.6")
def test_rows_do_not_depend_on_m():
    """No split-K and one K order: a row's bits are the same in a 4096-row call, a 100-row one and
    alone; and deterministic `linear` runs this kernel for a weight it supports (leading dims too)."""
    from mimo_fn.layers.linear import linear

    x_MK, w_NK = _case(4096, 1536, 4096, seed=5, device="cuda")
    y_MN = gw.gemm_ws(x_MK, w_NK)
    assert torch.equal(gw.gemm_ws(x_MK[:100], w_NK), y_MN[:100])
    assert torch.equal(gw.gemm_ws(x_MK[1000:1001], w_NK), y_MN[1000:1001])
    assert torch.equal(linear(x_MK, w_NK, deterministic=True), y_MN)
    assert torch.equal(linear(x_MK[:6].view(2, 3, -1), w_NK, deterministic=True), y_MN[:6].view(2, 3, -1))  # fixed_gemm


if __name__ == "__main__":
    print(json.dumps({name: probe(**kw) for name, kw in VARIANTS.items()}))
