"""FP8 block-scaled linear vs bf16 F.linear at prefill shapes, and the quant-into-packet kernel's bandwidth.

Legend: M tokens, K input features, N output features, H hidden, R packet bytes per row.

    python -m mimo_fn.bench fp8            # one sm90 GPU
    python -m mimo_fn.bench fp8 --decode   # decode sizes only: cuBLAS against the few-rows Triton kernel
    python -m mimo_fn.bench fp8 --qkv      # q / k / v GEMMs on a gathered packet: read in place vs copied first

Columns: bf16 = F.linear; fp8 = mimo_fn linear() on bf16 input (Triton activation quant +
block-scaled scaled_mm); gemm = linear_fp8() on activations quantised beforehand (the
GEMM alone, what the packed all-gather feeds). Probes follow, reported not asserted:
scaled_mm on an M that is not a multiple of 128 (linear() pads M to 128) and on a
strided packet view as mat_a (linear_fp8() copies q to dense rows).

--decode: linear_fp8() at 1-64 rows on MiMo's attention and dense-MLP projection shapes, the
cuBLAS backend against "triton" (mimo_fn.kernels.fp8_linear).

--qkv: the three attention projections of one layer (full: N 12288 / 768 / 512; SWA: 12288 / 1536 /
1024; K 4096) on the packet an attention-TP all-gather hands on, as linear_fp8 reads it now (the
row-strided view, no copy) against the copy to dense rows it made before (`q.contiguous()` per
projection), the same bits checked. Each is timed as 10 calls over
enough weight copies to miss L2 (> 150 MB), captured in a CUDA graph and replayed
(timing.time_ms(cuda_graph=True)): the GPU's time per call, without Python's. Elsewhere each
figure is the median of 20 calls between CUDA events (timing.time_ms(iters=20)). The share of the 4.24 TB/s copy bandwidth is for the weight's
bytes; "diff" is the largest difference between the two outputs over the largest output.
"""

import torch
import torch.nn.functional as F

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import time_ms
from mimo_fn.kernels.fp8_quant import packet_bytes_per_row, quant_fp8_act, quant_fp8_into_packet, unpack_packet
from mimo_fn.layers.linear import _block_recipes, _weight_operands, default_backend, linear, linear_fp8
from mimo_fn.quant import dequantize, dequantize_fp8_act, quantize_fp8_act_ref, quantize_fp8_block

NEEDS_CUDA = True

MS = (4096, 8192, 16384, 32768)
NKS = ((4096, 4096), (12288, 4096), (16384, 4096), (4096, 16384))  # o/gate-ish, qkv-ish, up-ish, down


def _time_ms(fn, iters: int = 20) -> float:
    return time_ms(fn, iters=iters, warmup_iters=3)


def bench_gemms(backend: str) -> list[dict]:
    rows = []
    for n, k in NKS:
        w_NK = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_q = quantize_fp8_block(w_NK)
        for m in MS:
            x_MK = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q_MK, s_MG = quant_fp8_act(x_MK)
            flops = 2 * m * n * k
            t_bf16 = _time_ms(lambda: F.linear(x_MK, w_NK))
            t_fp8 = _time_ms(lambda: linear(x_MK, w_q, backend=backend))
            t_gemm = _time_ms(lambda: linear_fp8(q_MK, s_MG, w_q, torch.bfloat16, backend=backend))
            ref = F.linear(x_MK.float(), w_NK.float())
            err = ((linear(x_MK, w_q, backend=backend).float() - ref).norm() / ref.norm()).item()
            rows.append(dict(
                M=m, N=n, K=k,
                bf16_ms=t_bf16, fp8_ms=t_fp8, gemm_ms=t_gemm,
                bf16_tflops=flops / t_bf16 / 1e9, fp8_tflops=flops / t_fp8 / 1e9, gemm_tflops=flops / t_gemm / 1e9,
                rel_err_vs_bf16_fp32=err,
            ))
            print(f"M={m:6d} N={n:6d} K={k:6d}  bf16 {rows[-1]['bf16_tflops']:7.1f}  fp8 {rows[-1]['fp8_tflops']:7.1f}"
                  f"  gemm {rows[-1]['gemm_tflops']:7.1f} TFLOP/s  err {err:.4f}", flush=True)
            del x_MK, q_MK, s_MG, ref
        del w_NK, w_q
    return rows


