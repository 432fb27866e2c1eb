"""The probes of `python -m mimo_fn.bench moe` (--mode numerics / profile / cublas): where the FP8
kernel's error comes from, where a layer's time goes, and cuBLASLt's block-scaled GEMM once per
expert as the library's FP8 alternative. The module docstring of mimo_fn.bench.moe says what each
measures.

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, M aligned rows,
S real (unpadded) rows, G = H / 128 scale groups.
"""

import math
import time

import torch
import torch.nn.functional as F

from mimo_fn.bench.moe_layer import DEV, E, H, I, K, Weights, rel_err, routing, with_options
from mimo_fn.bench.results import record
from mimo_fn.bench.timing import settle, time_ms
from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe import gemm as moe_gemm
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.gemm import _cfg, fused_moe, fused_moe_fp8
from mimo_fn.kernels.moe.ref import fused_moe_fp8_ref
from mimo_fn.layers import linear
from mimo_fn.quant import FP8_BLOCK, FP8_DTYPE, QTensor, dequantize


def numerics(w: Weights, t, gen, run) -> None:
    """FP8 kernel vs float64 and vs its fp32 simulation, per max_num_imprecise_acc (see --mode)."""
    x_TH, w13_q, w2_q = w.x_TH, w.w13_q, w.w2_q
    ids_TK, weights_TK = routing("balanced", t, gen)
    x = x_TH[:t]
    xq_TH, xs_TG = quant_fp8_act(x)
    bm = 64
    al = moe_align(ids_TK, E, bm)
    n = int(al.num_tokens_post_pad_1)
    pair_M = al.sorted_ids_M[:n].long()
    expert_M = al.expert_of_block_NB.long().repeat_interleave(bm)[:n]
    slot_S = torch.nonzero(pair_M < al.num_pairs).view(-1)
    pair_S, expert_S = pair_M[slot_S], expert_M[slot_S]
    x64_SH = (xq_TH.double() * xs_TG.double().repeat_interleave(128, dim=1))[pair_S // K]
    gu_S2I = torch.zeros(len(slot_S), 2 * I, dtype=torch.float64, device=DEV)
    gu_abs_S2I = torch.zeros_like(gu_S2I)
    for e in expert_S.unique().tolist():
        r = expert_S == e
        w64 = w13_q.data[e].double() * w13_q.scale[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        gu_S2I[r] = x64_SH[r] @ w64.T
        gu_abs_S2I[r] = x64_SH[r].abs() @ w64.abs().T
    g, u = gu_S2I.split(I, dim=1)
    g_abs, u_abs = gu_abs_S2I.split(I, dim=1)
    sig = torch.sigmoid(g)
    h64_SI = g * sig * u
    # d h per unit of relative accumulation error (first order): the scale errors are measured in
    h_unit_SI = (sig * (1 + g * (1 - sig)) * u).abs() * g_abs + (g * sig).abs() * u_abs
    sim_TH = fused_moe_fp8_ref(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK).float()
    print(f"\nFP8 numerics at T={t} (E={E}, K={K}, H={H}, I={I}, block_m {bm}), per max_num_imprecise_acc:")
    rows = []
    for mi in (None, 64, 32):
        up_cfg = _cfg(128, 128, 8, 3, MAX_IMPRECISE=mi)  # what the tuner picks at block_m 64
        down_cfg = _cfg(128, 128, 4, 3, MAX_IMPRECISE=mi)
        h32_MI, _ = moe_gemm._moe_up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, K, torch.float32, cfg=up_cfg)
        hq_MI, hs_MIb = moe_gemm._moe_up(xq_TH, xs_TG, w13_q.data, w13_q.scale, al, K, FP8_DTYPE, cfg=up_cfg)
        y_PH = moe_gemm._moe_down(hq_MI, hs_MIb, w2_q.data, w2_q.scale, al, weights_TK, torch.bfloat16, cfg=down_cfg)
        out_TH = moe_gemm._moe_sum_topk(y_PH, ids_TK, E, torch.bfloat16)
        err_SI = (h32_MI.double()[slot_S] - h64_SI).abs()
        ratio = float((err_SI / h_unit_SI.clamp_min(1e-300)).max())  # error in units of sum|x||w|
        rel_h = float((err_SI / h64_SI.abs().clamp_min(1e-300)).median())
        hs_SI = hs_MIb.double()[slot_S].repeat_interleave(128, dim=1)
        exact_q = (h64_SI / hs_SI).clamp(-448, 448).float().to(FP8_DTYPE).float()
        flips = int((hq_MI[slot_S].float() != exact_q).sum())
        layer = float((out_TH.float() - sim_TH).abs().max() / sim_TH.abs().max())
        row = {"max_num_imprecise_acc": mi, "h_err_per_sum_abs_max": ratio, "h_rel_err_median": rel_h,
               "flips": flips, "num_h": h64_SI.numel(), "layer_vs_sim": layer}
        rows.append(row)
        record(run, {k: v for k, v in row.items() if k != "max_num_imprecise_acc"}, mode="numerics", tokens=t,
               block_m=bm, max_num_imprecise_acc=mi)
        print(f"  max_num_imprecise_acc={str(mi):4s}: max |h - h64| / sum|x||w| = {ratio:.3g} (2^{math.log2(max(ratio, 1e-300)):.1f}), "
              f"median rel {rel_h:.3g}; codes off the exact rounding {flips}/{h64_SI.numel()}; layer vs sim {layer:.3g}")


def profile(w: Weights, tokens, gen, run, ws_down: bool = False, ws_up: bool = False, cublas_up: bool = False) -> None:
    """Where a whole layer's time goes (balanced routing): each kernel's device time (torch
    profiler, 5 layers back to back), the layer back to back, by do_bench, and the host time.
    ws_down: also the FP8 layer with the warp-specialised down GEMM ("fp8 ws-down"); ws_up: with the
    warp-specialised up GEMM ("fp8 ws-up": its gather and GEMM kernels) and with both; cublas_up: with
    the up GEMM per expert in cuBLASLt ("fp8 cublas-up"). The other FP8 layers keep the Triton up GEMM."""
    x_TH, w13_E2IH, w2_EHI, w13_q, w2_q = w.x_TH, w.w13_E2IH, w.w2_EHI, w.w13_q, w.w2_q
    for t in tokens:
        ids_TK, weights_TK = routing("balanced", t, gen)
        x = x_TH[:t]
        flops = 2 * t * K * 3 * H * I
        layers = {"bf16": lambda: fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK),
                  "fp8": lambda: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK,
                                              down_ws=False)}
        if ws_down:
            layers["fp8 ws-down"] = lambda: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK,
                                                          weights_TK, down_ws=True)
        if ws_up:
            for name, kw in (("fp8 ws-up", dict(up_ws=True, down_ws=False)), ("fp8 ws-both", dict(up_ws=True, down_ws=True))):
                layers[name] = lambda kw=kw: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK,
                                                           weights_TK, **kw)
        layers = {name: with_options(fn, moe_up_cublas=False) if name.startswith("fp8") else fn
                  for name, fn in layers.items()}
        if cublas_up:
            layers["fp8 cublas-up"] = with_options(lambda: fused_moe_fp8(
                x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK, down_ws=True), moe_up_cublas=True)
        for name, fn in layers.items():
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            kernels = {e.key: e.device_time_total / 5e3 for e in prof.key_averages()
                       if e.device_type == torch.autograd.DeviceType.CUDA}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            end.record()
            torch.cuda.synchronize()
            loop_ms = start.elapsed_time(end) / 20
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            host_ms = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            bench_ms = time_ms(fn)
            row = {"kernels_ms": sum(kernels.values()), "loop_ms": loop_ms, "do_bench_ms": bench_ms,
                   "host_ms": host_ms, "split_ms": kernels}
            record(run, row, mode="profile", tokens=t, dtype=name)
            split = ", ".join(f"{k.split('(')[0][:28]} {v:.3f}" for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:7])
            print(f"T={t:6d} {name}: kernels {row['kernels_ms']:.3f} ms ({flops / row['kernels_ms'] / 1e9:.0f} TFLOP/s), "
                  f"back to back {loop_ms:.3f}, do_bench {bench_ms:.3f} ({flops / bench_ms / 1e9:.0f}), host {host_ms:.3f}"
                  f"\n    {split}", flush=True)


