"""Prefill benchmark at the released MiMo-V2-Flash dims, against transformers, in one run.

A 6-layer slice (full dense, SWA MoE x4, full MoE) with random weights, in bf16 and FP8
(and, with --dtypes mxfp4, MXFP4 routed experts beside FP8 attention, as the RL release).
For each case: tokens/s, achieved TFLOP/s, MFU against the dense GEMM peaks measured in
this run, peak memory, and the time split from the profiler. transformers'
MiMoV2FlashForCausalLM runs on the same weights at the short ISLs for the ratio and a
logits check. The full 48-layer model is extrapolated from per-layer-type times:

    T48 = T(dense full layer + embed/head) + 8 * T(full MoE layer) + 39 * T(SWA MoE layer)

Each case runs once to compile and tune at a short length, then twice; the better time counts.
--check-layers N then checks that per-layer model on N real layers (mimo_fn.bench.prefill_check).
--profile-layers then prints, per weight format, the kernels of one SWA MoE layer and one full MoE
layer (mimo_fn.bench.layer_profile; see profile_layers).

    python -m mimo_fn.bench prefill --json prefill.jsonl --plot prefill.png
    python -m mimo_fn.bench prefill --isl 4096 8192 --dtypes bf16 --no-hf
    python -m mimo_fn.bench prefill --isl 16384 65536 --dtypes fp8 --no-hf --routing fake   # as the serving runs
    python -m mimo_fn.bench prefill --isl 65536 --dtypes mxfp4 --no-hf --check-layers 12   # 12 real layers vs T(12)
    python -m mimo_fn.bench prefill --isl 65536 --dtypes fp8 --no-hf --chunk 32768 --profile-layers

--routing fake deals every token's experts round-robin (layers.moe.balanced_routing: each expert
gets the same number of tokens, the reference's fake balanced routing) instead of the router's choice.
"""

import statistics
import time

import torch
from tqdm.auto import tqdm

import mimo_fn as mf
from mimo_fn import options
from mimo_fn.bench.layer_profile import format_table, ranged_kernel_ms
from mimo_fn.bench.prefill_check import check, formula, layer_counts, predict_s
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import gemm_peaks, sync
from mimo_fn.bench.workload import flash_slice, slice_params, sub_model, timed_prefill
from mimo_fn.flops import prefill_flops
from mimo_fn.parallel.mesh import init_mesh
from mimo_fn.params import Params

NEEDS_CUDA = True

# by kernel name: our Triton kernels are named _attn_* and _moe_*; library GEMMs by vendor prefix
CATEGORIES = (("attention", ("_attn_", "flash", "fmha")),
              ("moe", ("_moe_", "grouped")),
              ("dense_gemm", ("gemm", "nvjet", "cutlass", "cublas", "scaled_mm", "xmma", "_fp8_linear")))


def add_args(ap) -> None:
    ap.add_argument("--isl", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536],
                    help="input lengths of the one-sequence cases")
    ap.add_argument("--batch", type=int, default=4,
                    help="sequences in the multi-sequence cases (each ISL // batch long, the first two ISLs)")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk, tokens per sequence and pass")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "mxfp4"],
                    help="weight formats (mxfp4: MXFP4 routed experts, FP8 the other GEMM weights)")
    ap.add_argument("--hf-isl", type=int, nargs="*", default=[4096, 8192],
                    help="ISLs at which transformers runs on the same weights")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--routing", choices=["real", "fake"], default="real",
                    help="real: the router's top-k; fake: balanced round-robin experts (as --ep-dispatch-algorithm fake)")
    ap.add_argument("--extrapolate-isl", type=int, default=65536, help="ISL of the 48-layer extrapolation; 0 skips it")
    ap.add_argument("--extrapolate-rounds", type=int, default=3,
                    help="times each sub-model of the extrapolation's split is run, in turn; the medians count")
    ap.add_argument("--check-layers", type=int, default=0,
                    help="after the rest, time this many real layers of the released pattern against the "
                         "extrapolation's prediction for them (12 with --dtypes mxfp4 fits an 80 GB card); 0 skips it")
    ap.add_argument("--profile-layers", action="store_true",
                    help="print last, per weight format, a table of the kernels of one SWA MoE layer and one "
                         "full MoE layer (calls, device ms per layer, share) in a prefill of --extrapolate-isl "
                         "tokens (one --chunk where that is 0) in --chunk chunks, and the layer's time "
                         "without the profiler")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also plot tok/s and MFU against ISL (needs matplotlib)")


def time_split(cfg, params, seq_lens, chunk, mesh=None) -> dict:
    """Device time by kernel category over one profiled prefill."""
    return split_of(lambda: timed_prefill(cfg, params, seq_lens, chunk, mesh=mesh))


