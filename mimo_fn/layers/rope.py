"""Partial rotary embedding: the first `rope_dim` of each q/k head rotate, the rest pass.

Legend: T tokens, N heads, D head dim, R rope dim (int(D * partial_rotary_factor)).
Pairs are (i, i + R/2) ("rotate half"), frequencies theta^(-2i/R), angles in fp32.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed


@typed
def rope_cos_sin(
    pos_T: Int[Tensor, " T"], rope_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Float[Tensor, "T R"], Float[Tensor, "T R"]]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=pos_T.device) / rope_dim))
    freqs_TR2 = pos_T.float()[:, None] * inv_freq[None, :]
    emb_TR = torch.cat([freqs_TR2, freqs_TR2], dim=-1)
    return emb_TR.cos().to(dtype), emb_TR.sin().to(dtype)


@typed
def apply_rope(
    x_TND: Float[Tensor, "T N D"], cos_TR: Float[Tensor, "T R"], sin_TR: Float[Tensor, "T R"]
) -> Float[Tensor, "T N D"]:
    rope_dim = cos_TR.shape[-1]
    rot_TNR, rest = x_TND[..., :rope_dim], x_TND[..., rope_dim:]
    half = rope_dim // 2
    rotated_TNR = torch.cat([-rot_TNR[..., half:], rot_TNR[..., :half]], dim=-1)
    rot_TNR = rot_TNR * cos_TR[:, None, :] + rotated_TNR * sin_TR[:, None, :]
    return torch.cat([rot_TNR, rest], dim=-1)
