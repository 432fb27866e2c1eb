"""`python -m mimo_fn.bench <what> [options]`: the benchmarks' one entry point.

Each benchmark is a module of this package with
  NEEDS_CUDA      True where it cannot run without a GPU (it then exits with one line)
  add_args(ap)    its options, each with help; defaults are shown by --help
  main(args, run) the measurement: rows recorded through results.record(run, ...), a table last
and every one takes --json FILE (alias --output-file): append the rows to FILE as JSON lines.
"""

import argparse
import importlib
import sys
from types import ModuleType

from mimo_fn.cli_help import HelpFormatter  # noqa: F401 (the scripts import it from here too)

# name -> one line; the module is mimo_fn.bench.<name with - as _>, imported only when run
BENCHES = {
    "prefill": "prefill of the 6-layer slice at the released dims: tok/s, MFU, time split, vs transformers",
    "attention": "the paged attention kernels (full, sliding window, decode) against SDPA flash",
    "attention-fp8": "FP8 full attention on the slice: logits and greedy tokens against bf16 and the reference",
    "moe": "the MoE expert layer: our bf16 / FP8 kernels against torch grouped_mm (and sweeps, probes)",
    "moe-mxfp4": "the MoE layer with MXFP4 experts against the bf16 and FP8 layers",
    "moe-align": "moe_align's kernels one by one under launch-shape variants",
    "moe-energy": "energy per MoE layer under sustained load (NVML)",
    "mxfp4-paths": "slice prefill with MXFP4 experts: in-GEMM dequantisation against the dequantised copy",
    "fp8": "FP8 block-scaled linear against bf16, quant-into-packet bandwidth; --decode: decode sizes",
    "norm": "the RMSNorm kernel against the torch reference",
    "router": "router logits: the 16-bit GEMM with fp32 output against the fp32 GEMM",
    "packed-gather": "packed FP8 all-gather against two FP8 collectives and bf16 (torchrun, NCCL)",
    "decode": "decode steps through mf.decode, eager and from CUDA graphs",
    "generate": "Engine.generate's decode steps with overlap on and off",
    "spec": "speculative decoding: verify steps (random drafts, DFlash) against plain decode steps",
    "share": "GRPO-style copies of each prompt with share_prompts on and off",
    "prefix-cache": "multi-turn rollouts with the prefix cache on and off",
    "deterministic": "deterministic mode on and off: prefill tok/s and decode step time on the slice",
    "host": "the engine's host time per step, with a stub model (CPU)",
    "coldstart": "a fresh process: warmup(), then its first call against the steady one; checkpoint load vs raw read",
    "serve-bare": "the engine python -m mimo_fn.serve builds, driven in-process (beside bench_serving)",
    "rl-memory": "release / resume of GPU memory by tag",
    "rl-step": "a colocated RL step: generate around release_memory / resume_memory",
    "weight-sync": "RL weight sync: update_weights of every weight, in place",
    "colocated": "a colocated RL step in two processes: trainer and server on one GPU, weights by CUDA IPC",
    "mesh": "multi-GPU prefill sweep over one DP / TP / EP layout (torchrun)",
    "mesh-decode": "decode steps on a mesh: the two EP dispatches, eager and from CUDA graphs (torchrun)",
    "mesh-generate": "Engine.generate's decode steps on a mesh, eager and with CUDA graphs (torchrun)",
    "table": "print --json rows as a markdown table (command, device, date, figures)",
    "plot": "plot --json rows: one figure against a parameter (needs matplotlib)",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(f"mimo_fn.bench.{name.replace('-', '_')}")


def bench_parser(name: str, mod: ModuleType | None = None) -> argparse.ArgumentParser:
    mod = mod or module(name)
    ap = argparse.ArgumentParser(prog=f"python -m mimo_fn.bench {name}", description=mod.__doc__,
                                 formatter_class=HelpFormatter)
    mod.add_args(ap)
    if name not in ("table", "plot"):
        ap.add_argument("--json", "--output-file", dest="json", metavar="FILE", default=None,
                        help="append one JSON row per result to FILE (JSON lines; see mimo_fn.bench.results) "
                             "(default: none, the table only)")
    return ap


def top_parser() -> argparse.ArgumentParser:
    width = max(map(len, BENCHES))
    listing = "\n".join(f"  {name:{width}}  {line}" for name, line in BENCHES.items())
    return argparse.ArgumentParser(
        prog="python -m mimo_fn.bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Kernel and step benchmarks of mimo_fn. Each prints a table last; --json FILE appends "
                    "its results as JSON rows. `python -m mimo_fn.bench <what> --help` for a benchmark's options.",
        epilog=f"benchmarks:\n{listing}",
        usage="python -m mimo_fn.bench <what> [options]   (or torchrun ... -m mimo_fn.bench <what> ...)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        top.error(f"unknown benchmark {name!r}; choose from {', '.join(BENCHES)}")
    mod = module(name)
    args = bench_parser(name, mod).parse_args(rest)
    if mod.NEEDS_CUDA:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"python -m mimo_fn.bench {name}: needs a CUDA GPU (none is visible to torch)")
    if name in ("table", "plot"):
        mod.main(args)
        return
    from mimo_fn.bench import results

    mod.main(args, results.start(name, args, rest))