def split_of(fn) -> dict:
    """Device time by kernel category (CATEGORIES) over one profiled call of fn, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
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


def layer_type_times(cfg, params, isl: int, chunk: int, mesh=None, rounds: int = 1) -> dict:
    """Seconds of one prefill of `isl` tokens by layer type (prefill_check's t_dense_s, t_full_moe_s,
    t_swa_moe_s), by the host clock from sub-models: layer 0; layer 0 and the first full MoE layer
    (5 in the slice); every layer; each run once untimed first. rounds: each sub-model timed that many
    times, the three in turn, and the median of each taken (a single run's split can move the full layer
    by a sixth); with rounds > 1 "t48_rounds_s" holds the 48-layer time of each round's own split."""
    n_full, n_swa = layer_counts(cfg)
    full = next(i for i in range(1, cfg.num_layers) if not cfg.is_swa(i))
    models = (sub_model(cfg, params, [0]), sub_model(cfg, params, [0, full]), (cfg, params))
    for c, p in models:  # a warm-up at the timed shapes each, as the check's measured run has (prefill_check)
        timed_prefill(c, p, [isl], chunk, mesh=mesh)
    samples = [[timed_prefill(c, p, [isl], chunk, mesh=mesh)[0] for c, p in models] for _ in range(rounds)]

    def split(t_dense, t_two_full, t_all):
        t_full = t_two_full - t_dense
        return {"t_dense_s": t_dense, "t_full_moe_s": t_full,
                "t_swa_moe_s": (t_all - t_two_full - (n_full - 1) * t_full) / n_swa}

    times = split(*(statistics.median(col) for col in zip(*samples)))
    if len(samples) > 1:
        times["t48_rounds_s"] = [predict_s(split(*row), mf.ModelConfig.flash()) for row in samples]
    return times


def extrapolate(args, run, cfg, params, dtype) -> dict:
    """Per-layer-type times at --extrapolate-isl, and the 48-layer model from them
    (mimo_fn.bench.prefill_check); returns the times."""
    isl = args.extrapolate_isl
    times = layer_type_times(cfg, params, isl, args.chunk, args.mesh, rounds=args.extrapolate_rounds)
    flash = mf.ModelConfig.flash()
    t48 = predict_s(times, flash)
    record(run, {"t48_s": t48, "tok_s_per_gpu": isl / t48, **times, "formula": formula(times, flash)},
           section="extrapolation", dtype=dtype, isl=isl)
    spread = ""
    if "t48_rounds_s" in times:
        per_round = sorted(isl / t for t in times["t48_rounds_s"])
        spread = (f" (medians of {len(per_round)} rounds; each round's own split: "
                  f"{per_round[0]:,.0f}-{per_round[-1]:,.0f})")
    print(f"[{dtype}] {formula(times, flash)} -> {isl / t48:,.0f} input tok/s per GPU at ISL {isl}{spread}", flush=True)
    return times


def layer_groups(cfg) -> dict[str, list[int]]:
    """The MoE layers of cfg by attention type (the slice: layers 1-4 and layer 5)."""
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    return {"SWA MoE layer": [i for i in moe if cfg.is_swa(i)], "full MoE layer": [i for i in moe if not cfg.is_swa(i)]}


def profile_layers(cfg, params, isl: int, chunk: int, mesh=None, times: dict | None = None, iters: int = 3) -> dict:
    """The kernels of one SWA MoE layer and one full MoE layer in a prefill of `isl` tokens in
    chunks of `chunk`: {layer type: {"profile": RangeProfile, "unprofiled_ms": ...}}, per layer
    and per prefill (its chunks summed).

    One profile of the whole model's prefill with options.layer_ranges on, so every decoder layer
    runs in a range "layer{i}" and each kernel goes to the layer that launched it
    (layer_profile.ranged_kernel_ms); a type's profile is the mean over its layers (the slice's four
    SWA layers, its one full layer), so it holds the kernels of exactly one layer, at the context
    the bench's prefill gives it. Profiling sub-models and subtracting them, as the time split of
    `extrapolate` does, would leave per-kernel differences of two noisy profiles, and the embedding
    and head in either. Device times under the profiler are the kernels' own; the profiler slows
    the host, which can open gaps between kernels, so the span of each layer (first kernel start
    to last end) and the layer's time without the profiler (`times`, the extrapolation's split at
    the same isl and chunk, measured here where None) are reported beside the sum."""
    groups = {name: [f"layer{i}" for i in layers] for name, layers in layer_groups(cfg).items() if layers}
    with options.override(layer_ranges=True):
        prof = ranged_kernel_ms(lambda: timed_prefill(cfg, params, [isl], chunk, mesh=mesh), groups, iters=iters)
    times = times or layer_type_times(cfg, params, isl, chunk, mesh)
    key = {"SWA MoE layer": "t_swa_moe_s", "full MoE layer": "t_full_moe_s"}
    return {name: {"profile": p, "unprofiled_ms": times[key[name]] * 1e3} for name, p in prof.items()}


