"""FP8 full attention (kernels/attention/fp8.py): its quantisers and kernel against the plain-torch
twin `attention_fp8_ref` (the same arithmetic: fp32-level agreement), and the twin against the bf16
oracle `paged_attention_ref` (FP8's error); the flag's dispatch; the slice-level check's CPU smoke run.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (tiny shapes); the GPU tests at
MiMo's shapes (N=64, G=4, D=192, E=128, 8K queries after a 4K prefix) skip there.

The FP8 bound against the bf16 oracle (FP8_BOUNDS): on CPU at these shapes (sequences of up to 150
keys, N(0, 1) inputs, D=64 and 192) the twin measured cosine 0.9990-0.9992, max-rel-err (largest
|diff| over the largest |ref|) 0.048-0.076 and a worst row relative L2 error of <= 0.09; at 4K keys
(D=192, E=128) cosine 0.9985, max-rel 0.050, worst row 0.074. Q, K, V and P each carry e4m3's ~2-3%
rounding, so these are what FP8 costs, not slack. A kernel that forgets the sinks, the V scale
ratio or a block's page scale lands far outside (cosine < 0.99 or a row off by > 0.3).
"""

import json
import os
import re

import torch

if not torch.cuda.is_available() and __name__ != "__main__":  # run as a script: the sm_90 compile probe
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn import options  # noqa: E402
from mimo_fn.kernels.attention import dispatch, fp8, fp8_inputs, fp8_ws  # noqa: E402
from mimo_fn.kernels.attention import prefill as attn_prefill  # noqa: E402
from mimo_fn.kernels.attention.ref import attend, paged_attention_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
FP8_BOUNDS = dict(cos=0.997, max_rel=0.15, row_rel=0.2)
SEQS = [(0, 40), (130, 20), (3, 1), (5, 0)]  # fresh prompt, a prefix across a page, one token, no queries


def make_problem(*args, **kw):
    from test_attention_kernel import make_problem  # imported here: it sets TRITON_INTERPRET, the probe must not

    return make_problem(*args, **kw)


def errors(out, ref):
    """(cosine, max |diff| / max |ref|, worst row's relative L2 error) over all rows."""
    out, ref = out.float(), ref.float()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), 0).item()
    max_rel = ((out - ref).abs().max() / ref.abs().max()).item()
    row_rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()
    return cos, max_rel, row_rel


def check_fp8_bounds(out, ref):
    cos, max_rel, row_rel = errors(out, ref)
    assert cos > FP8_BOUNDS["cos"] and max_rel < FP8_BOUNDS["max_rel"] and row_rel < FP8_BOUNDS["row_rel"], \
        (cos, max_rel, row_rel)


def twin_close(out, twin):
    """A GPU kernel against the twin. Hopper's FP8 MMAs add their products with less than fp32's
    precision and exp2 is the hardware's approximation, so a probability near an e4m3 rounding
    boundary can round to the neighbouring e4m3 value (an eighth apart) where the twin's did not:
    measured on an H100, cosine 0.99997-0.99998 and max-rel 0.016-0.032 at these tests' shapes
    (the two GPU kernels: cosine 1.0, max-rel 6e-4-0.011). A lost sink or page scale gives < 0.99."""
    cos, max_rel, _ = errors(out, twin)
    assert cos > 0.9999 and max_rel < 0.06, (cos, max_rel)


def skip_unless_ws(p):
    """Skip on a GPU the Gluon FP8 kernel does not serve (not Hopper, or Triton without Gluon)."""
    reason = fp8_ws.unsupported_reason(p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], 0)
    if reason is not None:
        pytest.skip(f"the Gluon FP8 kernel does not run here: {reason}")


def zero_first_page(p, b=1):
    """Sequence b's first page all zeros in K and V (its scales take the floor)."""
    page = int(p["page_table_BL"][b, 0])
    p["k_pages_PSGD"][page].zero_()
    p["v_pages_PSGE"][page].zero_()
    return page


