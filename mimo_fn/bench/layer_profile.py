"""Per-kernel device time of a call, in all or by torch.profiler range: what `python -m mimo_fn.bench
prefill --profile-layers` prints for one layer of each MoE type.

  kernel_ms(fn)                    [(kernel, calls, ms)] per call of fn, most time first
  ranged_kernel_ms(fn, groups)     the same by record_function ranges, averaged over each
                                   group's ranges: {group: RangeProfile}
  format_table(rows, title)        the plain-text table (kernel, calls, ms, share, a total row)

On CUDA a "kernel" is a device activity (kernel, memcpy, memset) and its time the device's; on
the CPU (where the code path is tested) it is a torch op and its time the op's self CPU time, so
nested ops are not counted twice.

A kernel belongs to the range its launch happened in: its host-side launch call (cudaLaunchKernel,
or cuLaunchKernel for Triton's kernels; the same CUPTI correlation id as the kernel) starts
inside the range on the host. The profiler's own kernel-to-op link is no use here: a
record_function range is a user scope, so kernels launched straight from Python (every Triton
kernel, outside any aten op) are linked to no CPU event at all. Device time is exact; the wall
time of a profiled call is not (the profiler adds host time, hence the span of each range is
reported beside the kernel sum).
"""

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mimo_fn.bench.timing import sync

NAME_CHARS = 60  # kernel names are shortened to this in tables (CUTLASS / nvjet names run to hundreds)
# host calls that put work on the device (the runtime's and the driver's: Triton launches by the driver)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
            "cudaMemsetAsync", "cudaLaunchCooperativeKernel")

Row = tuple[str, int, float]  # (kernel name, calls, ms), both per call of fn (per range with ranges)


@dataclass(frozen=True)
class Work:
    """One kernel (or, on the CPU, one op) of a profile."""
    name: str
    ms: float  # device time (CPU: the op's self time)
    start_us: float  # on the device (CPU: the op's start); for spans
    end_us: float
    issued_us: float  # host time of the launch (CPU: the op's start); for ranges


@dataclass(frozen=True)
class RangeProfile:
    """A group of ranges (e.g. the four SWA MoE layers), per range and per call of fn."""
    rows: list[Row]  # most time first
    busy_ms: float  # the rows' sum
    span_ms: float  # first start to last end of each range's kernels: busy time and the gaps between
    num_ranges: int  # ranges of the group that ran (each once per call)


def _profile(fn: Callable[[], Any], warmup: int, iters: int) -> tuple[list, bool]:
    """(the profile's events, on CUDA) over `iters` calls of fn after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup = {warmup}, iters = {iters}: expected warmup >= 0 and iters >= 1")
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    sync()
    # the CPU activity on CUDA too: the launch calls and the ranges are host events
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        sync()
    return list(prof.events()), cuda


def _on_host(ev) -> bool:
    return ev.device_type == torch.autograd.DeviceType.CPU


def _is_range(ev) -> bool:
    # by the event's fields, not its activity_type, which FunctionEvent carries only from torch 2.12 on
    return bool(getattr(ev, "is_user_annotation", False))


def _work(events: list, cuda: bool) -> list[Work]:
    """The profile's kernels (CUDA) or ops (CPU), each with where it was issued. A kernel and its
    launch call share the CUPTI correlation id, FunctionEvent.id for both."""
    if not cuda:
        return [Work(ev.name, ev.self_cpu_time_total / 1e3, ev.time_range.start, ev.time_range.end,
                     ev.time_range.start) for ev in events
                if _on_host(ev) and not _is_range(ev) and ev.name not in LAUNCHES]
    launched = {ev.id: ev.time_range.start for ev in events if _on_host(ev) and ev.name in LAUNCHES}
    # a kernel without its launch call (none seen: one issued before the profile began) counts
    # in kernel_ms but in no range
    return [Work(ev.name, ev.time_range.elapsed_us() / 1e3, ev.time_range.start, ev.time_range.end,
                 launched.get(ev.id, float("nan"))) for ev in events
            if ev.device_type == torch.autograd.DeviceType.CUDA and not _is_range(ev)]


def _rows(work: Sequence[Work], per: int) -> list[Row]:
    ms, calls = defaultdict(float), defaultdict(int)
    for w in work:
        ms[w.name] += w.ms
        calls[w.name] += 1
    return sorted(((name, round(calls[name] / per), t / per) for name, t in ms.items()), key=lambda r: -r[2])


def kernel_ms(fn: Callable[[], Any], *, warmup: int = 1, iters: int = 3) -> list[Row]:
    """[(kernel name, calls, ms)] per call of fn, summed over each name's launches (device time on
    CUDA, ops' self CPU time on the CPU), most time first."""
    events, cuda = _profile(fn, warmup, iters)
    return _rows(_work(events, cuda), iters)