def layer_report(args, run, cfg, params, dtype: str, times: dict | None = None) -> str:
    """--profile-layers for one weight format: the tables (returned, printed after the run's table)
    and a row per layer type (its kernels' ms and calls, the busy, span and unprofiled ms)."""
    isl = args.extrapolate_isl or args.chunk  # the extrapolation's isl where it ran: its split is reused
    out = []
    for name, res in profile_layers(cfg, params, isl, args.chunk, args.mesh, times).items():
        p = res["profile"]
        record(run, {"busy_ms": p.busy_ms, "span_ms": p.span_ms, "unprofiled_ms": res["unprofiled_ms"],
                     "kernels_ms": {k: ms for k, _, ms in p.rows}, "kernel_calls": {k: n for k, n, _ in p.rows}},
               section="layer_profile", dtype=dtype, isl=isl, layer_type=name)
        layers = layer_groups(cfg)[name]
        which = f"layer {layers[0]}" if len(layers) == 1 else f"mean of layers {', '.join(map(str, layers))}"
        title = (f"[{dtype}] one {name} ({which}), 1 x {isl} tokens in chunks of {args.chunk}: "
                 f"{'device' if torch.cuda.is_available() else 'CPU op self'} ms per layer and prefill")
        out.append(format_table(p.rows, title) + "\n"
                   f"under the profiler: kernels {p.busy_ms:.3f} ms, span {p.span_ms:.3f} ms (first kernel's start "
                   f"to last one's end, chunks summed); without it: {res['unprofiled_ms']:.3f} ms (host clock, "
                   "the extrapolation's split)")
    return "\n\n".join(out)


def against_hf(args, run, cfg, base) -> list[dict]:
    """transformers on the same bf16 weights: speed and the last-token logits."""
    dev = base.embed.device
    model, rows = hf_model(cfg, base), []
    for isl in args.hf_isl:
        timed_prefill(cfg, base, [isl], args.chunk)  # warm-up: the cases may not have run this ISL
        runs = [timed_prefill(cfg, base, [isl], args.chunk) for _ in range(2)]  # the better of two, as above
        dt_ours = min(r[0] for r in runs)
        _, ours, prompts = runs[-1]
        ids = prompts[0][None].to(dev)
        with torch.no_grad():
            model(ids[:, :512], logits_to_keep=1)  # warm-up
            sync()
            t0 = time.perf_counter()
            ref = model(ids, logits_to_keep=1).logits[0, -1].float()
            sync()
            dt_hf = time.perf_counter() - t0
        cos = torch.nn.functional.cosine_similarity(ours[0].float(), ref, dim=0).item()
        rel = ((ours[0].float() - ref).abs().max() / ref.abs().max()).item()
        res = {"hf_tok_s": isl / dt_hf, "ours_tok_s": isl / dt_ours, "speedup": dt_hf / dt_ours,
               "logits_cosine": cos, "logits_rel_err": rel, "same_argmax": int(ours[0].argmax()) == int(ref.argmax())}
        rows.append({"isl": isl, **res})
        record(run, res, section="hf", dtype="bf16", isl=isl)
        print(f"transformers ISL {isl}: {res['hf_tok_s']:,.0f} tok/s vs ours {res['ours_tok_s']:,.0f} "
              f"({res['speedup']:.1f}x), logits cosine {cos:.5f}, rel err {rel:.2e}", flush=True)
    del model
    return rows


