"""Where a speculative decoding step's time goes: plain decode, verifying host-made random drafts,
an oracle (plain greedy's own tokens as drafts) and a DFlash draft (random weights), ms per step
of Engine.generate; then, for DFlash, the GPU's kernel time by kernel under the profiler and the
step's phases, each synchronised before and after (its GPU time plus its host time), and the
GPU's idle time in the verify steps by what the host was doing meanwhile (the phases, unsynced,
as profiler ranges): the host work a step does not hide.

The target is the benchmarks' quieted FP8 slice (`bench spec --trained`'s: experts in FP8, layer
outputs divided by 8,192), CUDA graphs on. The oracle's drafts stop matching where a verify
step's rounding first parts from plain decoding, so its acceptance is a lower bound.

    python scripts/spec_step_profile.py [--batch 1] [--new 64] [--drafts 7]
    python scripts/spec_step_profile.py --device cpu --new 6   # the tiny model, a smoke run
"""

import argparse
import collections
import random
import time

import torch

import mimo_fn as mf
import mimo_fn.engine.passes as passes
import mimo_fn.model as model
from mimo_fn import options
from mimo_fn.bench.workload import flash_slice
from mimo_fn.cli_help import HelpFormatter
from mimo_fn.params import random_params
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.train_dflash import default_target_layers

PROMPT = 512


class RandomDrafts:
    def __init__(self, vocab: int):
        self.vocab, self.rng = vocab, random.Random(0)

    def propose(self, rid, tokens, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]


class Oracle:
    """Plain greedy decoding's continuation of each prompt, as drafts."""

    def __init__(self, prompts, continuations):
        self.want = {tuple(p): c for p, c in zip(prompts, continuations)}

    def propose(self, rid, tokens, k):
        tokens = list(tokens)
        cont = self.want[tuple(tokens[:PROMPT])]
        return cont[len(tokens) - PROMPT:len(tokens) - PROMPT + k]


def wrap(obj, attr, around, originals):
    """Replace obj.attr by around(fn) (fn: the original), noted in originals to be put back."""
    fn = getattr(obj, attr)
    originals.append((obj, attr, fn))
    setattr(obj, attr, around(fn))


def ranged(name):
    """around() for wrap: the call as a profiler range named spec/<name>."""
    def around(fn):
        def call(*a, **kw):
            with torch.profiler.record_function(f"spec/{name}"):
                return fn(*a, **kw)
        return call
    return around


def on_gpu(ev) -> bool:
    """A kernel or copy on the GPU's timeline, not the GPU-side span the profiler also records for
    each of our ranges (first to last kernel launched inside it, gaps included)."""
    return ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("spec/")