def run_poisoned(p, **kw):
    q = p["q_TND"]
    out = torch.full((q.shape[0], q.shape[1], p["v_pages_PSGE"].shape[-1]), float("nan"), dtype=q.dtype,
                     device=q.device)
    out = fp8.attention_fp8(**p, out_TNE=out, **kw)
    assert torch.isfinite(out).all(), "rows left unwritten or NaN"
    return out


def test_quantizers_match_ref_bit_for_bit():
    # every page the batch reads, a page of all zeros among them (scale > 0, not NaN), slots past kv_len
    # and spare pages NaN (never read); the sequence without queries is skipped by both
    p = make_problem(SEQS, 4, 2, 64, 32, 128, 0, torch.bfloat16, False, seed=0)
    zero = zero_first_page(p)
    args = (p["k_pages_PSGD"], p["v_pages_PSGE"], p["page_table_BL"], p["kv_lens_B"], p["cu_q_B1"])
    k8, v8, sk, sv = fp8.quantize_paged_kv_fp8(*args)
    rk8, rv8, rsk, rsv = fp8.quantize_paged_kv_fp8_ref(*args)
    used = rsk[:, 0] > 0
    assert int(used.sum()) == 4 and bool(used[zero])
    assert torch.equal(sk[used], rsk[used]) and torch.equal(sv[used], rsv[used])
    same_bytes(k8[used], rk8[used], "K8 [pages, S, G, D]")
    same_bytes(v8[used], rv8[used], "V8 [pages, G, E, S]")
    assert torch.isfinite(sk[zero]).all() and (sk[zero] > 0).all() and not k8[zero].float().any()
    q8, sq = fp8.quantize_q_fp8(p["q_TND"])
    rq8, rsq = fp8._quantize_ref(p["q_TND"], (2,))
    assert torch.equal(sq, rsq[..., 0])
    same_bytes(q8, rq8, "Q8 [T, N, D]")


@pytest.mark.parametrize("head_d", [192, 112, 128])
def test_q_quantizer_head_dims_and_strides(head_d):
    # D as a power of two and a rest: 128 + 64 (MiMo), 64 + 48 (a masked second tile), 128 alone; q a
    # strided view (every other head of a wider tensor) with a token of zeros
    gen = torch.Generator().manual_seed(head_d)
    wide = torch.randn(7, 10, head_d, generator=gen).mul(3).to(DEVICE, torch.bfloat16)
    wide[2] = 0
    q = wide[:, ::2]
    q8, sq = fp8.quantize_q_fp8(q)
    rq8, rsq = fp8._quantize_ref(q, (2,))
    assert torch.equal(sq, rsq[..., 0]) and bool((sq[2] > 0).all())
    same_bytes(q8, rq8, f"Q8 [T, N, {head_d}]")


def same_bytes(got, want, name):
    """Bit-equal e4m3 tensors, else an error naming the first differing positions and their values."""
    bad = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    shown = [(tuple(i.tolist()), got[tuple(i)].float().item(), want[tuple(i)].float().item()) for i in bad[:6]]
    assert len(bad) == 0, f"{name}: {len(bad)} of {got.numel()} bytes differ; (index, got, want): {shown}"


