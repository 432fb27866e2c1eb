"""Grouped expert GEMMs for the MoE layer.

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token,
P = T*K (token, k) pairs, M padded slots of the aligned layout (see align.py), Hb / Ib /
I2b = ceil(H / 128) / ceil(I / 128) / ceil(2I / 128) FP8 blocks, G 1x128 activation groups.

Expert weights are stacked: w13_E2IH holds each expert's gate rows [0:I] then up rows
[I:2I] (transformers' fused `gate_up_proj`); w2_EHI is the down projection. An expert id
of -1 in topk_ids_TK is padding: it contributes nothing.

FP8 (mimo_fn.quant.FP8_BLOCK): weights are float8_e4m3fn with one fp32 scale per 128x128
block, W = q * scale; activations are quantised per token in 1x128 groups,
scale = max(amax, 1e-10) / 448, q = clamp(x / scale, +-448). Both GEMM inputs are FP8: x,
and the SiLU(gate)*up activation h, which the up GEMM quantises in its epilogue (x goes
through `fp8_quant.quant_fp8_act`, the FP8 linears' quantiser, or straight into slot order: slots.py).

The Triton kernels live in gemm_kernels.py; this module holds their launch configs, the
autotuner, the launchers (one per stage: `_moe_up`, `_moe_down`, `_moe_sum_topk`, which the
MXFP4 copy path of dispatch.py also runs) and the entry points `fused_moe` / `fused_moe_fp8`.
FP8's GEMMs run down_ws.py's and up_ws.py's warp-specialised Gluon kernels where they serve (Hopper,
128-row blocks; `fused_moe_fp8`'s down_ws / up_ws, MIMO_FN_MOE_DOWN_WS=0 / MIMO_FN_MOE_UP_WS=0 turn
them off; the up one from up_ws.MIN_PAIRS_PER_EXPERT pairs per expert on).
Deterministic mode (`deterministic=True`): no autotuning and no half tails, whatever the token
count; one K order per tile, so a (token, expert) pair's row has the same bits whichever slot of
whichever block it lands in, and `_moe_sum_topk` adds a token's K rows in the router's (sorted)
order. Only the block's rows follow the pairs, as the deterministic linears' tiles do: `det_block_m`
gives 64 rows (16 in the interpreter) below LARGE_BLOCK_PER_EXPERT pairs an expert on average and
128 (32) from there, at twice the warps (_DET_CONFIGS), so each warpgroup runs the same wgmma over
the same 64 rows in the same K order (tests/test_deterministic.py checks the bits on the GPU).

The plain-torch twins `fused_moe_ref` / `fused_moe_fp8_ref` live in ref.py; which of them runs
a layer is dispatch.py's choice.
"""

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from mimo_fn import options
from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.kernels.autotune_cache import Persisted
from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe import down_ws, up_cublas
from mimo_fn.kernels.moe import up_ws as up_ws_mod
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.gemm_kernels import _moe_down_kernel, _moe_sum_topk_kernel, _moe_up_kernel
from mimo_fn.kernels.moe.ref import add_residual, check_fp8_weights, check_residual, moe_shapes
from mimo_fn.quant import FP8_DTYPE


_HEURISTICS = {
    "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
    # FP8: every N tile inside one 128-row weight-scale block (N aligned, BLOCK_N | 128)
    "SCALAR_WS": lambda args: args["N"] % 128 == 0 and 128 % args["BLOCK_N"] == 0,
}
_up = triton.heuristics(_HEURISTICS)(_moe_up_kernel)
_down = triton.heuristics(_HEURISTICS)(_moe_down_kernel)


