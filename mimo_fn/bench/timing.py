"""The one timing helper of the benchmarks: how long a call takes, on a GPU or the CPU.

  time_ms(fn)       milliseconds per call of a kernel-sized fn: on CUDA, triton's do_bench
                    (CUDA events around each call, the L2 flushed before each, warm-up and
                    repetitions sized in milliseconds of running) or, with iters=, a fixed
                    number of event-timed calls (optionally each after a barrier, for
                    collectives); with cuda_graph=True one graph of back-to-back calls replayed
                    (do_bench_cudagraph: no host launch time). On the CPU the same shape of
                    measurement with the host clock. The median unless stat says otherwise.
  wall_s(fn)        one call of a whole step (a prefill, a generate call) by the host clock,
                    the device synchronised before and after (and the ranks, with barrier=True)
  settle(fn, s)     run fn back to back for s seconds first (a GPU at its power cap changes
                    clock with the workload; see the function)
  gemm_peaks()      the dense GEMM peaks (bf16, FP8 rowwise) measured now, for MFU
"""

import statistics
import time
from typing import Any, Callable

import torch

STATS = ("median", "mean", "min", "max")


def on_cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _summary(samples: list[float], stat: str) -> float:
    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    return {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}[stat](samples)


def time_ms(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100, iters: int | None = None,
            warmup_iters: int = 3, stat: str = "median", barrier: bool = False, cuda_graph: bool = False,
            device: str | None = None) -> float:
    """Milliseconds per call of `fn`.

    Args:
      warmup_ms, rep_ms: how long to run fn before timing and while timing (do_bench's
        warmup / rep); the call counts follow from a first estimate of one call.
      iters: time exactly this many calls instead, after `warmup_iters` untimed ones.
      stat: "median" (default), "mean", "min" or "max" of the per-call times.
      barrier: iters mode only: a torch.distributed barrier (and a sync) before each timed
        call, so that every rank starts a collective together.
      cuda_graph: CUDA only: the calls captured in one graph and replayed.
      device: "cuda" or "cpu"; default CUDA where it is available.
    """
    cuda = on_cuda() if device is None else device.startswith("cuda")
    if cuda and cuda_graph:
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode=stat)
    if cuda and iters is None and not barrier:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode=stat)
    if cuda_graph:
        raise ValueError("cuda_graph=True needs a CUDA device")
    if iters is None:  # the CPU: size the runs from one call, as do_bench does on the GPU
        t0 = time.perf_counter()
        fn()
        estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-6)
        warmup_iters = max(1, int(warmup_ms / estimate_ms))
        iters = max(1, int(rep_ms / estimate_ms))
    for _ in range(warmup_iters):
        fn()
    samples = []
    for _ in range(iters):
        if barrier:
            _barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return _summary(samples, stat)


def wall_s(fn: Callable[[], Any], *, barrier: bool = False) -> tuple[float, Any]:
    """(seconds, fn's result) of one call by the host clock: the device synchronised before and
    after, and with barrier=True every rank too (the time the whole mesh took)."""
    sync()
    if barrier:
        _barrier()
    t0 = time.perf_counter()
    out = fn()
    sync()
    if barrier:
        _barrier()
    return time.perf_counter() - t0, out


def settle(fn: Callable[[], Any], seconds: float) -> None:
    """Run fn back to back for `seconds` before it is timed, so each method is timed in its own
    steady state. An H200 runs MoE layers at its ~690 W power cap, its SM clock moving between
    ~800 and 1980 MHz, and the clock dips after the workload changes: without settling, a layer
    timed straight after another one measured up to 30% slower than a moment later
    (docs/history/benchmarks-notebook.md, MoE kernels)."""
    sync()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()
        sync()


def gemm_peaks(device: str = "cuda", n: int = 8192) -> dict:
    """TFLOP/s of an n x n x n GEMM on random data now: bf16 and FP8 rowwise (torch._scaled_mm);
    "fp8_error" instead of the FP8 figure where this torch or GPU refuses it."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b.T, warmup_ms=50, rep_ms=300)
    out = {"bf16_tflops": 2 * n**3 / ms / 1e9}
    try:
        fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(n, 1, device=device)
        sb = torch.ones(1, n, device=device)
        ms = time_ms(lambda: torch._scaled_mm(fa, fb.T, sa, sb, out_dtype=torch.bfloat16), warmup_ms=50, rep_ms=300)
        out["fp8_rowwise_tflops"] = 2 * n**3 / ms / 1e9
    except Exception as e:  # noqa: BLE001 - report and go on
        out["fp8_error"] = repr(e)[:200]
    return out