def cublas_per_expert(w: Weights, tokens, routings, gen, run, settle_s) -> None:
    """Per-expert F.scaled_mm over aligned segments: the up GEMM [M_e, H] x [H, 2I] and the down
    GEMM [M_e, I] x [I, H] of every expert with rows, each stage timed alone (see the module doc).
    cuBLAS wants each activation-scale block M-major with strides (1, M_e): a strided slice of
    one [G, P] buffer is refused, so each expert gets its own block."""
    w13_q, w2_q = w.w13_q, w.w2_q
    if not (linear._block_scaled_mm_available(torch.device(DEV)) and linear._has_scaled_mm_v2()):
        print("cublas: skipped (needs torch.nn.functional.scaled_mm and cuBLASLt block scaling, sm90)")
        return
    ra, rb = linear._block_recipes()
    w13_s, w2_s = w13_q.scale.float(), w2_q.scale.float()
    b13 = [(w13_q.data[e].t(), w13_s[e].t()) for e in range(E)]  # [H, 2I] column-major, scale [Hb, 2Ib]
    b2 = [(w2_q.data[e].t(), w2_s[e].t()) for e in range(E)]

    def operands(rows: list[int], k: int):
        """Per expert: (q [M_e, k] fp8, its M-major scale [M_e, k/128]), random; None for no rows."""
        return [(torch.randn(m, k, device=DEV, generator=gen).to(FP8_DTYPE),
                 (torch.rand(k // 128, m, device=DEV, generator=gen) + 0.5).t()) if m else None for m in rows]

    def per_expert(ops, weights):
        """One stage over all experts with rows: a list of [M_e, N] bf16 outputs."""
        return lambda: [F.scaled_mm(op[0], weights[e][0], op[1], ra, weights[e][1], rb, output_dtype=torch.bfloat16)
                        for e, op in enumerate(ops) if op is not None]

    q, s = operands([128], H)[0]
    w0 = dequantize(QTensor(w13_q.data[0], w13_q.scale[0], FP8_BLOCK), torch.float32)
    ref = (q.float() * s.repeat_interleave(128, 1)) @ w0.t()
    got = F.scaled_mm(q, b13[0][0], s, ra, b13[0][1], rb, output_dtype=torch.bfloat16)
    err = rel_err(got, ref)
    print(f"cublas: expert 0 up GEMM vs dequantised matmul: max-abs rel {err:.1e}")
    if err > 1e-2:
        raise SystemExit(f"cublas: per-expert scaled_mm check failed ({err:.1e} > 1e-2)")
    for t in tokens:
        for kind in routings:
            ids_TK, _ = routing(kind, t, gen)
            rows = [-(-c // 128) * 128 for c in torch.bincount(ids_TK.flatten(), minlength=E).tolist()]
            stages = {"up": (per_expert(operands(rows, H), b13), 2 * t * K * H * 2 * I),
                      "down": (per_expert(operands(rows, I), b2), 2 * t * K * I * H)}
            times = {}
            for name, (fn, flops) in stages.items():
                fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                host_ms = (time.perf_counter() - t0) * 1e3  # launches only: no sync inside
                settle(fn, settle_s)
                times[name] = ms = time_ms(fn)
                row = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "host_ms": round(host_ms, 2),
                       "slots": sum(rows)}
                record(run, row, mode="cublas", tokens=t, routing=kind, stage=name)
                print(f"T={t:6d} {kind:9s} cublas per-expert {name:5s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
                      f"  host {host_ms:.1f} ms for {sum(1 for r in rows if r)} launches")
            total = 2 * t * K * 3 * H * I
            print(f"T={t:6d} {kind:9s} cublas per-expert both  {sum(times.values()):8.3f} ms "
                  f"{total / sum(times.values()) / 1e9:7.1f} TFLOP/s (GEMMs only; no gather, SiLU, quant or sum)")
            del stages
            torch.cuda.empty_cache()
