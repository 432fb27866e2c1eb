"""Prefill benchmark at the released MiMo-V2-Flash dims, against transformers, in one run.

A 6-layer slice (full dense, SWA MoE x4, full MoE) with random weights, in bf16 and FP8
(and, with --dtypes mxfp4, MXFP4 routed experts beside FP8 attention, as the RL release).
For each case: tokens/s, achieved TFLOP/s, MFU against the dense GEMM peaks measured in
this run, peak memory, and the time split from the profiler. transformers'
MiMoV2FlashForCausalLM runs on the same weights at the short ISLs for the ratio and a
logits check. The full 48-layer model is extrapolated from per-layer-type times.

    python scripts/bench_prefill.py                       # everything, JSON + PNG into $OUT or ./out
    python scripts/bench_prefill.py --isl 4096 8192 --dtypes bf16 --no-hf
"""

import argparse
import json
import os
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm

import mimo_fn as mf
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.flops import prefill_flops
from mimo_fn.config import DENSE, FULL, MOE, SWA
from mimo_fn.params import Params, quantize_params

SLICE_TYPES = (FULL, SWA, SWA, SWA, SWA, FULL)
SLICE_MLP = (DENSE, MOE, MOE, MOE, MOE, MOE)


# ---------------------------------------------------------------- peaks
def gemm_peaks(dev) -> dict:
    import triton.testing as tt

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ b.T, warmup=50, rep=300, return_mode="median")
    out = {"bf16_tflops": 2 * n**3 / ms / 1e9}
    try:
        fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(n, 1, device=dev)
        sb = torch.ones(1, n, device=dev)
        ms = tt.do_bench(lambda: torch._scaled_mm(fa, fb.T, sa, sb, out_dtype=torch.bfloat16),
                         warmup=50, rep=300, return_mode="median")
        out["fp8_rowwise_tflops"] = 2 * n**3 / ms / 1e9
    except Exception as e:  # noqa: BLE001 - report and go on
        out["fp8_error"] = repr(e)[:200]
    return out


# ---------------------------------------------------------------- model
def slice_config() -> mf.ModelConfig:
    return replace(mf.ModelConfig.flash(), num_layers=6, layer_types=SLICE_TYPES, mlp_types=SLICE_MLP)


def sub_model(cfg: mf.ModelConfig, params: Params, layers: list[int]):
    """A model made of some of the slice's layers (for per-layer-type timing)."""
    sub_cfg = replace(cfg, num_layers=len(layers), layer_types=tuple(cfg.layer_types[i] for i in layers),
                      mlp_types=tuple(cfg.mlp_types[i] for i in layers))
    return sub_cfg, Params(params.embed, tuple(params.layers[i] for i in layers), params.norm, params.lm_head)


def run_prefill(cfg, params, seq_lens, chunk, page_size=DEFAULT_PAGE_SIZE, gen=None):
    """One chunked prefill of fresh sequences; returns (seconds, last logits [B, V])."""
    gen = gen or torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in seq_lens]
    state = mf.init_state(cfg, params, max_tokens=sum(seq_lens) + page_size * len(seq_lens),
                          page_size=page_size, max_swa_tokens=len(seq_lens) * (chunk + cfg.sliding_window + 2 * page_size))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = {}
    for start in range(0, max(seq_lens), chunk):
        ids = [i for i, n in enumerate(seq_lens) if start < n]
        state, out = mf.prefill(state, mf.Batch.from_tokens(ids, [prompts[i][start:start + chunk] for i in ids]))
        for b, i in enumerate(ids):
            logits[i] = out.logits_BV[b]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del state
    return dt, torch.stack([logits[i] for i in range(len(seq_lens))]), prompts


# by kernel name: our Triton kernels are named _attn_* and _moe_*; library GEMMs by vendor prefix
CATEGORIES = (("attention", ("_attn_", "flash", "fmha")),
              ("moe", ("_moe_", "grouped")),
              ("dense_gemm", ("gemm", "nvjet", "cutlass", "cublas", "scaled_mm", "xmma")))


def time_split(cfg, params, seq_lens, chunk) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_prefill(cfg, params, seq_lens, chunk)
    split = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
    top = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if not t or ev.key.startswith(("ProfilerStep", "cuda")):
            continue
        name = ev.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        split[cat] += t / 1e3
        top[ev.key] = t / 1e3
    total = sum(split.values()) or 1.0
    return {"ms": split, "share": {k: v / total for k, v in split.items()},
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:8])}


