"""Energy per MoE layer under sustained load, on one GPU at prefill shapes (MiMo-V2-Flash:
top-8 of 256 experts, hidden 4096, expert intermediate 2048; balanced or skewed routing).

Under sustained load an H200 runs these layers at its power cap (~700 W): the SM clock falls
with the power drawn, so how fast a method runs there follows the energy it needs per FLOP,
and short timing windows land on whatever clock the method before left behind. Here each
method runs back to back for 1 s, then for --seconds while NVML's energy counter is read
before and after and the SM clock between calls; --rounds repeats every method, interleaved.
Methods: torch grouped_mm's two bare GEMMs (the moe benchmark's baseline), our bf16 and FP8 layers
(the defaults: from 1,024 pairs per expert the FP8 up GEMM is up_ws's), the FP8 layer with its up
GEMM in Triton at every size ("up in Triton": does the faster up GEMM pay at the cap?), and with
--half-tails-ab the bf16 and FP8 layers with HALF_TAILS forced on ("halves") and off ("whole").

    python -m mimo_fn.bench moe-energy [--tokens 4096 16384 65536] [--routings balanced skewed]
                                       [--seconds 3] [--rounds 1] [--half-tails-ab]
                                       [--methods "triton fp8" ...]

Prints a row per measurement (ms, TFLOP/s, W, J per layer, TFLOP per J, SM MHz), and the table last.
"""

import statistics
import time

import torch

from mimo_fn.bench.moe_layer import H, I, K, Weights, grouped_mm_gemms, grouped_mm_inputs, half_tails, make_weights, routing
from mimo_fn.bench.results import print_table, record
from mimo_fn.bench.timing import settle
from mimo_fn.kernels.moe.gemm import fused_moe, fused_moe_fp8

NEEDS_CUDA = True


def add_args(ap) -> None:
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536], help="token counts T")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long each method is measured")
    ap.add_argument("--rounds", type=int, default=1, help="measure every method this many times, interleaved")
    ap.add_argument("--half-tails-ab", action="store_true", help="also both layers with HALF_TAILS forced on and off")
    ap.add_argument("--routings", nargs="+", default=["balanced"], choices=["balanced", "skewed"], help="routings")
    ap.add_argument("--methods", nargs="+", default=[], help="only methods whose name contains one of these")


def main(args, run) -> None:
    if not hasattr(torch, "_grouped_mm"):
        raise SystemExit("moe-energy: this torch has no torch._grouped_mm (the baseline)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{run.device}  torch {torch.__version__}  {run.date}")
    w = make_weights(max(args.tokens), gen)
    rows = energy(w, args.tokens, gen, run, args.seconds, args.rounds, args.half_tails_ab, args.routings, args.methods)
    print_table(rows, [("tokens", "tokens", "d"), ("routing", "routing", ""), ("method", "method", ""),
                       ("ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".1f"), ("W", "watts", ".1f"),
                       ("J/layer", "joules_per_layer", ".3f"), ("TFLOP/J", "tflop_per_joule", ".3f"),
                       ("SM MHz", "sm_mhz_median", ".0f")])


class _Power:
    """The GPU's energy counter and SM clock through NVML (pynvml, which torch.cuda's
    power_draw uses too), or nothing where it is missing."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001 - any failure: report without power figures
            print(f"energy: NVML unavailable ({type(e).__name__}: {e})")
            self.nvml = None

    def energy_j(self) -> float | None:
        return None if self.nvml is None else self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3

    def clock_mhz(self) -> int | None:
        return None if self.nvml is None else self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)


def energy(w: Weights, tokens, gen, run, seconds, rounds: int = 1, half_tails_ab: bool = False,
           routings=("balanced",), only=()) -> list[dict]:
    """Energy per layer under sustained load: each method runs back to back for 1 s, then for
    `seconds` while NVML's energy counter and the SM clock are read (`rounds` times, the
    methods interleaved). At the H200's power cap the clock falls with the power drawn, so a
    method's speed there follows its energy per FLOP. `only`: method names containing one of
    these strings (default all). Returns the rows."""
    x_TH, w13_E2IH, w2_EHI, w13_q, w2_q = w.x_TH, w.w13_E2IH, w.w2_EHI, w.w13_q, w.w2_q
    w13t_EH2I, w2t_EIH = w.w13t_EH2I, w.w2t_EIH
    power, rows = _Power(), []
    for t, kind in [(t, kind) for t in tokens for kind in routings]:
        ids_TK, weights_TK = routing(kind, t, gen)
        x = x_TH[:t]
        flops = 2 * t * K * 3 * H * I
        xs_PH, a_PI, offs_E = grouped_mm_inputs(w, x, ids_TK, weights_TK)
        methods = {
            "grouped_mm gemms": lambda: grouped_mm_gemms(xs_PH, a_PI, offs_E, w13t_EH2I, w2t_EIH),
            "triton bf16": lambda: fused_moe(x, w13_E2IH, w2_EHI, ids_TK, weights_TK),
            "triton fp8": lambda: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK, weights_TK),
            "triton fp8 up in Triton": lambda: fused_moe_fp8(x, w13_q.data, w13_q.scale, w2_q.data, w2_q.scale, ids_TK,
                                                             weights_TK, up_ws=False),
        }
        if half_tails_ab:
            for name in ("triton bf16", "triton fp8"):
                methods[f"{name} halves"] = half_tails(methods[name], True)
                methods[f"{name} whole"] = half_tails(methods[name], False)
        methods = {name: fn for name, fn in methods.items() if not only or any(o in name for o in only)}
        for fn in methods.values():
            fn()  # compile and tune outside the measurement
        for name, fn in [item for _ in range(rounds) for item in methods.items()]:
            settle(fn, 1.0)
            clocks, calls = [], 0
            e0, t0 = power.energy_j(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(4):
                    fn()
                calls += 4
                torch.cuda.synchronize()
                clocks.append(power.clock_mhz())
            wall = time.perf_counter() - t0
            e1 = power.energy_j()
            ms = wall / calls * 1e3
            row = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            if e0 is not None:
                joules = (e1 - e0) / calls
                row.update(watts=round((e1 - e0) / wall, 1), joules_per_layer=round(joules, 4),
                           tflop_per_joule=round(flops / joules / 1e12, 3),
                           sm_mhz_median=statistics.median(clocks))
            record(run, row, tokens=t, routing=kind, method=name)
            rows.append({"tokens": t, "routing": kind, "method": name, **row})
            print(f"T={t:6d} {kind:8s} {name:20s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s  " + (
                f"{row['watts']:6.1f} W  {row['joules_per_layer']:.3f} J/layer  {row['tflop_per_joule']:.3f} TFLOP/J  "
                f"SM {row['sm_mhz_median']:.0f} MHz" if e0 is not None else ""), flush=True)
    return rows