def _desc_boxes(nargs: dict) -> None:
    """A TMA descriptor's box is the config's tile: set it per config (the autotuner's pre_hook)."""
    if nargs.get("w_desc") is not None:
        nargs["w_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs.get("w3_desc") is not None:
        nargs["w3_desc"].block_shape = [2, nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if nargs.get("h_desc") is not None:
        nargs["h_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]


def _cfg(bn: int, bk: int, warps: int, stages: int, group_m: int = 8, **extra) -> triton.Config:
    meta = {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, **extra}
    return triton.Config(meta, num_warps=warps, num_stages=stages, pre_hook=_desc_boxes)


# Per operand kind: (up configs, down configs); the first of each is the untuned default
# (also what the interpreter runs). Register and shared-memory budgets below are from
# compiling for sm_90 (triton 3.9); speeds from one H200 at the model's dims (python -m mimo_fn.bench moe).
# bf16: 128 x (2 x 128) up tiles take 144 KB of shared memory at 3 stages, 192 KB at 4.
# FUSED_GU loads the gate and the up rows as one [2 x 128, 64] TMA box, so each K step is one
# N = 256 MMA per warpgroup that reads the A tile once instead of twice (the split into gate
# and up afterwards only relabels registers). TMA weights took the up GEMM from 526 to 557
# TFLOP/s and the down GEMM from 530 to 588 (64K tokens, each kernel alone).
# fp8: the up GEMM is pinned to BLOCK_N = 128 (its epilogue quantises whole 1x128 groups of h)
# and BLOCK_K = 128 (one weight-scale block a step). Each K step's partial product is scaled
# before it is accumulated, so a warpgroup holds the partial beside its accumulators: at
# BLOCK_M 128, 4 warps spill ~1 KB a thread (110 TFLOP/s), 8 warps a little (659 with TMA),
# 16 warps (64 x 64 per warpgroup and operand) none (743); at BLOCK_M 64 the tuner picks 8.
# The GROUP_M 1 / 2 / 4 variants (fewer M blocks sweep N together) are the tuner's pick for
# most size buckets, worth a few % at most.
# PERSISTENT (one program per SM walking the tiles in a flattened loop, so the next tile's
# loads overlap this tile's epilogue) sped up the bf16 GEMMs and slowed the FP8 ones (the up
# GEMM most), so only the bf16 lists hold it. With HALF_TAILS a tile has two shapes and the
# loop does not flatten (compiled for sm_90: the bf16 up kernel takes 255 registers instead
# of 171 and no longer prefetches across tiles), so _prune drops it there.
# fp32 is a numerics path (IEEE products), kept small enough to fit shared memory; its unfused
# up config serves weights that TMA cannot address (_prune would leave nothing else).
_CONFIGS = {
    "bf16": (
        [_cfg(128, 64, 8, 3, FUSED_GU=True), _cfg(128, 64, 8, 4, FUSED_GU=True), _cfg(128, 64, 8, 3),
         _cfg(128, 64, 8, 4), _cfg(64, 64, 4, 4),
         _cfg(128, 64, 8, 4, group_m=1, FUSED_GU=True), _cfg(128, 64, 8, 4, group_m=4, FUSED_GU=True),
         _cfg(128, 64, 8, 3, group_m=16, FUSED_GU=True),
         _cfg(128, 64, 8, 3, FUSED_GU=True, PERSISTENT=True),
         _cfg(128, 64, 8, 3, group_m=16, FUSED_GU=True, PERSISTENT=True)],
        [_cfg(256, 64, 8, 3), _cfg(256, 64, 8, 4), _cfg(128, 64, 8, 4), _cfg(128, 64, 4, 4),
         _cfg(256, 64, 8, 4, group_m=1), _cfg(256, 64, 8, 4, group_m=4),
         _cfg(256, 64, 8, 3, PERSISTENT=True), _cfg(256, 64, 8, 4, group_m=1, PERSISTENT=True)],
    ),
    "fp8": (
        [_cfg(128, 128, 16, 3), _cfg(128, 128, 16, 4), _cfg(128, 128, 8, 3), _cfg(128, 128, 8, 4),
         _cfg(128, 128, 16, 3, group_m=1), _cfg(128, 128, 16, 3, group_m=4)],
        [_cfg(128, 128, 8, 3), _cfg(128, 128, 8, 4), _cfg(128, 128, 16, 3), _cfg(128, 128, 4, 3),
         _cfg(128, 128, 8, 4, group_m=1), _cfg(128, 128, 8, 4, group_m=2)],
    ),
    "fp32": ([_cfg(64, 32, 4, 2, FUSED_GU=True), _cfg(64, 32, 4, 2)], [_cfg(64, 32, 4, 2)]),
}
# Decode sizes: a few rows an expert, so each GEMM streams its experts' weights once. default_block_m
# gives FP8 blocks of 16 or 32 rows there, and these lists serve launches at BLOCK_M <= SMALL_M
# (mma.sync dots, not wgmma): 4 warps and 4 stages stream the weights nearest the copy bandwidth.
SMALL_M = 32
_SMALL_M_CONFIGS = {
    "fp8": ([_cfg(128, 128, 4, 4), _cfg(128, 128, 4, 3), _cfg(128, 128, 8, 4)],
            [_cfg(128, 128, 4, 4), _cfg(128, 128, 4, 3), _cfg(128, 128, 8, 4)]),
}
_TUNE_KEY = ["N", "K", "BLOCK_M", "size_bucket", "W_DESC", "HALF_TAILS"]
# Pairs an expert (on average) from which 128-row blocks beat 64-row ones (default_block_m);
# deterministic mode switches its block at the same count (det_block_m).
LARGE_BLOCK_PER_EXPERT = 64
# Deterministic mode: rows per block below / from LARGE_BLOCK_PER_EXPERT pairs an expert, on CUDA
# and in the interpreter (fast tests); per kind, the (up, down) configs of the small block, then of
# the large one: twice the warps at twice the rows, each warpgroup the same 64 x N (the module
# docstring). Compiled for sm_90 (triton 3.9, TMA weights, 3 stages) all fit shared memory; only the
# large FP8 up spills, a little (off mode's default config too). The large bf16 pair is off mode's.
DET_BLOCK_M = {"cuda": 64, "interpreter": 16}
DET_BLOCK_M_LARGE = {"cuda": 128, "interpreter": 32}
_DET_CONFIGS = {
    "bf16": ((_cfg(128, 64, 4, 3, FUSED_GU=True), _cfg(256, 64, 4, 3)),
             (_CONFIGS["bf16"][0][0], _CONFIGS["bf16"][1][0])),
    "fp8": ((_cfg(128, 128, 8, 3), _cfg(128, 128, 8, 3)), (_cfg(128, 128, 16, 3), _cfg(128, 128, 16, 3))),
    "fp32": ((_CONFIGS["fp32"][0][0], _CONFIGS["fp32"][1][0]),) * 2,
}


def _det_config(kind: str, stage: int, block_m: int) -> triton.Config:
    """Deterministic mode's launch config of a GEMM (stage 0 up, 1 down) at this block size."""
    return _DET_CONFIGS[kind][block_m in DET_BLOCK_M_LARGE.values()][stage]


def det_block_m(on_cuda: bool, pairs: int, num_experts: int) -> int:
    """Deterministic mode's rows per aligned block for `pairs` (token, expert) pairs over
    num_experts experts: by the average an expert gets (not each expert's count: one launch),
    DET_BLOCK_M_LARGE's from LARGE_BLOCK_PER_EXPERT pairs an expert, else DET_BLOCK_M's. Only the
    block follows the count, never a row's arithmetic (the module docstring)."""
    large = pairs >= LARGE_BLOCK_PER_EXPERT * num_experts
    return (DET_BLOCK_M_LARGE if large else DET_BLOCK_M)["cuda" if on_cuda else "interpreter"]


def _prune(configs, named_args, **kwargs):
    # FUSED_GU reads the weights through the 3D descriptor: pointer launches skip it;
    # PERSISTENT loops flatten only over one tile shape: HALF_TAILS launches skip it
    tma = kwargs.get("W_DESC", named_args.get("W_DESC"))
    half = kwargs.get("HALF_TAILS", named_args.get("HALF_TAILS"))
    return [c for c in configs
            if (tma or not c.kwargs.get("FUSED_GU")) and not (half and c.kwargs.get("PERSISTENT"))]


def _tuned(config_lists: dict) -> dict:
    """Per kind, the (up, down) autotuners, their picks kept across processes (kernels.autotune_cache)."""
    return {
        kind: (
            Persisted(triton.autotune(ups, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})(_up)),
            Persisted(triton.autotune(downs, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})(_down)),
        )
        for kind, (ups, downs) in config_lists.items()
    }


_TUNED, _TUNED_SMALL_M = _tuned(_CONFIGS), _tuned(_SMALL_M_CONFIGS)


def _kernel(kind: str, stage: int, on_cuda: bool, cfg: triton.Config | None, block_m: int):
    """(kernel, launch kwargs) for stage 0 (up) / 1 (down): `cfg` if given; else autotuned on
    CUDA unless options.moe_autotune is off, else the kind's default config; from the small-M
    lists at BLOCK_M <= SMALL_M where the kind has them."""
    small = block_m <= SMALL_M and kind in _SMALL_M_CONFIGS
    if cfg is None and on_cuda and options.current().moe_autotune:
        return (_TUNED_SMALL_M if small else _TUNED)[kind][stage], {}
    cfg = cfg or (_SMALL_M_CONFIGS if small else _CONFIGS)[kind][stage][0]
    return (_up, _down)[stage], {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def default_block_m(num_pairs: int, num_experts: int, fp8: bool = False) -> int:
    """Rows per aligned block (= the GEMMs' BLOCK_M), from an H200 at E=256, H=4096, I=2048
    (autotuned, TMA weights): 128 rows beat 64 at 4K to 64K tokens, bf16 and FP8. Few rows per
    expert: 64-row blocks halve the padding. FP8 at decode sizes (at most 16 pairs an expert):
    16- or 32-row blocks with the _SMALL_M_CONFIGS stream the weights faster than 64-row ones;
    at 32 pairs an expert 64-row blocks are ahead again. bf16's 64-row blocks already stream at
    nearly the copy bandwidth at decode sizes."""
    per_expert = num_pairs / num_experts
    if fp8 and per_expert <= 16:
        return 16 if per_expert <= 8 else 32
    return 128 if per_expert >= LARGE_BLOCK_PER_EXPERT else 64


def _half_tails(block_m: int, on_cuda: bool, pairs_per_expert: float, fp8: bool) -> bool:
    """Whether the GEMMs compute only the first half of a block whose second half is padding
    (HALF_TAILS): on the GPU from 128-row blocks (a 64-row half is one wgmma M tile per
    warpgroup), in the interpreter from 32 (tests cover it at small sizes), and only where the
    halved tails are a large share of the work: below 1024 pairs per expert for FP8, below 512
    for bf16. On an H200 (E=256, H=4096, I=2048, on and off tuned apart: off can use PERSISTENT,
    on cannot, see _prune) it paid most at 4K tokens (128 pairs an expert), still for FP8 at 16K
    (512), and not at 64K (2048), where the tails it halves are ~1.5% of the work and the branch
    costs the whole blocks a little. options.moe_half_tails overrides the rule
    (MIMO_FN_MOE_HALF_TAILS=0 off, =1 on at any size; `python -m mimo_fn.bench moe --half-tails-ab`
    times both)."""
    forced = options.current().moe_half_tails
    if forced is False or block_m < (128 if on_cuda else 32):
        return False
    return forced is True or pairs_per_expert < (1024 if fp8 else 512)


def _grid(num_slots: int, block_m: int, n: int, num_progs: int):
    def grid(meta):
        tiles = triton.cdiv(num_slots, block_m) * triton.cdiv(n, meta["BLOCK_N"])
        return (min(tiles, num_progs),) if meta.get("PERSISTENT") else (tiles,)
    return grid


def _num_progs(dev: torch.device) -> int:
    """Programs of a PERSISTENT launch (NUM_PROGS): one per SM; the interpreter: 3, so tests
    walk several tiles per program."""
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 3


def _tma_2d(t: torch.Tensor, use: bool | None) -> TensorDescriptor | None:
    """[A, B, C] (or [A, C]) as a 2D TMA descriptor over rows A*B, or None where TMA can't
    address it (16-byte aligned base and row stride, contiguous rows) or use is False; with
    use None, options.moe_tma off (MIMO_FN_MOE_TMA=0) turns descriptors off."""
    if use is False or (use is None and not options.current().moe_tma):
        return None
    if t.dim() == 3:
        if t.stride(0) != t.shape[1] * t.stride(1):
            return None
        t = t.view(-1, t.shape[-1])
    if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return None
    # a placeholder box: _desc_boxes sets the launch config's tile before each launch
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


def _tma_gate_up(w13: torch.Tensor, w_desc: TensorDescriptor | None) -> TensorDescriptor | None:
    """w13 [E, 2I, H] as the 3D descriptor [E * 2, I, H] (gate and up halves as slabs), for
    FUSED_GU; addressable exactly when _tma_2d's [E * 2I, H] view is (w_desc not None)."""
    if w_desc is None:
        return None
    v = w13.view(w13.shape[0] * 2, w13.shape[1] // 2, w13.shape[2])
    return TensorDescriptor(v, list(v.shape), list(v.stride()), [2, 16, 16])


def _per_expert(pairs_per_expert: float | None, al, w: torch.Tensor) -> float:
    # the pairs an expert gets: the caller's count where P / E overcounts (EP gather: -1 ids)
    return al.num_pairs / w.shape[0] if pairs_per_expert is None else pairs_per_expert


def _kind(x_TH: torch.Tensor) -> str:
    if x_TH.dtype == FP8_DTYPE:
        return "fp8"
    return "fp32" if x_TH.dtype == torch.float32 else "bf16"  # "bf16": fp16 too


def _moe_up(x_TH, xs_TG, w13, w13_s, al, top_k, h_dtype, cfg=None, tma=None, pairs_per_expert=None,
            deterministic=False, ws=False):
    """The up GEMM + SiLU*up over align.py's slots: (h_MI, hs_MIb).

    FP8 (x_TH float8 with 1x128 scales xs_TG, w13 with block scales w13_s): h_dtype FP8_DTYPE
    quantises h per slot in 1x128 groups with scales hs_MIb; float32 keeps the unquantised
    product (a numerics probe; hs_MIb None). Dense: xs_TG and w13_s None, h in h_dtype.
    cfg forces a launch config, tma (None: where possible) the TMA path for the weights.
    pairs_per_expert: the valid pairs an expert gets, for the HALF_TAILS choice (None: P / E).
    deterministic: _det_config's config (unless cfg), no half tails (the module docstring).
    ws: FP8 with FP8 h runs up_ws's warp-specialised kernel where it serves (up_ws.serves) and no
    config or pointer weights are forced; never in deterministic mode (its bits are another kernel's).
    Else FP8 h goes to up_cublas's per-expert cuBLAS GEMMs where up_cublas.takes it (opt-in).
    """
    if (ws and not deterministic and cfg is None and tma is not False and h_dtype == FP8_DTYPE
            and up_ws_mod.serves(x_TH, w13, al.block_m)):
        return up_ws_mod.moe_up_fp8_ws(x_TH, xs_TG, w13, w13_s, al, top_k)
    if (not deterministic and cfg is None and h_dtype == FP8_DTYPE
            and up_cublas.takes(x_TH, w13, al.block_m)):
        return up_cublas.moe_up_fp8_cublas(x_TH, xs_TG, w13, w13_s, al, top_k)
    kind, dev = _kind(x_TH), x_TH.device
    if deterministic:
        cfg = cfg or _det_config(kind, 0, al.block_m)
    num_slots, inter, hid = al.sorted_ids_M.numel(), w13.shape[1] // 2, x_TH.shape[1]
    quant_h = h_dtype == FP8_DTYPE
    h_MI = torch.empty(num_slots, inter, dtype=h_dtype, device=dev)
    # [Ib, M] storage: the down GEMM loads one group of BLOCK_M consecutive slots per K step
    hs_MIb = torch.empty(triton.cdiv(inter, 128), num_slots, dtype=torch.float32, device=dev).t() if quant_h else None
    fp8 = kind == "fp8"
    kernel, meta = _kernel(kind, 0, x_TH.is_cuda, cfg, al.block_m)
    w_desc = _tma_2d(w13, tma)
    w3_desc = _tma_gate_up(w13, w_desc)
    if meta:
        meta["FUSED_GU"] = meta.get("FUSED_GU", False) and w3_desc is not None
        _desc_boxes({"w_desc": w_desc, "w3_desc": w3_desc, **meta})
    sx, s13 = (xs_TG.stride(), w13_s.stride()) if fp8 else ((0, 0), (0, 0, 0))
    sh = hs_MIb.stride() if quant_h else (0, 0)
    progs = _num_progs(dev)
    kernel[_grid(num_slots, al.block_m, inter, progs)](
        x_TH, xs_TG if fp8 else x_TH, w13, w_desc, w3_desc, w13_s if fp8 else x_TH, h_MI,
        hs_MIb if quant_h else h_MI,
        al.sorted_ids_M, al.expert_of_block_NB, al.num_tokens_post_pad_1, al.num_pairs, num_slots,
        inter, hid, triton.next_power_of_2(al.num_pairs),  # autotune once per size octave, not per T
        *x_TH.stride(), *sx, *w13.stride(), *s13, *h_MI.stride(), *sh,
        TOP_K=top_k, BLOCK_M=al.block_m, FP8=fp8, IEEE=kind == "fp32", INTERPRET=not x_TH.is_cuda,
        W_DESC=w_desc is not None, QUANT_H=quant_h, NUM_PROGS=progs,
        HALF_TAILS=not deterministic and _half_tails(al.block_m, x_TH.is_cuda, _per_expert(pairs_per_expert, al, w13),
                                                     fp8), **meta,
    )
    return h_MI, hs_MIb


def _moe_down(h_MI, hs_MIb, w2, w2_s, al, topk_weights_TK, out_dtype, cfg=None, tma=None, pairs_per_expert=None,
              deterministic=False, ws=False):
    """The down GEMM times the router weight: y_PH, row p = t*K + k for every valid pair
    (rows of dropped pairs are not written). FP8: h_MI float8 with scales hs_MIb, w2 with w2_s.
    deterministic: as `_moe_up`. ws: FP8 runs down_ws's warp-specialised kernel where it serves
    (down_ws.serves) and no config or pointer weights are forced; never in deterministic mode,
    whose bits must match the Triton kernel's at 64-row blocks too."""
    if ws and not deterministic and cfg is None and tma is not False and down_ws.serves(h_MI, w2, al.block_m):
        return down_ws.moe_down_fp8_ws(h_MI, hs_MIb, w2, w2_s, al, topk_weights_TK, out_dtype)
    kind, dev = _kind(h_MI), h_MI.device
    if deterministic:
        cfg = cfg or _det_config(kind, 1, al.block_m)
    num_slots, hid, inter = h_MI.shape[0], w2.shape[1], w2.shape[2]
    fp8 = kind == "fp8"
    y_PH = torch.empty(al.num_pairs, hid, dtype=out_dtype, device=dev)
    weights_P = topk_weights_TK.contiguous().view(-1)
    kernel, meta = _kernel(kind, 1, h_MI.is_cuda, cfg, al.block_m)
    w_desc = _tma_2d(w2, tma)
    h_desc = _tma_2d(h_MI, tma) if w_desc is not None else None
    if h_desc is None:
        w_desc = None  # one switch for both operands
    if meta:
        _desc_boxes({"w_desc": w_desc, "h_desc": h_desc, "BLOCK_M": al.block_m, **meta})
    sh, s2 = (hs_MIb.stride(), w2_s.stride()) if fp8 else ((0, 0), (0, 0, 0))
    progs = _num_progs(dev)
    kernel[_grid(num_slots, al.block_m, hid, progs)](
        h_MI, h_desc, hs_MIb if fp8 else h_MI, w2, w_desc, w2_s if fp8 else h_MI, y_PH, weights_P,
        al.sorted_ids_M, al.expert_of_block_NB, al.num_tokens_post_pad_1, al.num_pairs, num_slots,
        hid, inter, triton.next_power_of_2(al.num_pairs),
        *h_MI.stride(), *sh, *w2.stride(), *s2, *y_PH.stride(),
        BLOCK_M=al.block_m, FP8=fp8, IEEE=kind == "fp32", INTERPRET=not h_MI.is_cuda,
        W_DESC=w_desc is not None, NUM_PROGS=progs,
        HALF_TAILS=not deterministic and _half_tails(al.block_m, h_MI.is_cuda, _per_expert(pairs_per_expert, al, w2),
                                                     fp8), **meta,
    )
    return y_PH


def _moe_sum_topk(y_PH, topk_ids_TK, num_experts, out_dtype, residual_TH=None):
    """out[t] = sum over valid k of y[t*K + k], in fp32; with residual_TH ([T, H] of out_dtype),
    residual[t] + that sum, with the bits of torch's `residual + out` (ref.add_residual)."""
    t, top_k = topk_ids_TK.shape
    hid = y_PH.shape[1]
    out_TH = torch.empty(t, hid, dtype=out_dtype, device=y_PH.device)
    res_TH = out_TH if residual_TH is None else residual_TH  # never read without HAS_RES
    ids_TK = topk_ids_TK.contiguous()
    block_h = min(1024, triton.next_power_of_2(hid))
    _moe_sum_topk_kernel[(t, triton.cdiv(hid, block_h))](
        y_PH, ids_TK, out_TH, res_TH, hid, num_experts, y_PH.stride(0), out_TH.stride(0), ids_TK.stride(0),
        *res_TH.stride(), TOP_K=top_k, BLOCK_N=block_h, HAS_RES=residual_TH is not None, INTERPRET=not y_PH.is_cuda,
        num_warps=4,
    )
    return out_TH


def _pairs(num_pairs: int, num_experts: int, pairs_per_expert: float | None) -> int:
    """The pairs default_block_m sizes blocks for: num_pairs, or pairs_per_expert's worth."""
    return num_pairs if pairs_per_expert is None else max(1, round(pairs_per_expert * num_experts))


def resolve_block_m(name: str, block_m: int | None, pairs: int, num_experts: int, fp8: bool, on_cuda: bool,
                    deterministic: bool, det_forced: int | None = None) -> int:
    """Rows per aligned block of a launch over `pairs` pairs (`_pairs`): block_m, else
    default_block_m's pick. Deterministic: det_block_m's, and a block_m given must be that one
    (ValueError); det_forced (tests) takes either of the device's deterministic blocks instead."""
    if not deterministic:
        return block_m or default_block_m(pairs, num_experts, fp8)
    bm = det_block_m(on_cuda, pairs, num_experts)
    if block_m not in (None, bm):
        raise ValueError(f"{name}: deterministic mode runs block_m={bm} at {pairs} pairs over {num_experts} experts, "
                         f"got {block_m}")
    if det_forced is None:
        return bm
    dev = "cuda" if on_cuda else "interpreter"
    if det_forced not in (DET_BLOCK_M[dev], DET_BLOCK_M_LARGE[dev]):
        raise ValueError(f"{name}: _det_block_m={det_forced} is not one of deterministic mode's blocks "
                         f"({DET_BLOCK_M[dev]}, {DET_BLOCK_M_LARGE[dev]}) on this device")
    return det_forced


QUANTISE = "quantise"  # _run_moe's xs_TG for the layer's unquantised x (FP8 weights): quantised there


def _run_moe(x_TH, xs_TG, w13, w13_s, w2, w2_s, topk_ids_TK, topk_weights_TK, out_dtype, block_m,
             pairs_per_expert=None, deterministic=False, name="fused_moe", det_forced=None, down_ws=False,
             up_ws=False, residual_TH=None):
    """Align, up GEMM (+SiLU*up), down GEMM (+router weight) into per-pair rows, sum over k
    (+ residual_TH, in the same pass: `_moe_sum_topk`). x_TH is the first GEMM's operand: fp8 with
    scales xs_TG; the layer's unquantised x with xs_TG QUANTISE (FP8 weights): quantised here,
    straight into slot order where up_ws's kernel takes the launch (slots.quant_fp8_slots), else
    token-major (quant_fp8_act); or (xs_TG, w13_s, w2_s None) the dense weights' dtype.
    pairs_per_expert: see dispatch.moe_experts (None: T * K / E). deterministic: the module
    docstring (block_m, det_forced: `resolve_block_m`). down_ws / up_ws: `_moe_down`'s / `_moe_up`'s ws.
    """
    fp8 = xs_TG is not None
    t, hid = x_TH.shape
    num_experts, top_k = w13.shape[0], topk_ids_TK.shape[1]
    if t * top_k == 0:
        return add_residual(torch.zeros(t, hid, dtype=out_dtype, device=x_TH.device), residual_TH)
    bm = resolve_block_m(name, block_m, _pairs(t * top_k, num_experts, pairs_per_expert), num_experts, fp8,
                         x_TH.is_cuda, deterministic, det_forced)
    al = moe_align(topk_ids_TK, num_experts, bm)
    if xs_TG is QUANTISE and up_ws and not deterministic and up_ws_mod.serves(x_TH, w13, bm):
        h_MI, hs_MIb = up_ws_mod.moe_up_fp8_ws(x_TH, None, w13, w13_s, al, top_k)
    else:
        if xs_TG is QUANTISE:
            x_TH, xs_TG = quant_fp8_act(x_TH)
        h_MI, hs_MIb = _moe_up(x_TH, xs_TG, w13, w13_s, al, top_k, FP8_DTYPE if fp8 else out_dtype,
                               pairs_per_expert=pairs_per_expert, deterministic=deterministic, ws=up_ws)
    y_PH = _moe_down(h_MI, hs_MIb, w2, w2_s, al, topk_weights_TK, out_dtype, pairs_per_expert=pairs_per_expert,
                     deterministic=deterministic, ws=down_ws)
    return _moe_sum_topk(y_PH, topk_ids_TK, num_experts, out_dtype, residual_TH)


@typed
def fused_moe(
    x_TH: Float[Tensor, "T H"],
    w13_E2IH: Float[Tensor, "E I2 H"],
    w2_EHI: Float[Tensor, "E H I"],
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    block_m: int | None = None,
    pairs_per_expert: float | None = None,
    deterministic: bool = False,
    *,
    residual_TH: Float[Tensor, "T H"] | None = None,
    _det_block_m: int | None = None,
) -> Float[Tensor, "T H"]:
    """Triton twin of `fused_moe_ref` (bf16 / fp16 / fp32 weights of x's dtype); block_m: None =
    heuristic; pairs_per_expert: see dispatch.moe_experts; deterministic: the module docstring.
    residual_TH: returns residual + the layer's output, added in the sum over k (x's shape and dtype).
    _det_block_m (tests): either of deterministic mode's blocks, forced (`resolve_block_m`)."""
    moe_shapes("fused_moe", x_TH, w13_E2IH, w2_EHI, topk_ids_TK, topk_weights_TK)
    if w13_E2IH.dtype != x_TH.dtype or w2_EHI.dtype != x_TH.dtype:
        raise ValueError(f"fused_moe: weights {w13_E2IH.dtype}/{w2_EHI.dtype} must match x's dtype {x_TH.dtype}")
    check_residual("fused_moe", residual_TH, x_TH)
    return _run_moe(x_TH, None, w13_E2IH, None, w2_EHI, None, topk_ids_TK, topk_weights_TK, x_TH.dtype, block_m,
                    pairs_per_expert, deterministic, "fused_moe", _det_block_m, residual_TH=residual_TH)


@typed
def fused_moe_fp8(
    x_TH: Float[Tensor, "T H"],
    w13_q: Float[Tensor, "E I2 H"],
    w13_scale: Float[Tensor, "E I2b Hb"],
    w2_q: Float[Tensor, "E H I"],
    w2_scale: Float[Tensor, "E Hb Ib"],
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    block_m: int | None = None,
    pairs_per_expert: float | None = None,
    deterministic: bool = False,
    *,
    down_ws: bool | None = None,
    up_ws: bool | None = None,
    residual_TH: Float[Tensor, "T H"] | None = None,
    _det_block_m: int | None = None,
) -> Float[Tensor, "T H"]:
    """FP8 block-weight, FP8 1x128-activation MoE; output in x's dtype. Twin: `fused_moe_fp8_ref`.
    pairs_per_expert: see dispatch.moe_experts; deterministic, residual_TH, _det_block_m: as `fused_moe`'s.
    down_ws: the down GEMM runs kernels/moe/down_ws.py's warp-specialised kernel where it can (Hopper,
    128-row blocks, H a multiple of 256, I of 128, not deterministic), else the Triton one; None:
    options.moe_down_ws (on unless MIMO_FN_MOE_DOWN_WS=0). up_ws: the same for the up GEMM
    (kernels/moe/up_ws.py, x quantised straight into slot order; None: options.moe_up_ws, on unless
    MIMO_FN_MOE_UP_WS=0, from up_ws.MIN_PAIRS_PER_EXPERT pairs per expert on)."""
    moe_shapes("fused_moe_fp8", x_TH, w13_q, w2_q, topk_ids_TK, topk_weights_TK)
    check_fp8_weights("fused_moe_fp8", "w13", w13_q, w13_scale)
    check_fp8_weights("fused_moe_fp8", "w2", w2_q, w2_scale)
    check_residual("fused_moe_fp8", residual_TH, x_TH)
    if down_ws is None:
        down_ws = options.current().moe_down_ws
    if up_ws is None:
        per_expert = _pairs(topk_ids_TK.numel(), w13_q.shape[0], pairs_per_expert) / w13_q.shape[0]
        up_ws = options.current().moe_up_ws and per_expert >= up_ws_mod.MIN_PAIRS_PER_EXPERT
    return _run_moe(x_TH, QUANTISE, w13_q, w13_scale, w2_q, w2_scale, topk_ids_TK, topk_weights_TK, x_TH.dtype, block_m,
                    pairs_per_expert, deterministic, "fused_moe_fp8", _det_block_m, down_ws, up_ws=up_ws,
                    residual_TH=residual_TH)
