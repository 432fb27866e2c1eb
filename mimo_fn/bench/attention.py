"""Benchmark the Triton paged attention kernels on one GPU (MiMo-V2-Flash attention shapes).

Layers (one sequence, prefill from an empty cache, bf16, pages of --page-size slots (default: the
engine's, 128) shuffled in the pool):
  full: 64 query heads, 4 kv heads, D=192, E=128, causal
  swa:  64 query heads, 8 kv heads, D=192, E=128, causal, window 128, sinks
        (the one-pass band kernel of kernels/attention/swa.py, "band", what `paged_attention` runs for it on
        CUDA; the block-loop Triton kernel's default beside it)
  sdpa: torch SDPA flash backend, 64 heads, head dim 128, causal (the yardstick)
Each Triton config, and the warp-specialised Gluon kernel ("gluon-ws", what `paged_attention` runs
for full attention on Hopper), is checked against a chunked torch reference at 8K before it is timed.

--fp8 adds, for the full layer, kernels/attention/fp8.py (MIMO_FN_ATTENTION_FP8) beside gluon-ws at the
same --tokens and FLOP count: "fp8" with its quantisers (Q, and the K/V pages; the warp-specialised
Gluon kernel on Hopper), the kernels alone on quantised inputs ("fp8-kernel": Triton, "fp8-ws-kernel":
kernels/attention/fp8_ws.py), and the error against the chunked reference (cosine, max rel err).

  python -m mimo_fn.bench attention [--tokens 8192 32768 65536] [--page-size 128] [--sweep] [--fp8 [--fp8-sweep]]
Timing: mimo_fn.bench.timing.time_ms (do_bench, median). Prints a table last.
"""

import torch
import triton

from mimo_fn.bench.results import record
from mimo_fn.bench.timing import time_ms
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.kernels.attention import decode as attn_decode
from mimo_fn.kernels.attention import dispatch, fp8, fp8_ws, prefill, swa, ws
from mimo_fn.kernels.attention.ref import attend, paged_attention_ref

NEEDS_CUDA = True
DEVICE = "cuda"
DECODE_B, DECODE_L = 32, 16384  # decode: sequences x cached tokens
HBM_BYTES_PER_S = 4.2e12  # H200 copy bandwidth as measured on these machines (~4.3 TB/s)
N_HEADS, D, E = 64, 192, 128
LAYERS = {"full": dict(num_kv_heads=4, window=0, sinks=False), "swa": dict(num_kv_heads=8, window=128, sinks=True)}
C = prefill.PrefillConfig
SWEEP = {
    "full": [C(128, 128, 2, 8, 2), C(128, 128, 1, 8, 2), C(128, 64, 2, 8, 3), C(128, 64, 2, 8, 4), C(64, 64, 2, 4, 3)],
    "swa": [C(64, 32, 8, 4, 2), C(64, 32, 8, 4, 3), C(64, 64, 8, 4, 2), C(128, 32, 8, 4, 2), C(64, 16, 8, 4, 2)],
}
BC = swa.BandConfig
BAND_SWEEP = [BC(block_c=32, num_stages=4), BC(block_m=64, num_warps=4, num_stages=2), BC(max_regs=None)]
F8 = fp8.Fp8Config
FP8_SWEEP = [F8(128, 128, 2, 8, 3), F8(128, 128, 1, 8, 2), F8(128, 64, 2, 8, 3), F8(64, 128, 2, 4, 2)]
DECODE_SWEEP = [attn_decode.DecodeConfig(32, None, 4, 5), attn_decode.DecodeConfig(64, None, 4, 3), attn_decode.DecodeConfig(16, None, 4, 5)]


def flops_causal(T, window, d, e, heads):
    """2 * heads * (d + e) * (visible query-key pairs); pairs = T(T+1)/2, or ~T*window with a window."""
    if window == 0 or window >= T:
        pairs = T * (T + 1) // 2
    else:
        pairs = window * (window + 1) // 2 + (T - window) * window
    return 2 * heads * (d + e) * pairs