def idle_by_phase(prof) -> tuple[float, float, dict[str, float]]:
    """(window us, GPU idle us, idle us by the innermost spec/ range the host was in) over the
    window from the first verify pass's start to the last one's end."""
    busy, ranges = [], []
    for ev in prof.events():
        if on_gpu(ev):
            busy.append((ev.time_range.start, ev.time_range.end))
        elif ev.device_type != torch.autograd.DeviceType.CUDA and ev.name.startswith("spec/"):
            ranges.append((ev.time_range.start, ev.time_range.end, ev.name[5:]))
    passes_ = [(s, e) for s, e, n in ranges if n == "verify pass"]
    lo, hi = min(s for s, _ in passes_), max(e for _, e in passes_)
    cuts = sorted({lo, hi} | {t for iv in busy for t in iv if lo < t < hi}
                  | {t for s, e, _ in ranges for t in (s, e) if lo < t < hi})
    busy.sort()
    idle, by, k, reach = 0.0, collections.Counter(), 0, float("-inf")
    for a, b in zip(cuts, cuts[1:]):  # elementary segments: busy or idle throughout, one innermost range
        while k < len(busy) and busy[k][0] <= a:
            reach = max(reach, busy[k][1])
            k += 1
        if reach >= b:
            continue
        idle += b - a
        inner = min(((e - s, n) for s, e, n in ranges if s <= a and b <= e), default=(0, "(outside every range)"))
        by[inner[1]] += b - a
    return hi - lo, idle, dict(by)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--drafts", type=int, default=7, help="draft tokens a step (DFlash block = drafts + 1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                    help="cuda: the quieted FP8 slice; cpu: the tiny model, a smoke run")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("spec_step_profile.py: --device cuda needs a CUDA GPU (none is visible to torch)")
    cfg = flash_slice() if dev == "cuda" else mf.ModelConfig.tiny()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    params = random_params(cfg, 0, dtype, dev, quantize="fp8" if dev == "cuda" else None, quiet=8192.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (PROMPT,), generator=gen).tolist() for _ in range(args.batch)]

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def engine(k, proposer=None):
        return mf.Engine(cfg, params, mf.EngineConfig(max_tokens=args.batch * (PROMPT + args.new + 256),
                                                      num_draft_tokens=k, proposer=proposer))

    def timed(e, new):
        e.generate(prompts, new)  # compiles and captures outside the timing
        sync()
        t = time.perf_counter()
        outs = e.generate(prompts, new)
        sync()
        return time.perf_counter() - t, outs

    rows = []
    with options.override(moe_autotune=False):
        t_pre, _ = timed(engine(0), 1)  # the prompts' prefill alone, taken off every row
        t_plain, outs = timed(engine(0), args.new)
        rows.append(("plain decode", (t_plain - t_pre) / (args.new - 1) * 1e3, args.new - 1, 1.0))
        dcfg = DFlashConfig(target_layers=default_target_layers(cfg.num_layers), mask_token_id=cfg.vocab_size - 1,
                            block_size=args.drafts + 1, num_layers=2)
        draft = DFlashProposer(init_dflash(cfg, dcfg, dtype=dtype, device=dev), dcfg, params, cfg)
        for name, proposer in [("random drafts", RandomDrafts(cfg.vocab_size)),
                               ("oracle drafts", Oracle(prompts, [o.tokens for o in outs])), ("dflash", draft)]:
            e = engine(args.drafts, proposer)
            t, _ = timed(e, args.new)
            st = e.spec_stats()
            rows.append((name, (t - t_pre) / st["steps"] * 1e3, st["steps"], st["mean_accept_length"]))
        from torch.profiler import ProfilerActivity, profile

        originals = []
        for obj, attr, name in [(passes.Passes, "_spec_pass", "verify pass"), (passes, "prefill", "verify forward"),
                                (model, "step_meta", "step metadata"), (passes, "accept_each", "accept"),
                                (passes, "truncate", "truncate"), (mf.Engine, "_schedule", "scheduler"),
                                (draft, "propose_device", "propose"), (draft, "propose_many", "propose"),
                                (draft, "observe_verified", "observe")]:
            if hasattr(obj, attr):  # (an older checkout's proposer may lack one)
                wrap(obj, attr, ranged(name), originals)
        try:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])) as prof:
                e.generate(prompts, args.new)
                sync()
        finally:
            for obj, attr, fn in reversed(originals):
                setattr(obj, attr, fn)
        by_kernel, calls = collections.Counter(), collections.Counter()
        for ev in prof.events():
            if on_gpu(ev):
                by_kernel[ev.name[:70]] += ev.device_time
                calls[ev.name[:70]] += 1
        steps = e.spec_stats()["steps"]
        print(f"DFlash generate under the profiler: GPU kernels {sum(by_kernel.values()) / 1e3:.1f} ms "
              f"(the prompts' prefill included) over {steps} verify steps")
        for name, us in by_kernel.most_common(20):
            print(f"{us / 1e3:9.2f} ms {calls[name]:6d}  {name}")
        if dev == "cuda":
            window, idle, by = idle_by_phase(prof)
            busy = (window - idle) / steps / 1e3
            print(f"GPU busy in the verify passes {busy:.3f} ms a step: the unprofiled step ({rows[-1][1]:.3f} ms) idles "
                  f"~{rows[-1][1] - busy:.3f}. Under the profiler it idles {idle / steps / 1e3:.3f} of "
                  f"{window / steps / 1e3:.3f} ms a step; by what the host was in (innermost range), ms a step:")
            for name, us in sorted(by.items(), key=lambda kv: -kv[1]):
                print(f"  {name:22s} {us / steps / 1e3:7.3f}")
        phase_s, phase_n, originals = collections.Counter(), collections.Counter(), []

        def synced(fn):
            name = fn.__name__

            def call(*a, **kw):
                sync()
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                sync()
                phase_s[name] += time.perf_counter() - t0
                phase_n[name] += 1
                return out
            return call

        for attr in ("prefill", "accept_each", "truncate"):  # the engine's passes call these by module name
            wrap(passes, attr, synced, originals)
        for attr in ("propose_device", "propose_many", "observe_verified"):
            if hasattr(draft, attr):
                wrap(draft, attr, synced, originals)
        try:
            e.generate(prompts, args.new)
        finally:
            for obj, attr, fn in originals:
                setattr(obj, attr, fn)
    print("phases, each synchronised (ms a call; prefill counts the prompts' prefill once too):")
    for attr, s in phase_s.items():
        print(f"  {attr:18s} {s * 1e3 / phase_n[attr]:7.3f} x {phase_n[attr]}")
    print(f"{'drafts':14s} {'ms / step':>9s} {'steps':>6s} {'accept':>7s}")
    for name, ms, steps, acc in rows:
        print(f"{name:14s} {ms:9.3f} {steps:6d} {acc:7.3f}")


if __name__ == "__main__":
    main()
