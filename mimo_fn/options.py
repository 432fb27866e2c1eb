"""The kernel switches: one frozen record, read from the environment once, at import.

Users and scripts set these as MIMO_FN_* environment variables before mimo_fn is imported;
nothing else in mimo_fn reads the environment for them. Code reads the record at call time
through `current()`, so a test (or a benchmark comparing two paths in one process) can swap it:
`with options.override(moe_half_tails=False): ...`, or pytest's
`monkeypatch.setattr(options, "OPTIONS", dataclasses.replace(options.OPTIONS, ...))`.

`typecheck` is the exception: `mimo_fn._types.typed` decorates functions when their module is
imported, so only the value at import time counts.
"""

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping


def _on_unless_0(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "1") != "0"


def _tristate(env: Mapping[str, str], name: str) -> bool | None:
    """'1' -> True, '0' -> False, anything else (unset) -> None: the code's own size rule."""
    return {"1": True, "0": False}.get(env.get(name))


@dataclasses.dataclass(frozen=True)
class Options:
    # MIMO_FN_TYPECHECK=1: shape-check every @typed function with jaxtyping + beartype. Off by
    # default so serving pays nothing per call; tests/conftest.py turns it on.
    typecheck: bool = False
    # MIMO_FN_ATTENTION_REF=1: the paged attention runs the plain-torch reference even on CUDA,
    # to bisect a numerics difference down to the kernels (it syncs with the host: no CUDA graphs).
    attention_ref: bool = False
    # MIMO_FN_ATTENTION_WS=0: full-attention prefill on Hopper runs the Triton loop kernel instead
    # of the warp-specialised Gluon one (a Triton release whose Gluon API the kernel does not know).
    attention_ws: bool = True
    # MIMO_FN_ATTENTION_BAND=0: sliding-window prefill runs the block-loop Triton kernel instead of
    # the one-pass band kernel, to compare the two.
    attention_band: bool = True
    # MIMO_FN_ATTENTION_FP8=1: full-attention prefill on CUDA runs with Q, K and V in FP8
    # (kernels.attention.fp8: per-row Q and per-page K/V scales, fp32 softmax) where that kernel
    # supports the call; never in deterministic mode. Off by default: FP8 costs accuracy.
    attention_fp8: bool = False
    # MIMO_FN_MOE_AUTOTUNE=0: the MoE GEMMs launch each list's first (default) config instead of
    # autotuning on CUDA: no tuning runs at start-up, and numerics tests compile one config a kernel.
    moe_autotune: bool = True
    # MIMO_FN_AUTOTUNE_CACHE=0: the MoE autotuners tune anew in every process instead of keeping
    # their picks per GPU model in Triton's cache dir (kernels.autotune_cache): on an H100 a fresh
    # engine's warm-up took 10.0 s without the kept picks and 1.4 s with them (docs/benchmarks.md).
    autotune_cache: bool = True
    # MIMO_FN_MOE_TMA=0: the MoE GEMMs load weights (and h) through pointers, not TMA descriptors.
    moe_tma: bool = True
    # MIMO_FN_MOE_HALF_TAILS: an expert's last block whose second half is padding computes its
    # first half only. None (unset): where that pays, by pairs per expert; True (=1) at any size;
    # False (=0) never. Benchmarks compare the two.
    moe_half_tails: bool | None = None
    # MIMO_FN_MOE_DOWN_WS=0: the FP8 MoE down GEMM runs the Triton kernel instead of the
    # warp-specialised Gluon one (kernels.moe.down_ws), which takes it where it can (Hopper, 128-row
    # blocks, H a multiple of 256 and I of 128; never in deterministic mode; docs/benchmarks.md has
    # the two side by side). fused_moe_fp8(down_ws=...) overrides it per call.
    moe_down_ws: bool = True
    # MIMO_FN_MOE_UP_WS=0: the FP8 MoE up GEMM runs the Triton kernel instead of the warp-specialised
    # Gluon one (kernels.moe.up_ws, the layer's x quantised straight into slot order), which takes it
    # where it can (Hopper, 128-row blocks, H and I multiples of 128; never in deterministic mode)
    # from up_ws.MIN_PAIRS_PER_EXPERT pairs per expert on. fused_moe_fp8(up_ws=...) overrides it per
    # call, at any size.
    moe_up_ws: bool = True
    # MIMO_FN_MOE_UP_CUBLAS=1: the FP8 MoE up GEMM as one cuBLASLt block-scaled GEMM per expert
    # (kernels.moe.up_cublas; one host sync a layer, no CUDA graphs), where it serves; no faster
    # today (up_cublas.takes has the numbers).
    moe_up_cublas: bool = False
    # MIMO_FN_MXFP4_FAST_CVT=0: the MXFP4 kernels dequantise with portable integer ops instead of
    # inline PTX (bf16 on CUDA); the two give the same values.
    mxfp4_fast_cvt: bool = True
    # MIMO_FN_MXFP4_DEQUANT: MXFP4 experts run the bf16 GEMMs on a dequantised copy of the weights
    # instead of dequantising inside the GEMMs. None (unset): on CUDA from enough pairs per expert
    # (kernels.moe.mxfp4.dequantize_first); True (=1) always; False (=0) never.
    mxfp4_dequant: bool | None = None
    # MIMO_FN_LAYER_RANGES=1: each decoder layer of a paged step runs inside a torch.profiler range
    # "layer{i}", so a profile splits by layer (python -m mimo_fn.bench prefill --profile-layers).
    # Off by default: no range is opened, nothing is paid (and other profiles' sums see no ranges).
    layer_ranges: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        env = os.environ if env is None else env
        return cls(
            typecheck=env.get("MIMO_FN_TYPECHECK") == "1",
            attention_ref=env.get("MIMO_FN_ATTENTION_REF") == "1",
            attention_ws=_on_unless_0(env, "MIMO_FN_ATTENTION_WS"),
            attention_band=_on_unless_0(env, "MIMO_FN_ATTENTION_BAND"),
            attention_fp8=env.get("MIMO_FN_ATTENTION_FP8") == "1",
            moe_autotune=_on_unless_0(env, "MIMO_FN_MOE_AUTOTUNE"),
            autotune_cache=_on_unless_0(env, "MIMO_FN_AUTOTUNE_CACHE"),
            moe_tma=_on_unless_0(env, "MIMO_FN_MOE_TMA"),
            moe_half_tails=_tristate(env, "MIMO_FN_MOE_HALF_TAILS"),
            moe_down_ws=_on_unless_0(env, "MIMO_FN_MOE_DOWN_WS"),
            moe_up_ws=_on_unless_0(env, "MIMO_FN_MOE_UP_WS"),
            moe_up_cublas=env.get("MIMO_FN_MOE_UP_CUBLAS") == "1",
            mxfp4_fast_cvt=_on_unless_0(env, "MIMO_FN_MXFP4_FAST_CVT"),
            mxfp4_dequant=_tristate(env, "MIMO_FN_MXFP4_DEQUANT"),
            layer_ranges=env.get("MIMO_FN_LAYER_RANGES") == "1",
        )


OPTIONS = Options.from_env()  # the process's switches; read through current(), swapped by override()


def current() -> Options:
    return OPTIONS


@contextlib.contextmanager
def override(**changes) -> Iterator[Options]:
    """The switches with `changes` applied inside the block (field names as in Options), then
    back to what they were. Not thread-local: meant for tests and single-threaded benchmarks."""
    global OPTIONS
    before = OPTIONS
    OPTIONS = dataclasses.replace(before, **changes)
    try:
        yield OPTIONS
    finally:
        OPTIONS = before