def make_layer(T, num_kv_heads, window, sinks, page_size, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    num_pages = triton.cdiv(T, page_size)
    kw = dict(device=DEVICE, dtype=torch.bfloat16, generator=g)
    return dict(
        q_TND=torch.randn(T, N_HEADS, D, **kw),
        k_pages_PSGD=torch.randn(num_pages, page_size, num_kv_heads, D, **kw),
        v_pages_PSGE=torch.randn(num_pages, page_size, num_kv_heads, E, **kw),
        page_table_BL=torch.randperm(num_pages, device=DEVICE, generator=g).to(torch.int32)[None],
        cu_q_B1=torch.tensor([0, T], dtype=torch.int32, device=DEVICE),
        kv_lens_B=torch.tensor([T], dtype=torch.int32, device=DEVICE),
        scale=D**-0.5, window=window,
        sinks_N=torch.randn(N_HEADS, device=DEVICE, generator=g) if sinks else None,
    )


def chunked_reference(p, chunk=1024):
    """`attend` on contiguous K/V gathered from the pages, a chunk of queries at a time (fp32 math)."""
    T = p["q_TND"].shape[0]
    page_size = p["k_pages_PSGD"].shape[1]
    pos = torch.arange(T, device=DEVICE)
    pages = p["page_table_BL"][0, pos // page_size].long()
    k, v = p["k_pages_PSGD"][pages, pos % page_size], p["v_pages_PSGE"][pages, pos % page_size]
    out = torch.empty(T, N_HEADS, E, dtype=torch.bfloat16, device=DEVICE)
    for c0 in range(0, T, chunk):
        c1 = min(c0 + chunk, T)
        k0 = max(0, c0 - p["window"] + 1) if p["window"] else 0
        out[c0:c1] = attend(p["q_TND"][c0:c1], k[k0:c1], v[k0:c1], pos[c0:c1], pos[k0:c1], p["scale"],
                            p["window"], p["sinks_N"])
    return out


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compiled_kernels():
    """Compiled prefill kernels so far (registers / spills / shared memory); best effort across Triton versions."""
    found = []
    try:
        for kernel in (prefill._attn_prefill_kernel, swa._attn_swa_band_kernel, fp8._fp8_attn_kernel):
            for cache in kernel.device_caches.values():
                found += list(cache[0].values())
    except Exception:  # noqa: BLE001  (internal API: report nothing rather than fail the benchmark)
        pass
    return found


def kernel_stats(k):
    try:
        return dict(regs=k.n_regs, spills=k.n_spills, smem=k.metadata.shared)
    except Exception:  # noqa: BLE001
        return {}


WS = "gluon-ws"  # ws.launch_prefill_ws: full attention on Hopper


def short(cfg):
    if cfg == WS:
        return WS
    if isinstance(cfg, BC):
        regs = f"/r{cfg.max_regs}" if cfg.max_regs else ""
        return f"band m{cfg.block_m}/h{cfg.h_pack}/a{cfg.band_a}+{cfg.band_b}/c{cfg.block_c}/w{cfg.num_warps}/s{cfg.num_stages}{regs}"
    regs = f"/r{cfg.max_regs}" if cfg.max_regs else ""
    return f"m{cfg.block_m}/n{cfg.block_n}/h{cfg.h_pack}/w{cfg.num_warps}/s{cfg.num_stages}{regs}"


def launch(p, cfg):
    if cfg == WS:
        return ws.launch_prefill_ws(**p)
    if isinstance(cfg, BC):
        return swa.launch_swa_band(**p, config=cfg)
    return prefill.launch_prefill(**p, config=cfg)


def bench(fn):
    return time_ms(fn, warmup_ms=25, rep_ms=100)


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536],
                    help="prefill lengths T; the shortest is also where each config is checked")
    ap.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="KV page size (slots)")
    ap.add_argument("--sweep", action="store_true", help="time every config in SWEEP, not just the default")
    ap.add_argument("--profile", action="store_true", help="one launch of each default prefill kernel at 8K (for ncu)")
    ap.add_argument("--fp8", action="store_true",
                    help="also the FP8 full-attention kernel (with and without its quantisers) and its error (default: off)")
    ap.add_argument("--fp8-sweep", action="store_true",
                    help="with --fp8: also time the Triton FP8 kernel at every config in FP8_SWEEP and the "
                         "Gluon one at 2 and 4 stages (default: off)")