def hf_model(cfg: mf.ModelConfig, params: Params):
    """transformers' model built on meta, its parameters pointed at our tensors (no copy)."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    hf_cfg = MiMoV2FlashConfig(**{k: v for k, v in cfg.to_hf().items() if k not in ("model_type", "architectures")},
                               experts_implementation="grouped_mm")
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = MiMoV2FlashForCausalLM(hf_cfg)
    sd = {}
    for i, layer in enumerate(params.layers):
        p = f"model.layers.{i}."
        a = layer.attn
        sd |= {p + "input_layernorm.weight": layer.attn_norm, p + "post_attention_layernorm.weight": layer.mlp_norm,
               p + "self_attn.q_proj.weight": a.wq, p + "self_attn.k_proj.weight": a.wk,
               p + "self_attn.v_proj.weight": a.wv, p + "self_attn.o_proj.weight": a.wo}
        if a.sinks is not None:
            sd[p + "self_attn.sinks"] = a.sinks
        m = layer.mlp
        if cfg.is_moe(i):
            sd |= {p + "mlp.gate.weight": m.router, p + "mlp.gate.e_score_correction_bias": m.router_bias,
                   p + "mlp.experts.gate_up_proj": m.w13, p + "mlp.experts.down_proj": m.w2}
        else:
            sd |= {p + "mlp.gate_proj.weight": m.w_gate, p + "mlp.up_proj.weight": m.w_up,
                   p + "mlp.down_proj.weight": m.w_down}
    sd |= {"model.embed_tokens.weight": params.embed, "model.norm.weight": params.norm, "lm_head.weight": params.lm_head}
    model.load_state_dict(sd, strict=False, assign=True)
    dev = params.embed.device
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to(dev)  # buffers were on meta
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isl", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--batch", type=int, default=4, help="sequences in the multi-sequence cases")
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "mxfp4"])
    ap.add_argument("--hf-isl", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--extrapolate-isl", type=int, default=65536, help="0 skips the 48-layer extrapolation")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "peaks": gemm_peaks(dev), "cases": [], "hf": [], "extrapolation": {}}
    print("peaks:", result["peaks"], flush=True)

    def save() -> None:  # after every section: a run cut short still leaves its figures
        with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
            json.dump(result, f, indent=1)

    cfg = slice_config()
    t0 = time.perf_counter()
    base = mf.init_params(cfg, seed=0, dtype=torch.bfloat16, device=dev)
    print(f"init 6-layer slice: {time.perf_counter() - t0:.1f}s, {mf.params.weight_bytes(base) / 2**30:.1f} GiB", flush=True)

    cases = [(d, [isl]) for d in args.dtypes for isl in args.isl]
    cases += [(d, [isl // args.batch] * args.batch) for d in args.dtypes for isl in args.isl[:2]]
    models = {"bf16": base}
    # MXFP4 experts run bf16 MMAs (weights dequantised in the kernel), FP8 attention FP8 ones: its
    # MFU is against the bf16 peak, an upper bound on what the mix could reach
    peak = {"bf16": result["peaks"]["bf16_tflops"], "fp8": result["peaks"].get("fp8_rowwise_tflops", float("nan")),
            "mxfp4": result["peaks"]["bf16_tflops"]}
    for dtype, seq_lens in tqdm(cases, desc="prefill cases"):
        if dtype not in models:
            models[dtype] = quantize_params(cfg, base, experts="mxfp4" if dtype == "mxfp4" else "fp8")
        params = models[dtype]
        run_prefill(cfg, params, [min(seq_lens[0], 2048)], args.chunk)  # warm-up: compile kernels
        torch.cuda.reset_peak_memory_stats()
        times = [run_prefill(cfg, params, seq_lens, args.chunk)[0] for _ in range(2)]
        dt = min(times)
        flops = prefill_flops(cfg, seq_lens)
        row = {"dtype": dtype, "seq_lens": seq_lens, "tokens": sum(seq_lens), "seconds": dt,
               "tok_s": sum(seq_lens) / dt, "tflops": flops / dt / 1e12,
               "mfu": flops / dt / 1e12 / peak[dtype], "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
        if seq_lens[0] in (8192, 32768, 65536) and len(seq_lens) == 1:
            row["split"] = time_split(cfg, params, seq_lens, args.chunk)
        result["cases"].append(row)
        save()
        tqdm.write(f"{dtype} {seq_lens}: {row['tok_s']:,.0f} tok/s, {row['tflops']:.0f} TFLOP/s, "
                   f"MFU {row['mfu']:.1%}, {row['peak_mem_gib']:.1f} GiB")

    # per-layer-type times at the extrapolation ISL, and the 48-layer model
    isl = args.extrapolate_isl
    for dtype in args.dtypes if isl else ():
        params = models[dtype]
        t_dense = run_prefill(*sub_model(cfg, params, [0]), [isl], args.chunk)[0]
        t_two_full = run_prefill(*sub_model(cfg, params, [0, 5]), [isl], args.chunk)[0]
        t_six = run_prefill(cfg, params, [isl], args.chunk)[0]
        t_full_moe, t_swa_moe = t_two_full - t_dense, (t_six - t_two_full) / 4
        flash = mf.ModelConfig.flash()
        n_full_moe = sum(1 for i in range(48) if not flash.is_swa(i) and flash.is_moe(i))
        n_swa_moe = sum(1 for i in range(48) if flash.is_swa(i))
        t48 = t_dense + n_full_moe * t_full_moe + n_swa_moe * t_swa_moe
        formula = (f"T48 = T(dense full layer + embed/head) + {n_full_moe} * T(full MoE layer) + "
                   f"{n_swa_moe} * T(SWA MoE layer) = {t_dense:.3f} + {n_full_moe}*{t_full_moe:.4f} + "
                   f"{n_swa_moe}*{t_swa_moe:.4f} = {t48:.3f} s")
        result["extrapolation"][dtype] = {"isl": isl, "t48_s": t48, "tok_s_per_gpu": isl / t48, "formula": formula}
        print(f"[{dtype}] {formula} -> {isl / t48:,.0f} input tok/s per GPU at ISL {isl}", flush=True)
        save()

    # room for transformers' eager attention at 8K: drop the FP8 copy, including the loops' own
    # reference to the last model they ran (it kept the copy alive before)
    params = None
    models.pop("fp8", None)
    models.pop("mxfp4", None)
    torch.cuda.empty_cache()
    if not args.no_hf:
        model = hf_model(cfg, base)
        for isl in args.hf_isl:
            run_prefill(cfg, base, [isl], args.chunk)  # warm-up: the cases may not have run this ISL
            runs = [run_prefill(cfg, base, [isl], args.chunk) for _ in range(2)]  # the better of two, as above
            dt_ours = min(r[0] for r in runs)
            _, ours, prompts = runs[-1]
            ids = prompts[0][None].to(dev)
            with torch.no_grad():
                model(ids[:, :512], logits_to_keep=1)  # warm-up
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ref = model(ids, logits_to_keep=1).logits[0, -1].float()
                torch.cuda.synchronize()
                dt_hf = time.perf_counter() - t0
            cos = torch.nn.functional.cosine_similarity(ours[0].float(), ref, dim=0).item()
            rel = ((ours[0].float() - ref).abs().max() / ref.abs().max()).item()
            row = {"isl": isl, "hf_tok_s": isl / dt_hf, "ours_tok_s": isl / dt_ours, "speedup": dt_hf / dt_ours,
                   "logits_cosine": cos, "logits_rel_err": rel,
                   "same_argmax": int(ours[0].argmax()) == int(ref.argmax())}
            result["hf"].append(row)
            print(f"transformers ISL {isl}: {row['hf_tok_s']:,.0f} tok/s vs ours {row['ours_tok_s']:,.0f} "
                  f"({row['speedup']:.1f}x), logits cosine {cos:.5f}, rel err {rel:.2e}", flush=True)
        del model

    save()
    plot(result, os.path.join(args.out, "bench_prefill.png"))
    print(f"\n{'dtype':6} {'seqs':>14} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6}")
    for r in result["cases"]:
        seqs = f"{len(r['seq_lens'])}x{r['seq_lens'][0]}"
        print(f"{r['dtype']:6} {seqs:>14} {r['tok_s']:>10,.0f} {r['tflops']:>8.0f} {r['mfu']:>6.1%} {r['peak_mem_gib']:>6.1f}")


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for dtype in sorted({r["dtype"] for r in result["cases"]}):
        rows = [r for r in result["cases"] if r["dtype"] == dtype and len(r["seq_lens"]) == 1]
        a1.plot([r["tokens"] for r in rows], [r["tok_s"] for r in rows], "o-", label=f"mimo_fn {dtype}")
        a2.plot([r["tokens"] for r in rows], [r["mfu"] for r in rows], "o-", label=f"mimo_fn {dtype}")
    if result["hf"]:
        a1.plot([r["isl"] for r in result["hf"]], [r["hf_tok_s"] for r in result["hf"]], "s--", label="transformers bf16")
    for a, label in ((a1, "tokens/s (6-layer slice)"), (a2, "MFU")):
        a.set_xscale("log", base=2)
        a.set_xlabel("ISL (tokens)")
        a.set_ylabel(label)
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(f"MiMo-V2-Flash prefill, {result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