def main(args, run) -> None:
    if args.plot:
        from mimo_fn.bench.plot import pyplot

        pyplot()  # fail now, not after the run, where matplotlib is missing
    if args.check_layers and not args.extrapolate_isl:
        raise SystemExit("--check-layers compares with the per-layer times of the extrapolation: give "
                         "--extrapolate-isl > 0")
    if args.extrapolate_rounds < 1:
        raise SystemExit(f"--extrapolate-rounds must be at least 1, got {args.extrapolate_rounds}")
    dev = torch.device("cuda")
    args.mesh = init_mesh(fake_balanced_routing=args.routing == "fake")
    torch.manual_seed(0)
    peaks = gemm_peaks("cuda")
    record(run, peaks, section="peaks")
    print("peaks:", peaks, flush=True)
    cfg = flash_slice()
    # MXFP4 experts run bf16 MMAs (weights dequantised in the kernel), FP8 attention FP8 ones: its
    # MFU is against the bf16 peak, an upper bound on what the mix could reach
    peak = {"bf16": peaks["bf16_tflops"], "fp8": peaks.get("fp8_rowwise_tflops", float("nan")),
            "mxfp4": peaks["bf16_tflops"]}
    shapes = [[isl] for isl in args.isl] + [[isl // args.batch] * args.batch for isl in args.isl[:2]]
    # one weight format on the card at a time (the bf16 slice alone fills most of an 80 GB card), bf16
    # last: transformers compares against it after the cases
    dtypes = sorted(args.dtypes, key=lambda d: d == "bf16")
    rows, times, base, layer_tables = [], {}, None, []
    bar = tqdm(total=len(dtypes) * len(shapes), desc="prefill cases")
    for dtype in dtypes:
        t0 = time.perf_counter()
        params = slice_params(cfg, dtype, dev)
        print(f"init 6-layer slice, {dtype}: {time.perf_counter() - t0:.1f}s, "
              f"{mf.params.weight_bytes(params) / 2**30:.1f} GiB", flush=True)
        for seq_lens in shapes:
            timed_prefill(cfg, params, [min(seq_lens[0], 2048)], args.chunk, mesh=args.mesh)  # warm-up: compile
            torch.cuda.reset_peak_memory_stats()
            dt = min(timed_prefill(cfg, params, seq_lens, args.chunk, mesh=args.mesh)[0] for _ in range(2))
            flops = prefill_flops(cfg, seq_lens)
            res = {"tokens": sum(seq_lens), "seconds": dt, "tok_s": sum(seq_lens) / dt, "tflops": flops / dt / 1e12,
                   "mfu": flops / dt / 1e12 / peak[dtype], "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}
            if seq_lens[0] in (8192, 32768, 65536) and len(seq_lens) == 1:
                res["split"] = time_split(cfg, params, seq_lens, args.chunk, args.mesh)
            record(run, res, section="case", dtype=dtype, seq_lens=seq_lens)
            rows.append({"dtype": dtype, "seqs": f"{len(seq_lens)}x{seq_lens[0]}", **res})
            bar.update()
            tqdm.write(f"{dtype} {seq_lens}: {res['tok_s']:,.0f} tok/s, {res['tflops']:.0f} TFLOP/s, "
                       f"MFU {res['mfu']:.1%}, {res['peak_mem_gib']:.1f} GiB")
        if args.extrapolate_isl:
            times[dtype] = extrapolate(args, run, cfg, params, dtype)
        if args.profile_layers:
            layer_tables.append(layer_report(args, run, cfg, params, dtype, times.get(dtype)))
        if dtype == "bf16" and not args.no_hf:
            base = params
        del params
        torch.cuda.empty_cache()
    bar.close()

    if not args.no_hf:  # transformers on the same bf16 weights (drawn now where no bf16 case ran)
        base = base if base is not None else slice_params(cfg, "bf16", dev)
        hf = against_hf(args, run, cfg, base)
        base = None
        torch.cuda.empty_cache()
    else:
        hf = []
    for dtype in dtypes if args.check_layers else ():  # the slice's weights are gone: room for the deeper model
        check(args, run, dtype, times[dtype], dev)
    if args.plot:
        plot(rows, hf, args.plot, f"MiMo-V2-Flash prefill, {run.device}, {run.date}")
    print_table(rows, [("dtype", "dtype", ""), ("seqs", "seqs", ""), ("tok/s", "tok_s", ",.0f"),
                       ("TFLOP/s", "tflops", ".0f"), ("MFU", "mfu", ".1%"), ("GiB", "peak_mem_gib", ".1f")])
    for table in layer_tables:
        print(f"\n{table}", flush=True)


def plot(rows: list[dict], hf: list[dict], path: str, title: str) -> None:
    from mimo_fn.bench.plot import line_plot

    tok_s, mfu = {}, {}
    for dtype in sorted({r["dtype"] for r in rows}):
        one = [r for r in rows if r["dtype"] == dtype and r["seqs"].startswith("1x")]
        tok_s[f"mimo_fn {dtype}"] = ([r["tokens"] for r in one], [r["tok_s"] for r in one])
        mfu[f"mimo_fn {dtype}"] = ([r["tokens"] for r in one], [r["mfu"] for r in one])
    if hf:
        tok_s["transformers bf16"] = ([r["isl"] for r in hf], [r["hf_tok_s"] for r in hf])
    line_plot(path, [{"xlabel": "ISL (tokens)", "ylabel": "tokens/s (6-layer slice)", "series": tok_s, "logx": 2},
                     {"xlabel": "ISL (tokens)", "ylabel": "MFU", "series": mfu, "logx": 2}], title)
    print(f"wrote {path}")