def fp8_rows(run, p, T, ref=None, sweep=False):
    """--fp8 on the full layer: timed with its quantisers and alone (with --fp8-sweep: at every config
    of FP8_SWEEP too, each checked against the default config's output first); error against ref
    where given."""
    reason = fp8.unsupported_reason(p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], p["window"])
    if reason is not None:
        print(f"full: fp8 not used: {reason}", flush=True)
        return []
    if ref is not None:
        before = {id(k) for k in compiled_kernels()}
        out = fp8.attention_fp8(**p).float()
        print(f"full/fp8 default kernel: {[kernel_stats(k) for k in compiled_kernels() if id(k) not in before]}")
        cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.float().flatten(), 0).item()
        print(f"full T={T} fp8: cos {cos:.6f} max rel err {rel_err(out, ref):.2e}", flush=True)
        record(run, {"cos": cos, "rel_err": rel_err(out, ref)}, layer="full", T=T, config="fp8-error")
    cfg = fp8.default_fp8_config(True, N_HEADS, p["k_pages_PSGD"].shape[2])
    q8, sq = fp8.quantize_q_fp8(p["q_TND"])
    k8, v8, sk, sv = fp8.quantize_paged_kv_fp8(p["k_pages_PSGD"], p["v_pages_PSGE"], p["page_table_BL"],
                                               p["kv_lens_B"], p["cu_q_B1"])
    out = torch.empty(T, N_HEADS, E, dtype=torch.bfloat16, device=DEVICE)
    kernel = (q8, sq, k8, v8, sk, sv, p["page_table_BL"], p["cu_q_B1"], p["kv_lens_B"], p["scale"], p["sinks_N"], out, cfg)
    rows = []
    flops = flops_causal(T, 0, D, E, N_HEADS)
    cases = [("fp8", lambda: fp8.attention_fp8(**p)), ("fp8-kernel", lambda: fp8.launch_fp8_attention(*kernel))]
    has_ws = fp8_ws.unsupported_reason(p["q_TND"], p["k_pages_PSGD"], p["v_pages_PSGE"], 0) is None
    if has_ws:
        ws_args = kernel[:-1] + (fp8.P_SHIFT,)
        if ref is not None:
            err = rel_err(fp8_ws.launch_fp8_ws(*ws_args).clone(), fp8.launch_fp8_attention(*kernel))  # one out buffer
            print(f"full T={T} fp8-ws-kernel: rel err vs fp8-kernel {err:.1e}", flush=True)
        cases.append(("fp8-ws-kernel", lambda: fp8_ws.launch_fp8_ws(*ws_args)))
    for name, fn in cases:
        ms = bench(fn)
        one = dict(layer="full/fp8", T=T, config=name, ms=ms, tflops=flops / ms / 1e9)
        record(run, {"ms": ms, "tflops": one["tflops"]}, layer="full", T=T, config=name)
        print(f"full T={T} {name}: {ms:.3f} ms {one['tflops']:.0f} TFLOP/s", flush=True)
        rows.append(one)
    if not sweep:
        return rows
    want = fp8.launch_fp8_attention(*kernel).float()
    if has_ws:  # the Gluon kernel's ring depth
        for stages in (2, 4):
            name = f"fp8-ws-kernel s{stages}"
            err = rel_err(fp8_ws.launch_fp8_ws(*ws_args, stages=stages), want)
            ms = bench(lambda: fp8_ws.launch_fp8_ws(*ws_args, stages=stages))
            one = dict(layer="full/fp8", T=T, config=name, ms=ms, tflops=flops / ms / 1e9)
            record(run, {"ms": ms, "tflops": one["tflops"]}, layer="full", T=T, config=name, rel_err=err)
            print(f"full T={T} {name}: rel err vs fp8-kernel {err:.1e} {ms:.3f} ms {one['tflops']:.0f} TFLOP/s",
                  flush=True)
            rows.append(one)
    for c in FP8_SWEEP:
        if c == cfg:
            continue
        before = {id(k) for k in compiled_kernels()}
        try:
            err = rel_err(fp8.launch_fp8_attention(*kernel[:-1], c), want)
        except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: skip the config)
            print(f"full/fp8 {c}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        stats = [kernel_stats(k) for k in compiled_kernels() if id(k) not in before]
        name = f"fp8 m{c.block_m}/n{c.block_n}/h{c.h_pack}/w{c.num_warps}/s{c.num_stages}"
        ms = bench(lambda: fp8.launch_fp8_attention(*kernel[:-1], c))
        one = dict(layer="full/fp8", T=T, config=name, ms=ms, tflops=flops / ms / 1e9)
        record(run, {"ms": ms, "tflops": one["tflops"]}, layer="full", T=T, config=name, rel_err=err)
        print(f"full T={T} {name}: rel err vs default {err:.1e} {ms:.3f} ms {one['tflops']:.0f} TFLOP/s {stats}",
              flush=True)
        rows.append(one)
    return rows


def main(args, run):
    page = args.page_size
    if args.profile:
        for layer in LAYERS.values():
            p = make_layer(8192, **layer, page_size=page)
            dispatch.paged_attention(**p)  # what the engine runs for these pages
            torch.cuda.synchronize()
        return
    stamp = f"{run.date} {run.device} torch {torch.__version__} triton {triton.__version__} page_size {page}"
    print(stamp, flush=True)
    rows = []
    for name, layer in LAYERS.items():
        default = prefill.default_prefill_config(N_HEADS, layer["num_kv_heads"], layer["window"], True, page)
        configs = [default] + [c for c in SWEEP[name] if c != default] if args.sweep else [default]
        probe = make_layer(128, **layer, page_size=page)
        reason = ws.unsupported_reason(probe["q_TND"], probe["k_pages_PSGD"], probe["v_pages_PSGE"],
                                                 layer["window"])
        print(f"{name}: gluon-ws {'runs' if reason is None else 'not used: ' + reason}", flush=True)
        triton_default = default
        if reason is None:  # what paged_attention runs: the default; the Triton configs are compared
            default, configs = WS, [WS] + configs
        band = swa.default_band_config(N_HEADS, layer["num_kv_heads"], True)
        if layer["window"] and swa.unsupported_reason(N_HEADS, layer["num_kv_heads"], layer["window"],
                                                                band) is None:
            default, configs = band, [band] + (BAND_SWEEP if args.sweep else []) + configs
        del probe
        ok = {}
        for T in args.tokens:
            p = make_layer(T, **layer, page_size=page)
            ref = None
            if T == min(args.tokens):
                ref = chunked_reference(p)
                for cfg in configs:
                    before = {id(k) for k in compiled_kernels()}
                    try:
                        err = rel_err(launch(p, cfg), ref)
                    except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: skip the config)
                        print(f"{name} {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    stats = [kernel_stats(k) for k in compiled_kernels() if id(k) not in before]
                    print(f"{name} T={T} {cfg}: rel err {err:.2e} {stats}", flush=True)
                    if err <= 1e-2:
                        ok[cfg] = err
            flops = flops_causal(T, layer["window"], D, E, N_HEADS)
            nbytes = 2 * T * (N_HEADS * D + layer["num_kv_heads"] * (D + E) + N_HEADS * E)
            best, triton_run = None, None
            for cfg in ok:
                ms = bench(lambda: launch(p, cfg))
                one = dict(layer=name, T=T, config=short(cfg), ms=ms, tflops=flops / ms / 1e9,
                           min_ms=nbytes / HBM_BYTES_PER_S * 1e3 if layer["window"] else None, default=cfg == default)
                record(run, {k: one[k] for k in ("ms", "tflops", "min_ms")}, layer=name, T=T, config=one["config"],
                       default=one["default"], rel_err=ok[cfg])
                print(f"{name} T={T} {cfg}: {ms:.3f} ms {one['tflops']:.0f} TFLOP/s", flush=True)
                if best is None or ms < best["ms"]:
                    best = one
                if cfg == default:
                    default_ms = ms
                if cfg == triton_default:
                    triton_run = one
            if best is not None:
                rows.append({**best, "default_ms": default_ms if default in ok else None})
            if default != triton_default and triton_run is not None:  # the Triton kernel's default, side by side
                rows.append({**triton_run, "layer": f"{name}/tri", "default_ms": None})
            if args.fp8 and layer["window"] == 0:
                rows += fp8_rows(run, p, T, ref, args.fp8_sweep)
            del p, ref
            torch.cuda.empty_cache()

    # yardstick: SDPA flash, head dim 128, causal, same T
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for T in args.tokens:
        q, k, v = (torch.randn(1, N_HEADS, T, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        one = dict(layer="sdpa128", T=T, config="flash", ms=ms, tflops=flops_causal(T, 0, 128, 128, N_HEADS) / ms / 1e9)
        record(run, {"ms": ms, "tflops": one["tflops"]}, layer="sdpa128", T=T, config="flash")
        rows.append(one)
        del q, k, v

    # decode: 32 sequences x 16K cached tokens on a full layer (memory-bound: K/V read once)
    B, L = DECODE_B, DECODE_L
    num_pages = B * L // page
    g = torch.Generator(device=DEVICE).manual_seed(1)
    dp = dict(q_TND=torch.randn(B, N_HEADS, D, device=DEVICE, dtype=torch.bfloat16, generator=g),
              k_pages_PSGD=torch.randn(num_pages, page, 4, D, device=DEVICE, dtype=torch.bfloat16, generator=g),
              v_pages_PSGE=torch.randn(num_pages, page, 4, E, device=DEVICE, dtype=torch.bfloat16, generator=g),
              page_table_BL=torch.randperm(num_pages, device=DEVICE, generator=g).to(torch.int32).view(B, -1),
              cu_q_B1=torch.arange(B + 1, device=DEVICE, dtype=torch.int32),
              kv_lens_B=torch.full((B,), L, device=DEVICE, dtype=torch.int32), scale=D**-0.5, window=0, sinks_N=None)
    ref = paged_attention_ref(**dp)
    kv_bytes = B * L * 4 * (D + E) * 2
    best = None
    for cfg in DECODE_SWEEP if args.sweep else DECODE_SWEEP[:1]:
        err = rel_err(attn_decode.launch_decode(**dp, config=cfg), ref)
        ms = bench(lambda: attn_decode.launch_decode(**dp, config=cfg))
        one = dict(layer="decode", T=B, config=f"B={B} kv={L} n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}", ms=ms,
                   tflops=2 * B * L * N_HEADS * (D + E) / ms / 1e9, min_ms=kv_bytes / HBM_BYTES_PER_S * 1e3, err=err)
        print(f"decode {cfg}: rel err {err:.2e} {ms:.3f} ms ({kv_bytes / ms / 1e6:.0f} GB/s)", flush=True)
        record(run, {k: one[k] for k in ("ms", "tflops", "min_ms")}, layer="decode", T=B, kv_tokens=L,
               config=one["config"], rel_err=err)
        if err <= 1e-2 and (best is None or ms < best["ms"]):
            best = one
    if best is not None:
        rows.append(best)

    print("\nTFLOP/s = 2*N*(D+E)*pairs / time; pairs = T(T+1)/2 causal, sum_i min(i+1, window) with a window;"
          " min = (q + k + v read + o written bytes) / 4.2 TB/s")
    print(f"{stamp}")
    print(f"{'layer':8} {'T':>6} {'ms':>9} {'TFLOP/s':>8} {'min ms':>8} {'x min':>6} {'dflt ms':>8}  best config")
    for r in rows:
        min_ms, dflt = r.get("min_ms"), r.get("default_ms")
        ratio = f"{r['ms'] / min_ms:6.2f}" if min_ms else "     -"
        min_s = f"{min_ms:8.3f}" if min_ms else "       -"
        dflt_s = f"{dflt:8.3f}" if dflt else "       -"
        print(f"{r['layer']:8} {r['T']:>6} {r['ms']:9.3f} {r['tflops']:8.0f} {min_s} {ratio} {dflt_s}  {r['config']}")