def ranged_kernel_ms(fn: Callable[[], Any], groups: Mapping[str, Sequence[str]], *, warmup: int = 1,
                     iters: int = 3) -> dict[str, RangeProfile]:
    """Kernels by torch.profiler.record_function range: groups maps a group name to its range names
    (e.g. "SWA MoE layer" -> ["layer1", ..., "layer4"]); each group's profile is per range and per
    call of fn. A range that opens several times a call (one per prefill chunk) counts all of them.
    ValueError naming a range fn never opened."""
    events, cuda = _profile(fn, warmup, iters)
    every = _work(events, cuda)
    work = sorted((w for w in every if not math.isnan(w.issued_us)), key=lambda w: w.issued_us)
    if every and not work:  # no range could hold a kernel: say so rather than print empty tables
        raise RuntimeError(f"none of the profile's {len(every)} kernels has a launch call ({' / '.join(LAUNCHES)} "
                           "event of its correlation id): this torch's profiler links them otherwise")
    issued = [w.issued_us for w in work]
    opened = defaultdict(list)  # range name -> [(start, end)] on the host
    for ev in events:
        if _on_host(ev) and _is_range(ev):
            opened[ev.name].append((ev.time_range.start, ev.time_range.end))
    out = {}
    for group, names in groups.items():
        missing = [n for n in names if n not in opened]
        if missing:
            raise ValueError(f"range {missing[0]!r} of group {group!r} never opened in the profiled call "
                             f"(opened: {sorted(opened) or 'none'})")
        inside, span_us = [], 0.0
        for name in names:
            for start, end in opened[name]:
                mine = work[bisect_left(issued, start):bisect_right(issued, end)]
                inside += mine
                if mine:
                    span_us += max(w.end_us for w in mine) - min(w.start_us for w in mine)
        per = iters * len(names)
        rows = _rows(inside, per)
        out[group] = RangeProfile(rows, sum(r[2] for r in rows), span_us / 1e3 / per, len(names))
    return out


def format_table(rows: Sequence[Row], title: str, max_rows: int = 30) -> str:
    """rows as a plain-text table: kernel (first NAME_CHARS characters), calls, ms, share of the
    rows' total, and a total row; past the first max_rows rows, one row for the rest."""
    total = sum(r[2] for r in rows)
    if len(rows) > max_rows:
        rest = rows[max_rows - 1:]
        rows = [*rows[:max_rows - 1], (f"({len(rest)} others)", sum(r[1] for r in rest), sum(r[2] for r in rest))]
    body = [(name[:NAME_CHARS], str(calls), f"{ms:.3f}", f"{ms / total:.1%}" if total else "-")
            for name, calls, ms in rows]
    body.append(("total", str(sum(r[1] for r in rows)), f"{total:.3f}", "100.0%" if total else "-"))
    head = ("kernel", "calls", "ms", "share")
    widths = [max(len(c[i]) for c in [head, *body]) for i in range(4)]

    def line(cells):
        return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

    return "\n".join([title, line(head), *(line(c) for c in body[:-1]), "-" * len(line(head)), line(body[-1])])
