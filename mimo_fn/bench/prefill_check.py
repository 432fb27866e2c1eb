"""The prefill bench's per-layer-type model of a deeper model, and its check against real layers.

`python -m mimo_fn.bench prefill` times sub-models of the 6-layer slice at one ISL
(prefill.extrapolate) and splits the time by layer type:
    t_dense     layer 0 (full attention, dense MLP) with the embedding, the final norm and the LM head
    t_full_moe  one full-attention MoE layer
    t_swa_moe   one sliding-window MoE layer
A model of the released pattern with N layers is then predicted to take
    T(N) = t_dense + n_full_moe(N) * t_full_moe + n_swa_moe(N) * t_swa_moe
with the counts read from ModelConfig.flash(num_layers=N) (N = 48: 8 full and 39 SWA MoE layers).
`--check-layers N` tests that model on more layers than the slice has: once the slice is freed, it
draws N real layers in the case's format (quantised as drawn, no bf16 copy beside them), times
the same prefill, and reports measured against predicted, after checking the memory plan
(mimo_fn.memory_plan) says N layers fit this GPU.
"""

import torch

import mimo_fn as mf
from mimo_fn.bench.results import record
from mimo_fn.bench.workload import pool_tokens, slice_params, timed_prefill
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.memory_plan import GiB, MemoryPlan, plan_memory
from mimo_fn.parallel.mesh import Mesh

MEMORY_FORMAT = {"bf16": "none", "fp8": "fp8", "mxfp4": "mxfp4"}  # the bench's --dtypes as memory_plan names them


def layer_counts(cfg: mf.ModelConfig) -> tuple[int, int]:
    """(full-attention MoE layers, sliding-window MoE layers) of cfg. ValueError where cfg is not
    of the three timed types: layer 0 dense with full attention, every other layer MoE."""
    if cfg.is_swa(0) or cfg.is_moe(0) or any(not cfg.is_moe(i) for i in range(1, cfg.num_layers)):
        raise ValueError(f"layer types {cfg.layer_types} / {cfg.mlp_types}: expected layer 0 dense with full "
                         "attention and MoE layers after it (the released pattern)")
    swa = sum(1 for i in range(1, cfg.num_layers) if cfg.is_swa(i))
    return cfg.num_layers - 1 - swa, swa


def predict_s(times: dict, cfg: mf.ModelConfig) -> float:
    """T(N) of the module docstring from the per-layer-type seconds in `times`."""
    n_full, n_swa = layer_counts(cfg)
    return times["t_dense_s"] + n_full * times["t_full_moe_s"] + n_swa * times["t_swa_moe_s"]


def formula(times: dict, cfg: mf.ModelConfig) -> str:
    n_full, n_swa = layer_counts(cfg)
    return (f"T{cfg.num_layers} = {times['t_dense_s']:.3f} + {n_full}*{times['t_full_moe_s']:.4f} + "
            f"{n_swa}*{times['t_swa_moe_s']:.4f} = {predict_s(times, cfg):.3f} s")


def plan(num_layers: int, dtype: str, isl: int, chunk: int, free: int | None) -> MemoryPlan:
    """The memory plan of one prefill of `isl` tokens through `num_layers` layers of the released
    pattern in the bench's `dtype` (the KV pool as timed_prefill sizes it; its sliding-window
    pool counted at full size, an upper bound)."""
    return plan_memory(mf.ModelConfig.flash(num_layers=num_layers), Mesh.single(), torch.bfloat16,
                       MEMORY_FORMAT[dtype], pool_tokens([isl], DEFAULT_PAGE_SIZE), DEFAULT_PAGE_SIZE,
                       min(chunk, isl), free)


def most_layers(dtype: str, isl: int, chunk: int, free: int) -> int:
    """The most layers of the released pattern (at most 48) whose plan fits `free` bytes; 0 if none."""
    return max((n for n in range(1, 49) if plan(n, dtype, isl, chunk, free).fits), default=0)


def check(args, run, dtype: str, times: dict, device) -> None:
    """--check-layers: N real layers timed against T(N) at --extrapolate-isl and --chunk; one row."""
    n, isl = args.check_layers, args.extrapolate_isl
    cfg = mf.ModelConfig.flash(num_layers=n)
    free = torch.cuda.mem_get_info(device)[0]
    p = plan(n, dtype, isl, args.chunk, free)
    most = most_layers(dtype, isl, args.chunk, free)
    print(f"[{dtype}] {n} layers: {p.summary()}; the most that fit: {most}", flush=True)
    if not p.fits:
        record(run, {"skipped": f"does not fit: {p.summary()}", "most_layers": most}, section="check", dtype=dtype,
               isl=isl, layers=n)
        print(f"[{dtype}] {n}-layer check skipped: the plan does not fit", flush=True)
        return
    predicted = predict_s(times, cfg)
    params = slice_params(cfg, dtype, device)
    timed_prefill(cfg, params, [isl], args.chunk, mesh=args.mesh)  # warm-up at the timed shapes
    measured = timed_prefill(cfg, params, [isl], args.chunk, mesh=args.mesh)[0]  # one run, as extrapolate times
    del params
    torch.cuda.empty_cache()
    res = {"measured_s": measured, "predicted_s": predicted, "measured_tok_s": isl / measured,
           "predicted_tok_s": isl / predicted, "rel_err": (predicted - measured) / measured,
           "formula": formula(times, cfg), "plan_gib": p.total / GiB, "most_layers": most}
    record(run, res, section="check", dtype=dtype, isl=isl, layers=n)
    print(f"[{dtype}] {n} real layers at ISL {isl}: {res['measured_tok_s']:,.0f} tok/s measured, "
          f"{res['predicted_tok_s']:,.0f} predicted ({res['formula']}), time error {res['rel_err']:+.1%}", flush=True)
