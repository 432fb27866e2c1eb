"""Which MoE expert computation runs a layer: decided here, once, then straight down.

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token,
M padded slots of the aligned layout, P = T*K (token, k) pairs.

`moe_experts` makes every choice for a layer's experts, in this order:
  format      dense (bf16 / fp16 / fp32), FP8_BLOCK or MXFP4 weights (mimo_fn.quant);
  kernel      Triton on CUDA, the plain-torch reference (ref.py) elsewhere or where autograd needs
              a backward (a trainer's forward: the kernels have none), or as forced;
  MXFP4 path  (`fused_moe_mxfp4`) in-GEMM dequantisation (mxfp4.py) or the bf16 GEMMs of gemm.py
              on a dequantised copy (mxfp4_dequant.py), by pairs per expert (mxfp4.dequantize_first).
deterministic (`moe_experts(..., deterministic=True)`): the kernels in gemm.py's deterministic
launch (one config whatever the token count, no half tails; only the row block follows the pairs
an expert gets on average, gemm.det_block_m); MXFP4 weights always take the dequantised copy
through them (the in-GEMM path's choice follows pairs per expert).
Each branch then calls one entry point that runs to the end without coming back here:
  dense        gemm.fused_moe           or ref.fused_moe_ref
  FP8          gemm.fused_moe_fp8       or ref.fused_moe_fp8_ref
  MXFP4        align.py, then mxfp4.py's up / down kernels or mxfp4_dequant.py + gemm.py's,
               then gemm._moe_sum_topk  or ref.fused_moe_mxfp4_ref
A residual_TH given to `moe_experts` goes down every branch: the kernels add it in their sum over
k (gemm._moe_sum_topk), the references after it (ref.add_residual), with the same bits.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.kernels.moe import gemm, mxfp4, ref
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.kernels.moe.mxfp4_dequant import dequant_mxfp4
from mimo_fn.quant import FP8_BLOCK, MXFP4, QTensor

DENSE = "dense"


def weight_format(w13, w2) -> str:
    """DENSE, FP8_BLOCK or MXFP4: the format both expert weights share; ValueError otherwise."""
    if isinstance(w13, QTensor) != isinstance(w2, QTensor):
        raise ValueError("moe_experts: w13 and w2 must both be QTensor or both dense tensors")
    if not isinstance(w13, QTensor):
        return DENSE
    if w13.fmt != w2.fmt or w13.fmt not in (FP8_BLOCK, MXFP4):
        raise ValueError(f"moe_experts: w13 / w2 have formats {w13.fmt!r} / {w2.fmt!r}; expected both "
                         f"{FP8_BLOCK!r} or both {MXFP4!r}")
    return w13.fmt


@typed
def moe_experts(
    x_TH: Float[Tensor, "T H"],
    w13: Float[Tensor, "E I2 H"] | QTensor,
    w2: Float[Tensor, "E H I"] | QTensor,
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    use_triton: bool | None = None,
    pairs_per_expert: float | None = None,
    deterministic: bool = False,
    residual_TH: Float[Tensor, "T H"] | None = None,
) -> Float[Tensor, "T H"]:
    """The MoE expert computation: dense, FP8_BLOCK or MXFP4 QTensor weights; Triton on CUDA,
    the plain-torch reference elsewhere or where a gradient is wanted (use_triton=None), or
    forced either way.
    pairs_per_expert: the valid pairs an expert gets, where T * K / E overcounts them (rows
    gathered from EP ranks carry -1 for other ranks' experts); the kernels' size heuristics (rows
    per aligned block, half tails, the MXFP4 path) then go by it. None: by T * K / E.
    deterministic: a row's bits follow no token count (the module docstring).
    residual_TH: returns residual + the experts' output (x's shape and dtype; ValueError else),
    with the bits of torch's `residual_TH + moe_experts(...)`."""
    fmt = weight_format(w13, w2)
    wants_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x_TH, w13, w2, topk_weights_TK, residual_TH))
    kernel = x_TH.is_cuda and not wants_grad if use_triton is None else use_triton
    routing = (topk_ids_TK, topk_weights_TK)
    res = residual_TH
    if fmt == MXFP4:
        if kernel:
            return fused_moe_mxfp4(x_TH, w13, w2, *routing, pairs_per_expert=pairs_per_expert,
                                   deterministic=deterministic, residual_TH=res)
        return ref.fused_moe_mxfp4_ref(x_TH, w13, w2, *routing, residual_TH=res)
    if fmt == FP8_BLOCK:
        if kernel:
            return gemm.fused_moe_fp8(x_TH, w13.data, w13.scale, w2.data, w2.scale, *routing,
                                      pairs_per_expert=pairs_per_expert, deterministic=deterministic, residual_TH=res)
        return ref.fused_moe_fp8_ref(x_TH, w13.data, w13.scale, w2.data, w2.scale, *routing, residual_TH=res)
    if kernel:
        return gemm.fused_moe(x_TH, w13, w2, *routing, pairs_per_expert=pairs_per_expert, deterministic=deterministic,
                              residual_TH=res)
    return ref.fused_moe_ref(x_TH, w13, w2, *routing, residual_TH=res)


