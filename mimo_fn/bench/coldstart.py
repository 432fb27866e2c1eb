"""Cold start: a fresh process's engine after warmup(), its first call against the next; checkpoint load speed.

Every measurement runs in a fresh process (`python -m mimo_fn.bench.coldstart <part> <json>`), so
nothing compiled, tuned or allocated by an earlier one is in memory.
  start   the engine `python -m mimo_fn.serve --load-format dummy` builds for the model (random
          weights in --quantization, the server's pool and --chunk), Engine.warmup() (what the
          server runs before it reports healthy), then one generate of --prompts random prompts of
          --isl tokens (1 new token each): the first call, then the same call --repeats times more
          (steady: the best). Goal: first / steady <= 1.2. All runs share one Triton cache dir
          (TRITON_CACHE_DIR: the compiled kernels, and the MoE autotuners' picks,
          mimo_fn.kernels.autotune_cache), by default a new temp dir: the first run starts on a
          cold disk, the later ones find what it left (warm disk). --autotune-cache-ab adds a
          warm-disk run whose autotuners keep no picks (options.autotune_cache off, as
          MIMO_FN_AUTOTUNE_CACHE=0): the kernels are compiled already, the picks tuned anew.
  load    the model's weights (--load-layers layers, in --quantization) written by
          mf.save_checkpoint (shards of --shard-gb) to a temp dir, then read back twice, each read
          after the files are dropped from the page cache (fsync + posix_fadvise DONTNEED; a file
          system that ignores it reads from memory): raw (safetensors.torch.load_file of every file
          onto the device) and mf.load_checkpoint; GB/s of each over the files' bytes. A third raw
          read, from the page cache, shows what memory speed would allow.

    python -m mimo_fn.bench coldstart                              # slice, FP8, 8 x 16K prompts; load of 2 layers
    python -m mimo_fn.bench coldstart --parts start --autotune-cache-ab --json coldstart.jsonl
    python -m mimo_fn.bench coldstart --device cpu --prompts 2 --isl 32 --chunk 128 --max-total-tokens 1024  # tiny
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import sync, wall_s
from mimo_fn.bench.workload import add_model_args, model_setup

NEEDS_CUDA = False
_MARK = "coldstart-result "  # the line a measuring process prints its results on


def add_args(ap) -> None:
    ap.add_argument("--parts", nargs="+", choices=["start", "load"], default=["start", "load"],
                    help="start: warm-up, first and steady call; load: raw read vs load_checkpoint")
    add_model_args(ap)
    ap.add_argument("--layers", type=int, default=6, help="layers of the flash-slice model the engine runs")
    ap.add_argument("--quantization", choices=["none", "fp8", "mxfp4"], default=None,
                    help="weight format, as the server's --quantization; none: bf16 on CUDA, fp32 on the CPU "
                         "(default: fp8 on CUDA, none on the CPU, where the tiny model's dims hold no FP8 checkpoint)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts in the timed generate call")
    ap.add_argument("--isl", type=int, default=16384, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill chunk (the server's --chunked-prefill-size)")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool tokens (default: the server's rule, what the free memory holds)")
    ap.add_argument("--runs", type=int, default=2, help="start processes in one Triton cache dir (first: cold disk)")
    ap.add_argument("--repeats", type=int, default=2, help="steady calls after the first (the best counts)")
    ap.add_argument("--autotune-cache-ab", action="store_true",
                    help="one more warm-disk start whose MoE autotuners keep no picks (MIMO_FN_AUTOTUNE_CACHE=0)")
    ap.add_argument("--triton-cache-dir", default=None,
                    help="Triton cache dir of the start runs (kept, never cleared) (default: a new temp dir, removed)")
    ap.add_argument("--load-layers", type=int, default=2, help="layers of the flash-slice model the load part writes")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="safetensors shard size of the written checkpoint")
    ap.add_argument("--load-dir", default=None, help="where the checkpoint is written (default: the temp dir)")


# ---------------------------------------------------------------- the measuring processes


def _config(o: dict, layers: int):
    import mimo_fn as mf

    return mf.ModelConfig.flash(num_layers=layers) if o["model"] == "flash-slice" else mf.ModelConfig.tiny()


def start_process(o: dict) -> dict:
    """Build the server's engine, warm it up, time the first and the steady generate; the MoE
    autotuners keep their picks across processes where o["autotune_cache"] says so."""
    from mimo_fn import options

    with options.override(autotune_cache=o["autotune_cache"]):
        return _start(o)


def _start(o: dict) -> dict:
    from mimo_fn.serve.args import ServerArgs
    from mimo_fn.serve.launch import build_engine, init_distributed, mesh_for

    t0 = time.perf_counter()
    sargs = ServerArgs(model_path=o["model_dir"], load_format="dummy" if o["model_dir"] else "auto",
                       quantization=None if o["quantization"] == "none" else o["quantization"], device=o["device"],
                       chunked_prefill_size=o["chunk"], max_total_tokens=o["max_total_tokens"])
    device = init_distributed(sargs)
    engine, cfg, _, _ = build_engine(sargs, device, mesh_for(sargs))
    sync()  # the weights are drawn
    build_s = time.perf_counter() - t0
    warmup_s, _ = wall_s(engine.warmup)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (o["prompts"], o["isl"]), generator=gen).tolist()

    def call():
        return engine.generate(prompts, max_new_tokens=1)

    first_s, _ = wall_s(call)
    steady_s = min(wall_s(call)[0] for _ in range(o["repeats"]))
    return {"build_s": build_s, "warmup_s": warmup_s, "first_s": first_s,
            "steady_s": steady_s, "first_over_steady": first_s / steady_s}


def evict(files: list[str]) -> bool:
    """Drop the files' pages from the page cache (written back first); False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def load_process(o: dict) -> dict:
    """Write a checkpoint, then time a raw safetensors read of its files against load_checkpoint."""
    import mimo_fn as mf
    from mimo_fn.checkpoint import list_files
    from safetensors.torch import load_file

    cfg = _config(o, o["layers"])
    device = o["device"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    quant = None if o["quantization"] == "none" else o["quantization"]
    params = mf.init_params(cfg, seed=0, dtype=dtype, device=device, quantize=quant)
    sync()
    t0 = time.perf_counter()
    mf.save_checkpoint(params, cfg, o["dir"], max_shard_bytes=int(o["shard_gb"] * 1e9))
    save_s = time.perf_counter() - t0
    del params
    files = list_files(o["dir"])
    gb = sum(os.path.getsize(f) for f in files) / 1e9

    def raw():
        return [load_file(f, device=device) for f in files]

    def drop():
        if device == "cuda":
            torch.cuda.empty_cache()

    evicted = evict(files)
    raw_s, out = wall_s(raw)
    del out
    drop()
    evict(files)
    load_s, out = wall_s(lambda: mf.load_checkpoint(o["dir"], dtype=dtype, device=device, progress=False))
    del out
    drop()
    raw_cached_s, out = wall_s(raw)  # the pages are in memory now
    return {"gb": gb, "files": len(files), "save_s": save_s, "raw_s": raw_s, "load_s": load_s,
            "raw_gb_s": gb / raw_s, "load_gb_s": gb / load_s, "load_over_raw": load_s / raw_s,
            "raw_cached_gb_s": gb / raw_cached_s, "evicted": evicted}


# ---------------------------------------------------------------- the parent


def spawn(part: str, opts: dict, env: dict | None = None) -> dict:
    """Run one measuring process; its results and process_s (its whole life: start-up, imports and
    all), or SystemExit naming the part where it failed."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH"))
                                                                       if p)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mimo_fn.bench.coldstart", part, json.dumps(opts)], env=env,
                       stdout=subprocess.PIPE, text=True)
    process_s = time.perf_counter() - t0
    found = [line for line in p.stdout.splitlines() if line.startswith(_MARK)]
    other = "\n".join(line for line in p.stdout.splitlines() if not line.startswith(_MARK))
    if other:
        print(other, flush=True)
    if p.returncode != 0 or not found:
        raise SystemExit(f"coldstart: the {part} process failed (exit code {p.returncode}); its output is above")
    return {**json.loads(found[-1][len(_MARK):]), "process_s": process_s}


def main(args, run) -> None:
    _, device, _ = model_setup(args)  # exits in one line where --device cuda has no GPU
    model = args.model or ("flash-slice" if device == "cuda" else "tiny")
    quantization = args.quantization or ("fp8" if device == "cuda" else "none")
    common = {"model": model, "device": device, "quantization": quantization}
    start_rows, load_rows = [], []
    with tempfile.TemporaryDirectory(prefix="mimo_fn_coldstart_") as tmp:
        if "start" in args.parts:
            model_dir = None
            if model == "flash-slice":  # --load-format dummy draws the weights from config.json alone
                model_dir = os.path.join(tmp, "model")
                os.makedirs(model_dir)
                with open(os.path.join(model_dir, "config.json"), "w") as f:
                    json.dump(_config(common, args.layers).to_hf(), f)
            cache = args.triton_cache_dir or os.path.join(tmp, "triton")
            cold = not os.path.isdir(cache) or not os.listdir(cache)
            cases = [True] * args.runs + ([False] if args.autotune_cache_ab else [])
            for i, picks in enumerate(cases):
                case = ("cold disk" if cold and i == 0 else "warm disk") + ("" if picks else ", picks not kept")
                opts = {**common, "model_dir": model_dir, "prompts": args.prompts, "isl": args.isl,
                        "chunk": args.chunk, "max_total_tokens": args.max_total_tokens, "repeats": args.repeats,
                        "autotune_cache": picks}
                res = spawn("start", opts, {"TRITON_CACHE_DIR": os.path.abspath(cache)})
                record(run, res, part="start", case=case, model=model)
                start_rows.append({"case": case, **res})
                print(f"{case}: warm-up {res['warmup_s']:.2f} s, first call {res['first_s']:.3f} s, "
                      f"steady {res['steady_s']:.3f} s ({res['first_over_steady']:.2f}x)", flush=True)
        if "load" in args.parts:
            ckpt = tempfile.mkdtemp(prefix="ckpt_", dir=args.load_dir or tmp)
            try:
                res = spawn("load", {**common, "layers": args.load_layers, "shard_gb": args.shard_gb, "dir": ckpt})
            finally:
                shutil.rmtree(ckpt, ignore_errors=True)
            record(run, res, part="load", model=model, layers=args.load_layers)
            load_rows.append(res)
    if start_rows:
        print_table(start_rows, [("case", "case", ""), ("process s", "process_s", ".1f"), ("build s", "build_s", ".1f"),
                                 ("warm-up s", "warmup_s", ".2f"), ("first s", "first_s", ".3f"),
                                 ("steady s", "steady_s", ".3f"), ("first/steady", "first_over_steady", ".2f")],
                    f"{args.prompts} x {args.isl} prompts, 1 new token, after warmup() (goal: first/steady <= 1.2)")
    if load_rows:
        print_table(load_rows, [("GB", "gb", ".2f"), ("files", "files", "d"), ("raw GB/s", "raw_gb_s", ".2f"),
                                ("load GB/s", "load_gb_s", ".2f"), ("load/raw time", "load_over_raw", ".2f"),
                                ("cached raw GB/s", "raw_cached_gb_s", ".2f"), ("evicted", "evicted", "")],
                    "checkpoint read: raw safetensors onto the device vs mf.load_checkpoint")


if __name__ == "__main__":
    part, opts = sys.argv[1], json.loads(sys.argv[2])
    result = {"start": start_process, "load": load_process}[part](opts)
    print(_MARK + json.dumps(result), flush=True)
