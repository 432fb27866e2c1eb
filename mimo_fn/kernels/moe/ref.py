"""The plain-torch MoE oracle: what the Triton kernels of gemm.py and mxfp4.py compute.

Legend: T tokens, H hidden, E experts, I expert intermediate size, K experts per token,
Hb / Ib / I2b = ceil(H / 128) / ceil(I / 128) / ceil(2I / 128) FP8 blocks.

`fused_moe_ref` is the dense layer as transformers computes it; `fused_moe_fp8_ref` simulates
the FP8 kernel in fp32 (block-dequantised weights, both GEMM inputs quantised-dequantised per
token in 1x128 groups); `fused_moe_mxfp4_ref` is the dense layer on MXFP4 weights dequantised
into x's dtype (exact in bf16: an E2M1 value times a power of two), activations unquantised.
Each takes an optional residual_TH and then returns residual + out (`add_residual`), the sum
the kernels fuse into their last pass. The operand checks here are shared with the kernels'
entry points.
"""

import torch
import torch.nn.functional as F

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.quant import (
    FP8_BLOCK, FP8_DTYPE, MXFP4, QTensor, check_mxfp4, dequantize, dequantize_fp8_act, quantize_fp8_act_ref,
)


@typed
def fused_moe_ref(
    x_TH: Float[Tensor, "T H"],
    w13_E2IH: Float[Tensor, "E I2 H"],
    w2_EHI: Float[Tensor, "E H I"],
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    residual_TH: Float[Tensor, "T H"] | None = None,
) -> Float[Tensor, "T H"]:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) for e = topk_ids[t, k], as transformers computes it
    (plus residual_TH, as `add_residual`)."""
    check_residual("fused_moe_ref", residual_TH, x_TH)
    out_TH = torch.zeros_like(x_TH)
    inter = w2_EHI.shape[-1]
    for e in torch.unique(topk_ids_TK).tolist():  # host sync: reference path only
        if e < 0:
            continue
        tok_R, k_R = torch.where(topk_ids_TK == e)
        gate_RI, up_RI = F.linear(x_TH[tok_R], w13_E2IH[e]).split(inter, dim=-1)
        y_RH = F.linear(F.silu(gate_RI) * up_RI, w2_EHI[e])
        y_RH = y_RH * topk_weights_TK[tok_R, k_R, None]
        out_TH.index_add_(0, tok_R, y_RH.to(out_TH.dtype))
    return add_residual(out_TH, residual_TH)


def check_residual(fn: str, residual_TH: torch.Tensor | None, out_TH: torch.Tensor) -> None:
    """ValueError unless residual_TH is None or has the output's shape [T, H], dtype and device
    (out_TH: the output, or x, which the output matches)."""
    if residual_TH is None:
        return
    if (residual_TH.shape != out_TH.shape or residual_TH.dtype != out_TH.dtype
            or residual_TH.device != out_TH.device):
        raise ValueError(f"{fn}: residual_TH must be [T, H] = {list(out_TH.shape)} {out_TH.dtype} on {out_TH.device} "
                         f"(the output's), got {list(residual_TH.shape)} {residual_TH.dtype} on {residual_TH.device}")


def add_residual(out_TH: torch.Tensor, residual_TH: torch.Tensor | None) -> torch.Tensor:
    """residual + out as torch adds them (fp32 sum, rounded once to the output's dtype), or out
    where there is no residual: the bits the kernels' fused add (gemm._moe_sum_topk) reproduces."""
    check_residual("add_residual", residual_TH, out_TH)
    return out_TH if residual_TH is None else residual_TH + out_TH


def moe_shapes(fn: str, x_TH, w13, w2, topk_ids_TK, topk_weights_TK) -> tuple[int, int, int, int]:
    """(T, H, E, I) after checking that the operands agree; ValueError names the culprit."""
    t, hid = x_TH.shape
    num_experts, two_i, w13_h = w13.shape
    inter = two_i // 2
    if w13_h != hid or two_i % 2:
        raise ValueError(f"{fn}: w13 must be [E, 2I, H={hid}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hid, inter):
        raise ValueError(f"{fn}: w2 must be [E, H, I] = {(num_experts, hid, inter)}, got {tuple(w2.shape)}")
    if topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.shape[0] != t:
        raise ValueError(
            f"{fn}: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights {tuple(topk_weights_TK.shape)} "
            f"must both be [T={t}, K]"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    devices = {x_TH.device, w13.device, w2.device, topk_ids_TK.device, topk_weights_TK.device}
    if len(devices) != 1:
        raise ValueError(f"{fn}: operands on different devices {sorted(map(str, devices))}")
    return t, hid, num_experts, inter


def check_fp8_weights(fn: str, name: str, w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    """w_q float8_e4m3fn [E, N, K] with float32 scales [E, ceil(N/128), ceil(K/128)], else ValueError."""
    e, n, k = w_q.shape
    want = (e, -(-n // 128), -(-k // 128))
    if w_q.dtype != FP8_DTYPE:
        raise ValueError(f"{fn}: {name}_q must be {FP8_DTYPE}, got {w_q.dtype}")
    if tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(f"{fn}: {name}_scale must be float32 {want}, got {w_scale.dtype} {tuple(w_scale.shape)}")


def check_mxfp4_weights(fn: str, w13, w2) -> None:
    """w13 and w2 both MXFP4 QTensors with well-formed data and scales, else ValueError."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QTensor) or w.fmt != MXFP4:
            fmt = w.fmt if isinstance(w, QTensor) else type(w).__name__
            raise ValueError(f"{fn}: {name} must be an {MXFP4!r} QTensor, got {fmt!r}")
        check_mxfp4(f"{fn} ({name})", w)


def qdq_act_fp8(x_TH: torch.Tensor) -> torch.Tensor:
    """x quantised to FP8 per token in 1x128 groups and back, in fp32: what an FP8 GEMM input holds."""
    q_TH, s_TG = quantize_fp8_act_ref(x_TH)
    return dequantize_fp8_act(q_TH, s_TG, torch.float32)


@typed
def fused_moe_fp8_ref(
    x_TH: Float[Tensor, "T H"],
    w13_q: Float[Tensor, "E I2 H"],
    w13_scale: Float[Tensor, "E I2b Hb"],
    w2_q: Float[Tensor, "E H I"],
    w2_scale: Float[Tensor, "E Hb Ib"],
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    residual_TH: Float[Tensor, "T H"] | None = None,
) -> Float[Tensor, "T H"]:
    """What `fused_moe_fp8` computes, simulated in fp32: `fused_moe_ref`'s loop on dequantised
    weights, with both GEMM inputs (x and SiLU(gate)*up) quantised-dequantised per token in 1x128 groups
    (plus residual_TH, as `add_residual`)."""
    moe_shapes("fused_moe_fp8_ref", x_TH, w13_q, w2_q, topk_ids_TK, topk_weights_TK)
    check_residual("fused_moe_fp8_ref", residual_TH, x_TH)
    check_fp8_weights("fused_moe_fp8_ref", "w13", w13_q, w13_scale)
    check_fp8_weights("fused_moe_fp8_ref", "w2", w2_q, w2_scale)
    w13_E2IH = dequantize(QTensor(w13_q, w13_scale, FP8_BLOCK), torch.float32)
    w2_EHI = dequantize(QTensor(w2_q, w2_scale, FP8_BLOCK), torch.float32)
    x32_TH = qdq_act_fp8(x_TH)
    out_TH = torch.zeros_like(x32_TH)
    inter = w2_EHI.shape[-1]
    for e in torch.unique(topk_ids_TK).tolist():  # host sync: reference path only
        if e < 0:
            continue
        tok_R, k_R = torch.where(topk_ids_TK == e)
        gate_RI, up_RI = F.linear(x32_TH[tok_R], w13_E2IH[e]).split(inter, dim=-1)
        y_RH = F.linear(qdq_act_fp8(F.silu(gate_RI) * up_RI), w2_EHI[e])
        out_TH.index_add_(0, tok_R, y_RH * topk_weights_TK[tok_R, k_R, None].float())
    return add_residual(out_TH.to(x_TH.dtype), residual_TH)


@typed
def fused_moe_mxfp4_ref(
    x_TH: Float[Tensor, "T H"],
    w13: QTensor,
    w2: QTensor,
    topk_ids_TK: Int[Tensor, "T K"],
    topk_weights_TK: Float[Tensor, "T K"],
    residual_TH: Float[Tensor, "T H"] | None = None,
) -> Float[Tensor, "T H"]:
    """`fused_moe_ref` on MXFP4 expert weights (w13 [E, 2I, H], w2 [E, H, I] logically),
    dequantised into x's dtype: weight-only quantisation, x and SiLU(gate)*up stay unquantised
    (plus residual_TH, as `add_residual`)."""
    check_mxfp4_weights("fused_moe_mxfp4_ref", w13, w2)
    moe_shapes("fused_moe_mxfp4_ref", x_TH, w13, w2, topk_ids_TK, topk_weights_TK)
    check_residual("fused_moe_mxfp4_ref", residual_TH, x_TH)
    return fused_moe_ref(x_TH, dequantize(w13, x_TH.dtype), dequantize(w2, x_TH.dtype), topk_ids_TK, topk_weights_TK,
                         residual_TH)
