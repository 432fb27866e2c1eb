"""The step functions: forward (reference, no cache), and the decoder layer they share.

Legend: T tokens, H hidden, V vocab, N query heads, G kv heads, D q/k head dim,
E v head dim, K experts per token, L layers.
"""

from typing import Callable

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.layers.attend import attend
from mimo_fn.layers.attention import project_out, project_qkv
from mimo_fn.layers.linear import linear
from mimo_fn.layers.mlp import dense_mlp
from mimo_fn.layers.moe import moe
from mimo_fn.layers.norm import rms_norm
from mimo_fn.params import DenseMLP, Layer, Params

# attention between the projections: (layer index, q_TND, k_TGD, v_TGE) -> o_TNE
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def decoder_layer(
    x_TH: torch.Tensor, layer: Layer, cfg: ModelConfig, i: int, pos_T: torch.Tensor, attn_fn: AttnFn
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pre-norm decoder layer. Returns the new residual stream and the routed expert ids
    [T, K] (None on a dense layer)."""
    h_TH = rms_norm(x_TH, layer.attn_norm, cfg.rms_norm_eps)
    q_TND, k_TGD, v_TGE = project_qkv(h_TH, layer.attn, cfg, i, pos_T)
    x_TH = x_TH + project_out(attn_fn(i, q_TND, k_TGD, v_TGE), layer.attn)
    h_TH = rms_norm(x_TH, layer.mlp_norm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, DenseMLP):
        return x_TH + dense_mlp(h_TH, layer.mlp), None
    y_TH, ids_TK = moe(h_TH, layer.mlp, cfg)
    return x_TH + y_TH, ids_TK


def lm_head(x_TH: torch.Tensor, params: Params, cfg: ModelConfig) -> torch.Tensor:
    return linear(rms_norm(x_TH, params.norm, cfg.rms_norm_eps), params.lm_head)


def check_tokens(tokens: torch.Tensor, cfg: ModelConfig, what: str = "tokens") -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0].item()
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")


@typed
def forward(params: Params, cfg: ModelConfig, tokens_T: Int[Tensor, " T"]) -> Float[Tensor, "T V"]:
    """Logits of one sequence at positions 0..T-1, with no cache: the reference path."""
    check_tokens(tokens_T, cfg)
    pos_T = torch.arange(tokens_T.shape[0], device=tokens_T.device)

    def attn_fn(i: int, q_TND, k_TGD, v_TGE):
        sinks_N = params.layers[i].attn.sinks
        return attend(q_TND, k_TGD, v_TGE, pos_T, pos_T, cfg.scale, cfg.window(i), sinks_N)

    x_TH = params.embed[tokens_T]
    for i, layer in enumerate(params.layers):
        x_TH, _ = decoder_layer(x_TH, layer, cfg, i, pos_T, attn_fn)
    return lm_head(x_TH, params, cfg)