@typed
def fused_moe_mxfp4(
    x_TH: Float[Tensor, "T H"],
    w13: QTensor,
    w2: QTensor,
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    block_m: int | None = None,
    dequantize: bool | None = None,
    pairs_per_expert: float | None = None,
    deterministic: bool = False,
    residual_TH: Float[Tensor, "T H"] | None = None,
) -> Float[Tensor, "T H"]:
    """MoE experts on MXFP4 weights (w13 [E, 2I, H], w2 [E, H, I] logically), activations in x's
    dtype (bf16 / fp16 / fp32), output in x's dtype; H and I multiples of 32. Twin:
    `ref.fused_moe_mxfp4_ref`. block_m: rows per aligned block (None: gemm.default_block_m, as
    for FP8 weights: also 16 / 32 rows at decode sizes, where the GEMMs stream weights).
    dequantize: run gemm.py's dense kernels on a copy of the weights dequantised to x's dtype
    (one GEMM's worth at a time, freed after it) instead of dequantising in the GEMMs; None:
    `mxfp4.dequantize_first` decides by pairs per expert. Both compute the same function.
    pairs_per_expert: the valid pairs an expert gets, for these choices (None: T * K / E; see
    moe_experts). deterministic: the dequantised copy through gemm.py's deterministic launch
    (block_m, if given, must be gemm.det_block_m's). residual_TH: as gemm.fused_moe's."""
    mxfp4.check_operands(x_TH, w13, w2, topk_ids_TK, topk_weights_TK)
    ref.check_residual("fused_moe_mxfp4", residual_TH, x_TH)
    t, hid = x_TH.shape
    num_experts, top_k = w13.shape[0], topk_ids_TK.shape[1]
    if t * top_k == 0:
        return ref.add_residual(torch.zeros(t, hid, dtype=x_TH.dtype, device=x_TH.device), residual_TH)
    per_expert = t * top_k / num_experts if pairs_per_expert is None else pairs_per_expert
    if deterministic and dequantize is False:
        raise ValueError("fused_moe_mxfp4: deterministic mode runs the dequantised copy (dequantize=False given)")
    if dequantize is None:
        dequantize = deterministic or mxfp4.dequantize_first(per_expert, x_TH.is_cuda)
    pairs = gemm._pairs(t * top_k, num_experts, pairs_per_expert)
    block_m = gemm.resolve_block_m("fused_moe_mxfp4", block_m, pairs, num_experts, not dequantize, x_TH.is_cuda,
                                   deterministic)
    al = moe_align(topk_ids_TK, num_experts, block_m)
    if dequantize:  # each dense copy lives only through its GEMM
        h_MI, _ = gemm._moe_up(x_TH, None, dequant_mxfp4(w13, x_TH.dtype), None, al, top_k, x_TH.dtype,
                               pairs_per_expert=pairs_per_expert, deterministic=deterministic)
        y_PH = gemm._moe_down(h_MI, None, dequant_mxfp4(w2, x_TH.dtype), None, al, topk_weights_TK, x_TH.dtype,
                              pairs_per_expert=pairs_per_expert, deterministic=deterministic)
    else:
        h_MI = mxfp4._moe_up_mxfp4(x_TH, w13, al, top_k)
        y_PH = mxfp4._moe_down_mxfp4(h_MI, w2, al, topk_weights_TK)
    return gemm._moe_sum_topk(y_PH, topk_ids_TK, num_experts, x_TH.dtype, residual_TH)