def bench_quant(hidden: int = 4096) -> list[dict]:
    rows = []
    r = packet_bytes_per_row(hidden)
    for t in MS:
        x_TH = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        packet = torch.empty(t, r, dtype=torch.uint8, device="cuda")
        ms = _time_ms(lambda: quant_fp8_into_packet(x_TH, packet), iters=50)
        ms_ref = _time_ms(lambda: quantize_fp8_act_ref(x_TH), iters=10)
        moved = x_TH.numel() * 2 + packet.numel()  # read bf16, write the packet
        rows.append(dict(T=t, H=hidden, kernel_us=ms * 1e3, kernel_gbps=moved / ms / 1e6, torch_ref_us=ms_ref * 1e3))
        print(f"quant T={t:6d} H={hidden}  {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.1f} GB/s  (torch ref {ms_ref * 1e3:8.1f} us)",
              flush=True)
    return rows


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def probe_scaled_mm(backend: str) -> dict:
    """scaled_mm on layouts linear() avoids: M off a multiple of 128, and a strided packet view as mat_a.

    Rel. error vs the fp32 simulation (dequantised operands), or the exception torch raises.
    """
    out = {}
    if backend != "scaled_mm_v2":
        return {"skipped": f"probes use scaled_mm_v2, backend is {backend}"}
    ra, rb = _block_recipes()
    for n, k in ((256, 512), (1000, 640), (4096, 4096)):
        w_q = quantize_fp8_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        kp = -(-k // 128) * 128
        b_KN, scale_b = _weight_operands(w_q, kp, backend)
        w_f = dequantize(w_q, torch.float32)
        for m in (37, 128, 130, 132, 200, 256, 260, 384, 4093):
            x_MK = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = quant_fp8_act(x_MK, num_rows=m, num_cols=kp)  # exact M: scale strides (1, M)
            ref = dequantize_fp8_act(q[:, :k], s, torch.float32) @ w_f.T
            try:
                y = F.scaled_mm(q, b_KN, s, ra, scale_b, rb, output_dtype=torch.bfloat16)[:, :n]
                out[f"M={m} N={n} K={k}"] = f"rel err {((y.float() - ref).norm() / ref.norm()).item():.2e}"
            except Exception as e:  # noqa: BLE001  (a probe: report whatever torch / cuBLAS says)
                out[f"M={m} N={n} K={k}"] = f"rejected: {type(e).__name__}: {str(e)[:120]}"
    m, k = 8192, 4096
    b_KN, scale_b = _weight_operands(w_q, k, backend)  # the last weight: N = K = 4096
    x_MK = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    packet = quant_fp8_into_packet(x_MK, torch.empty(m, packet_bytes_per_row(k), dtype=torch.uint8, device="cuda"))
    q_view, s_rows = unpack_packet(packet, k)
    s_mm = s_rows.t().contiguous().t()
    dense = F.scaled_mm(q_view.contiguous(), b_KN, s_mm, ra, scale_b, rb, output_dtype=torch.bfloat16)
    try:
        y = F.scaled_mm(q_view, b_KN, s_mm, ra, scale_b, rb, output_dtype=torch.bfloat16)
        out["strided_q"] = f"accepted, max rel diff vs dense {_max_rel(y, dense):.2e}"
        out["strided_q_ms"] = _time_ms(lambda: F.scaled_mm(q_view, b_KN, s_mm, ra, scale_b, rb, output_dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001
        out["strided_q"] = f"rejected: {type(e).__name__}: {str(e)[:160]}"
    out["dense_q_plus_copy_ms"] = _time_ms(
        lambda: F.scaled_mm(q_view.contiguous(), b_KN, s_mm, ra, scale_b, rb, output_dtype=torch.bfloat16)
    )
    return out


DECODE_NKS = ((12288, 4096), (768, 4096), (1536, 4096), (512, 4096), (1024, 4096), (4096, 8192),
              (32768, 4096), (4096, 16384))  # q; k full / SWA; v full / SWA; o; dense gate+up; dense down


def _graph_us(fns) -> float:
    """GPU time per call of fns (run in turn), from a CUDA graph of them replayed."""
    return time_ms(lambda: [fn() for fn in fns], cuda_graph=True, rep_ms=20) * 1e3 / len(fns)


def bench_decode(backend: str, ms=(1, 16, 64)) -> list[dict]:
    rows = []
    for n, k in DECODE_NKS:
        copies = max(2, -(-150_000_000 // (n * k)))
        ws = [quantize_fp8_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        for m in ms:
            q_MK, s_MG = quant_fp8_act(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            times, outs = {}, {}
            for name in (backend, "triton"):
                fns = [lambda w=w, b=name: linear_fp8(q_MK, s_MG, w, torch.bfloat16, backend=b) for w in ws]
                times[name] = _graph_us(fns)
                outs[name] = fns[0]().float()
            diff = ((outs["triton"] - outs[backend]).abs().max() / outs[backend].abs().max()).item()
            floor_us = n * k / 4.24e12 * 1e6
            rows.append(dict(M=m, N=n, K=k, cublas_us=times[backend], triton_us=times["triton"], floor_us=floor_us,
                             max_diff=diff))
            print(f"M={m:3d} N={n:6d} K={k:6d}  cuBLAS {times[backend]:7.1f} us ({floor_us / times[backend]:4.0%})  "
                  f"triton {times['triton']:7.1f} us ({floor_us / times['triton']:4.0%})  diff {diff:.1e}", flush=True)
        del ws
    return rows


QKV_NS = {"full": (12288, 768, 512), "swa": (12288, 1536, 1024)}  # q, k, v output features at K = 4096


def bench_qkv(backend: str, tokens=(4096, 16384, 65536), k: int = 4096) -> list[dict]:
    rows = []
    for layer, ns in QKV_NS.items():
        ws = [quantize_fp8_block(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for n in ns]
        for t in tokens:
            x_TK = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            packet = quant_fp8_into_packet(x_TK, torch.empty(t, packet_bytes_per_row(k), dtype=torch.uint8,
                                                             device="cuda"))
            q_TK, s_TG = unpack_packet(packet, k)
            s_TG = s_TG.t().contiguous().t()  # M-major, as the gather hands it on

            def strided():
                return [linear_fp8(q_TK, s_TG, w, torch.bfloat16, backend=backend) for w in ws]

            def copied():
                return [linear_fp8(q_TK.contiguous(), s_TG, w, torch.bfloat16, backend=backend) for w in ws]

            same = all(torch.equal(a, b) for a, b in zip(strided(), copied()))
            row = dict(layer=layer, T=t, strided_ms=time_ms(strided), copied_ms=time_ms(copied),
                       copy_ms=time_ms(lambda: q_TK.contiguous()), bitwise_equal=same)
            row["saved_ms"] = row["copied_ms"] - row["strided_ms"]
            rows.append(row)
            print(row, flush=True)
    return rows


def add_args(ap) -> None:
    ap.add_argument("--decode", action="store_true",
                    help="decode sizes only (1-64 rows): cuBLAS against the few-rows Triton kernel")
    ap.add_argument("--qkv", action="store_true",
                    help="q / k / v GEMMs on a gathered packet's row-strided q, against copying it first")


def main(args, run) -> None:
    backend = default_backend(torch.device("cuda"))
    if args.qkv:
        rows = bench_qkv(backend)
        for r in rows:
            record(run, {k: v for k, v in r.items() if k not in ("layer", "T")}, section="qkv", backend=backend,
                   layer=r["layer"], T=r["T"])
        print_table(rows, [("layer", "layer", "s"), ("T", "T", "d"), ("strided ms", "strided_ms", ".3f"),
                           ("copied ms", "copied_ms", ".3f"), ("saved ms", "saved_ms", ".3f"),
                           ("copy ms", "copy_ms", ".3f"), ("same bits", "bitwise_equal", "")])
        return
    if args.decode:
        rows = bench_decode(backend)
        for r in rows:
            record(run, {k: v for k, v in r.items() if k not in ("M", "N", "K")}, section="decode", backend=backend,
                   M=r["M"], N=r["N"], K=r["K"])
        print_table(rows, [("M", "M", "d"), ("N", "N", "d"), ("K", "K", "d"), ("cuBLAS us", "cublas_us", ".1f"),
                           ("triton us", "triton_us", ".1f"), ("floor us", "floor_us", ".1f"), ("diff", "max_diff", ".1e")])
        return
    import triton

    info = dict(capability=torch.cuda.get_device_capability(), torch=torch.__version__, cuda=torch.version.cuda,
                backend=backend, triton=triton.__version__)
    print(info, flush=True)
    quant = bench_quant()
    probes = probe_scaled_mm(backend)
    print("probes:", probes, flush=True)
    gemms = bench_gemms(backend)
    record(run, info, section="info")
    record(run, probes, section="probes", backend=backend)
    for r in gemms:
        record(run, {k: v for k, v in r.items() if k not in ("M", "N", "K")}, section="gemm", backend=backend,
               M=r["M"], N=r["N"], K=r["K"])
    for r in quant:
        record(run, {k: v for k, v in r.items() if k not in ("T", "H")}, section="quant", T=r["T"], H=r["H"])

    print(f"\n{run.device}  torch {info['torch']}  backend {backend}  (TFLOP/s, median of 20)")
    print(f"{'M':>6} {'N':>6} {'K':>6} | {'bf16':>7} {'fp8':>7} {'gemm':>7} | fp8/bf16")
    for r in gemms:
        print(f"{r['M']:6d} {r['N']:6d} {r['K']:6d} | {r['bf16_tflops']:7.1f} {r['fp8_tflops']:7.1f} "
              f"{r['gemm_tflops']:7.1f} | {r['fp8_tflops'] / r['bf16_tflops']:5.2f}x")
    print(f"{'T':>6} {'H':>5} | quant-into-packet us   GB/s")
    for r in quant:
        print(f"{r['T']:6d} {r['H']:5d} | {r['kernel_us']:20.1f} {r['kernel_gbps']:6.0f}")