CASES = {
    # fp32 in and out: the kernel and its twin agree to fp32 rounding; default (interpreter) tiles
    "fp32-sinks": dict(dtype=torch.float32, sinks=True, head_d=64, head_e=32, config=None, zero=False),
    # the model's D=192 (128 + 64) and E=128; two key blocks per page, two heads per program
    "bf16-d192": dict(dtype=torch.bfloat16, sinks=False, head_d=192, head_e=128,
                      config=fp8.Fp8Config(block_m=16, block_n=64, h_pack=2, num_warps=4, num_stages=1), zero=False),
    # a page of zeros in a sequence's prefix, sinks on
    "bf16-zero-page": dict(dtype=torch.bfloat16, sinks=True, head_d=64, head_e=32, config=None, zero=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_twin_and_bf16_oracle(case):
    c = CASES[case]
    p = make_problem(SEQS, 4, 2, c["head_d"], c["head_e"], 128, 0, c["dtype"], c["sinks"], seed=len(case))
    if c["zero"]:
        zero_first_page(p)
    out = run_poisoned(p, config=c["config"])
    block_n = c["config"].block_n if c["config"] else fp8.BLOCK_N
    twin = fp8.attention_fp8_ref(**p, block_n=block_n)
    rows = p["cu_q_B1"][-1]
    if DEVICE == "cuda":  # the GPU's FP8 MMAs and exp2 are not the twin's fp32 torch (see twin_close)
        twin_close(out[:rows], twin[:rows])
    else:
        diff = ((out[:rows].float() - twin[:rows].float()).abs().max() / twin.float().abs().max()).item()
        # fp32: the order of fp32 sums; bf16: at most one bf16 rounding step apart (2^-8 relative)
        assert diff <= (1e-5 if c["dtype"] == torch.float32 else 2**-8), diff
    check_fp8_bounds(twin, paged_attention_ref(**p))


def test_bounds_fail_for_broken_arithmetic():
    # the FP8 bounds are tight enough to catch a lost sink or a lost per-page V scale
    p = make_problem(SEQS, 4, 2, 64, 32, 128, 0, torch.float32, True, seed=5)
    ref = paged_attention_ref(**p)
    check_fp8_bounds(fp8.attention_fp8_ref(**p), ref)
    with pytest.raises(AssertionError):
        check_fp8_bounds(fp8.attention_fp8_ref(**{**p, "sinks_N": None}), ref)
    v_scaled = p["v_pages_PSGE"].clone()
    v_scaled[int(p["page_table_BL"][1, 1])] *= 4  # as if page 1's V scale were page 0's
    with pytest.raises(AssertionError):
        check_fp8_bounds(fp8.attention_fp8_ref(**{**p, "v_pages_PSGE": v_scaled}), ref)


def test_unsupported_reasons_and_launcher_errors():
    p = make_problem([(2, 3)], 4, 2, 64, 32, 128, 0, torch.bfloat16, False, seed=0)
    q, k, v = p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"]
    assert fp8.unsupported_reason(q, k, v, 0) is None
    assert "window" in fp8.unsupported_reason(q, k, v, 128)
    assert "page size 16" in fp8.unsupported_reason(q, k[:, :16], v[:, :16], 0)
    assert "page size 192" in fp8.unsupported_reason(q, torch.zeros(2, 192, 2, 64), torch.zeros(2, 192, 2, 32), 0)
    assert "D=48" in fp8.unsupported_reason(q[..., :48], k[..., :48], v, 0)
    with pytest.raises(ValueError, match="window"):
        fp8.attention_fp8(**{**p, "window": 4})
    with pytest.raises(ValueError, match="block_n must divide"):
        fp8.attention_fp8(**p, config=fp8.Fp8Config(block_m=16, block_n=256, h_pack=1))


def test_dispatch_choice_follows_the_flag():
    p = make_problem([(2, 3)], 4, 2, 64, 32, 128, 0, torch.bfloat16, False, seed=0)
    q, k, v = p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"]
    assert not options.current().attention_fp8  # off by default
    assert not dispatch.fp8_serves(q, k, v, 0)
    with options.override(attention_fp8=True):
        assert dispatch.fp8_serves(q, k, v, 0)
        assert not dispatch.fp8_serves(q, k, v, 128)  # windows: the SWA kernels
        assert not dispatch.fp8_serves(q, k[:, :16], v[:, :16], 0)  # pages of 16: the bf16 kernels
        if DEVICE == "cpu":  # off CUDA attention takes the reference, flag or not
            assert torch.equal(dispatch.attention(**p), paged_attention_ref(**p))


@pytest.mark.slow  # ~10 s on a loaded 2-core CI machine
def test_slice_check_cpu_smoke(capsys):
    # python -m mimo_fn.bench attention-fp8 on the tiny model: runs, prints its table (without the
    # reference rows: off CUDA every mode is the reference, and the tiny model's MoE costs seconds a run)
    from mimo_fn.bench import cli
    cli.main(["attention-fp8", "--model", "tiny", "--device", "cpu", "--prompts", "1", "--prompt-len", "12",
              "--ref-len", "0", "--new", "2"])
    out = capsys.readouterr().out
    assert "last-token cos" in out and "greedy" in out


# ---------------------------------------------------------------------------------------
# GPU: MiMo's full-attention shapes
# ---------------------------------------------------------------------------------------


def chunked_oracle(p, chunk=1024):
    """paged_attention_ref a chunk of queries at a time (its [N, Q, L] scores would not fit at 8K x 12K)."""
    out = torch.empty(p["q_TND"].shape[0], p["q_TND"].shape[1], p["v_pages_PSGE"].shape[-1], device=DEVICE)
    page_size = p["k_pages_PSGD"].shape[1]
    cu_q = p["cu_q_B1"].tolist()
    for b, kv_len in enumerate(p["kv_lens_B"].tolist()):
        q0, q1 = cu_q[b], cu_q[b + 1]
        pos = torch.arange(kv_len, device=DEVICE)
        pages = p["page_table_BL"][b, pos // page_size].long()
        k, v = p["k_pages_PSGD"][pages, pos % page_size], p["v_pages_PSGE"][pages, pos % page_size]
        for c0 in range(q0, q1, chunk):
            c1 = min(c0 + chunk, q1)
            q_pos = pos[kv_len - (q1 - q0) + c0 - q0: kv_len - (q1 - q0) + c1 - q0]
            out[c0:c1] = attend(p["q_TND"][c0:c1], k, v, q_pos, pos, p["scale"], 0, p["sinks_N"]).float()
    return out


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["ws", "triton"])
@pytest.mark.parametrize("sinks", [False, True])
def test_gpu_model_shapes(sinks, kernel):
    p = make_problem([(4096, 8192), (0, 700)], 64, 4, 192, 128, 128, 0, torch.bfloat16, sinks, seed=11)
    if kernel == "ws":
        skip_unless_ws(p)
    config = None if kernel == "ws" else fp8.default_fp8_config(True, 64, 4)  # None: the Gluon kernel on Hopper
    out = run_poisoned(p, config=config)
    check_fp8_bounds(out, chunked_oracle(p))
    twin_close(out, fp8.attention_fp8_ref(**p, q_chunk=128))
    # a sequence's rows do not depend on the batch's other sequences
    alone = {**p, "cu_q_B1": p["cu_q_B1"][:2], "kv_lens_B": p["kv_lens_B"][:1], "page_table_BL": p["page_table_BL"][:1]}
    assert torch.equal(fp8.attention_fp8(**{**alone, "q_TND": p["q_TND"][:8192]}, config=config), out[:8192])


@needs_cuda
def test_gpu_ws_small_cases():
    # the Gluon kernel on the CPU tests' sequences (a prefix across pages, one token, no queries),
    # GQA 2 and 8, with and without sinks, against the twin
    for num_heads, num_kv_heads, sinks, seed in ((16, 8, True, 1), (16, 2, False, 2), (64, 4, True, 3)):
        p = make_problem([(0, 40), (130, 20), (3, 1), (5, 0), (0, 300)], num_heads, num_kv_heads, 192, 128, 128,
                         0, torch.bfloat16, sinks, seed=seed)
        skip_unless_ws(p)
        out = run_poisoned(p)
        rows = p["cu_q_B1"][-1]
        twin_close(out[:rows], fp8.attention_fp8_ref(**p)[:rows])
        with options.override(attention_ws=False):  # the Triton kernel: the same arithmetic, other D chunks
            cos, max_rel, _ = errors(out[:rows], fp8.attention_fp8(**p)[:rows])
        # measured on an H100: cosine 1.0, max-rel 0.011 (a probability or two on the other side of an
        # e4m3 rounding boundary)
        assert cos > 0.99999 and max_rel < 0.03, (num_heads, num_kv_heads, sinks, cos, max_rel)
        # the Gluon kernel at other ring depths: the same arithmetic
        q8, sq = fp8.quantize_q_fp8(p["q_TND"])
        kv8 = fp8.quantize_paged_kv_fp8(p["k_pages_PSGD"], p["v_pages_PSGE"], p["page_table_BL"], p["kv_lens_B"],
                                        p["cu_q_B1"])
        for stages in (2, 4):
            other = torch.full_like(out, float("nan"))
            fp8_ws.launch_fp8_ws(q8, sq, *kv8, p["page_table_BL"], p["cu_q_B1"], p["kv_lens_B"], p["scale"],
                                 p["sinks_N"], other, fp8.P_SHIFT, stages=stages)
            assert torch.equal(other[:rows], out[:rows]), stages  # the ring's depth changes no arithmetic


@needs_cuda
def test_gpu_dispatch():
    p = make_problem([(300, 200), (0, 129)], 16, 2, 192, 128, 128, 0, torch.bfloat16, True, seed=3)
    with options.override(attention_fp8=True):
        assert torch.equal(dispatch.paged_attention(**p), fp8.attention_fp8(**p))
        det = dispatch.attention(**p, deterministic=True)  # deterministic mode: never FP8
        cfg = attn_prefill.deterministic_prefill_config(16, 2, 0, True, torch.bfloat16)
        assert torch.equal(det, attn_prefill.launch_prefill(**p, config=cfg))
        windowed = make_problem([(300, 200)], 16, 2, 192, 128, 128, 128, torch.bfloat16, True, seed=4)
        with options.override(attention_fp8=False):
            bf16 = dispatch.paged_attention(**windowed)
        assert torch.equal(dispatch.paged_attention(**windowed), bf16)


# ---------------------------------------------------------------------------------------
# sm_90 compile probe (no GPU): both dots are FP8 wgmma
# ---------------------------------------------------------------------------------------


def probe() -> dict:
    """The attention kernel at MiMo's shapes and the default CUDA config, compiled for sm_90: its
    wgmma instructions, split by where the A operand comes from (shared memory for Q8 @ K8^T, registers
    for P8 @ V8), its shared memory, and whether the quantisers convert with the hardware e4m3 cvt."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_(fn, types, consts, warps, stages):
        sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})

    cfg = fp8.default_fp8_config(True, 64, 4)
    types = dict(q8_ptr="*fp8e4nv", sq_ptr="*fp32", k8_ptr="*fp8e4nv", v8_ptr="*fp8e4nv", sk_ptr="*fp32",
                 sv_ptr="*fp32", o_ptr="*bf16", pt_ptr="*i32", cu_q_ptr="*i32", kv_lens_ptr="*i32",
                 sinks_ptr="*fp32", qk_scale="fp32")
    consts = dict(GQA=16, H_PACK=cfg.h_pack, NUM_HEADS=64, NUM_KV_HEADS=4, PAGE_SIZE=128, HEAD_D=192, BLOCK_D0=128,
                  BLOCK_D1=64, HEAD_E=128, BLOCK_E=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_SINKS=True,
                  P_SHIFT_C=fp8.P_SHIFT, INTERPRET=False)
    k = compile_(fp8._fp8_attn_kernel, types, consts, cfg.num_warps, cfg.num_stages)
    wgmma = {}
    for ins in re.findall(r"wgmma\.mma_async[^;]*;", k.asm["ptx"]):
        a_operand = re.split(r"\},\s*", " ".join(ins.split()))[1]
        key = f"{ins.split()[0]} A={'regs' if a_operand.startswith('{') else 'smem'}"
        wgmma[key] = wgmma.get(key, 0) + 1
    q = compile_(fp8_inputs._quant_q_kernel, dict(q_ptr="*bf16", q8_ptr="*fp8e4nv", sq_ptr="*fp32"),
                 dict(NUM_HEADS=64, D0=128, D1=64, BLOCK_D1=64, ROWS=fp8_inputs._Q_ROWS, FP8_MAX_C=448.0, FLOOR_C=1e-10,
                      INTERPRET=False), 8, 1)
    return dict(wgmma=wgmma, shared=k.metadata.shared, q_cvt="cvt.rn.satfinite.e4m3x2.f32" in q.asm["ptx"],
                ws=probe_ws() if fp8_ws.HAS_GLUON else None)


def probe_ws() -> dict:
    """fp8_ws.py's Gluon kernel at MiMo's shapes compiled for sm_90 (compile_util.gluon_sm90_facts),
    specialised as a launch would be (16-byte aligned pointers, integers divisible by 16)."""
    from compile_util import gluon_sm90_facts
    from triton.experimental.gluon import language as gl

    fw = fp8_ws

    def desc(box):
        return f"tensordesc<fp8e4nv[{box[0]},{box[1]}],{gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)!r}>"

    fn = fw._fp8_ws_kernel
    types = dict(q_desc=desc([fw.TOK, fw.CHUNK]), k_desc=desc([fw.BLOCK_N, fw.CHUNK]), v_desc=desc([fw.CHUNK, fw.BLOCK_N]),
                 o_ptr="*bf16", sq_ptr="*fp32", sk_ptr="*fp32", sv_ptr="*fp32", pt_ptr="*i32", cu_q_ptr="*i32",
                 kv_lens_ptr="*i32", sinks_ptr="*fp32", qk_scale="fp32")
    consts = dict(HEAD_D=192, NUM_HEADS=64, NUM_KV_HEADS=4, PAGE_SIZE=128, HAS_SINKS=True, BN=fw.BLOCK_N, TOK=fw.TOK,
                  NS=fw.STAGES, P_SHIFT_C=fp8.P_SHIFT, NEG_BIG_C=-1.0e30, CONSUMER_REGS=fw.CONSUMER_REGS, num_warps=4)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in ("q_desc", "k_desc", "v_desc", "num_seqs", "qk_scale", "gqa")}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    return gluon_sm90_facts(fn, sig, consts, attrs, fw.MAX_REGS)


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    from compile_util import run_probe

    # a Triton cache of its own: a cached kernel runs no ptxas, and its report is read below
    return run_probe(os.path.abspath(__file__), timeout=600, cache_dir=str(tmp_path_factory.mktemp("triton_cache")))


def test_sm90_compile_both_dots_are_fp8_wgmma(facts):
    # Q8 @ K8^T: D=192 is 6 k32 steps from shared memory; P8 @ V8: 128 keys are 4 steps with P8 in
    # registers (V8 tiles keys-contiguous, as FP8 wgmma needs); each in the unmasked and the masked loop
    mma = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
    assert facts["wgmma"] == {f"{mma} A=smem": 12, f"{mma} A=regs": 8}, facts
    assert facts["shared"] < 227 * 1024 and facts["q_cvt"], facts


@pytest.mark.skipif(not fp8_ws.HAS_GLUON, reason="Gluon needs Triton >= 3.6")
def test_sm90_compile_ws_kernel(facts):
    ws = facts["ws"]
    # Q8 @ K8^T as m64n128 (keys), P8 @ V8 as two m64n64 halves of E, all e4m3 x e4m3 into fp32
    assert ws["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
                           "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], ws["wgmma"]
    assert ws["tma"] and all(".2d." in t for t in ws["tma"]), ws["tma"]
    assert "24" in ws["setmaxnreg"], ws["setmaxnreg"]  # the producer warp hands its registers back
    assert ws["shared"] <= 227 * 1024, ws["shared"]
    assert "0 bytes spill stores" in ws["ptxas"], ws["ptxas"]
    assert "serialized" not in ws["ptxas"] and "C751" not in ws["ptxas"], ws["ptxas"]


if __name__ == "__main__":
    print(json.dumps(probe()))
