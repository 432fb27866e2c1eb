"""What the MoE benchmarks share: MiMo-V2-Flash's expert-layer shapes, random routings, the
weights, and torch grouped_mm's layer (the baseline).

Legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, P = T*K pairs.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo_fn import options
from mimo_fn.quant import QTensor, quantize_fp8_block

E, K, H, I = 256, 8, 4096, 2048
DEV = "cuda"


@dataclass(frozen=True)
class Weights:
    x_TH: torch.Tensor  # bf16 activations for the largest token count
    w13_E2IH: torch.Tensor  # bf16 gate+up
    w2_EHI: torch.Tensor  # bf16 down
    w13_q: QTensor  # 128x128-block FP8 of the above
    w2_q: QTensor

    @property
    def w13t_EH2I(self) -> torch.Tensor:  # views: what grouped_mm wants
        return self.w13_E2IH.transpose(1, 2)

    @property
    def w2t_EIH(self) -> torch.Tensor:
        return self.w2_EHI.transpose(1, 2)


def make_weights(max_tokens: int, gen: torch.Generator) -> Weights:
    x_TH = torch.randn(max_tokens, H, device=DEV, generator=gen).bfloat16()
    w13_E2IH = (torch.randn(E, 2 * I, H, device=DEV, generator=gen) / H**0.5).bfloat16()
    w2_EHI = (torch.randn(E, H, I, device=DEV, generator=gen) / I**0.5).bfloat16()
    return Weights(x_TH, w13_E2IH, w2_EHI, quantize_fp8_block(w13_E2IH), quantize_fp8_block(w2_EHI))


def routing(kind: str, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, weights_TK): balanced (K distinct uniform experts per token) or skewed (distinct
    experts drawn with Zipf popularity p_e ~ 1/(1+e))."""
    if kind == "balanced":
        ids_TK = torch.rand(t, E, device=DEV, generator=gen).argsort(dim=1)[:, :K]
    else:
        popularity_E = 1.0 / torch.arange(1, E + 1, device=DEV, dtype=torch.float32)
        ids_TK = torch.multinomial(popularity_E.expand(t, E).contiguous(), K, replacement=False, generator=gen)
    weights_TK = torch.rand(t, K, device=DEV, generator=gen) + 0.1
    return ids_TK, weights_TK


def grouped_mm_layer(x_TH, w13t_EH2I, w2t_EIH, ids_TK, weights_TK):
    """torch._grouped_mm MoE; w13t / w2t are the [E, K, N] (transposed) weight views it wants.
    Returns (out_TH, (rows sorted by expert xs_PH, group ends offs_E))."""
    t = x_TH.shape[0]
    ids_P = ids_TK.reshape(-1)
    order_P = torch.argsort(ids_P, stable=True)
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_TH.device).scatter_add_(
        0, ids_P, torch.ones_like(ids_P, dtype=torch.int32)
    )  # bincount would sync on its max
    offs_E = counts_E.cumsum(0).to(torch.int32)
    xs_PH = x_TH[order_P // K]
    h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    a_PI = F.silu(h_P2I[:, :I]) * h_P2I[:, I:]
    y_PH = torch._grouped_mm(a_PI, w2t_EIH, offs=offs_E)
    y_PH = y_PH * weights_TK.reshape(-1)[order_P, None]
    unsorted_PH = torch.empty_like(y_PH)
    unsorted_PH[order_P] = y_PH
    return unsorted_PH.view(t, K, H).sum(dim=1), (xs_PH, offs_E)


def grouped_mm_inputs(w: Weights, x_TH, ids_TK, weights_TK):
    """(xs_PH, a_PI, offs_E): the sorted rows and the down GEMM's input SiLU(gate) * up, made once
    so that `grouped_mm_gemms` times the two GEMMs alone."""
    _, (xs_PH, offs_E) = grouped_mm_layer(x_TH, w.w13t_EH2I, w.w2t_EIH, ids_TK, weights_TK)
    h_P2I = torch._grouped_mm(xs_PH, w.w13t_EH2I, offs=offs_E)
    a_PI = F.silu(h_P2I[:, :I]) * h_P2I[:, I:]
    return xs_PH, a_PI, offs_E


def grouped_mm_gemms(xs_PH, a_PI, offs_E, w13t_EH2I, w2t_EIH):
    """The two grouped GEMMs alone (a_PI made outside the timing)."""
    torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    return torch._grouped_mm(a_PI, w2t_EIH, offs=offs_E)


def grouped_mm_gemms_silu(xs_PH, offs_E, w13t_EH2I, w2t_EIH):
    h_P2I = torch._grouped_mm(xs_PH, w13t_EH2I, offs=offs_E)
    return torch._grouped_mm(F.silu(h_P2I[:, :I]) * h_P2I[:, I:], w2t_EIH, offs=offs_E)


def half_tails(fn, on: bool):
    """fn with options.moe_half_tails forced on (an expert's last block computes its first half
    only when its second half is padding, at every size) or off (every aligned block whole), as
    MIMO_FN_MOE_HALF_TAILS=1 / 0 set before import would; the caller's setting back after."""
    return with_options(fn, moe_half_tails=on)


def with_options(fn, **changes):
    """fn run with options.override(**changes) (e.g. moe_up_cublas=False), the caller's back after."""
    def run():
        with options.override(**changes):
            return fn()
    return run


def rel_err(out, ref) -> float:
    ref = ref.float()
    return float((out.float() - ref).abs().max() / ref.abs().max())
