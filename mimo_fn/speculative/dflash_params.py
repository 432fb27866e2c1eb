"""A DFlash draft's shape (DFlashConfig), weights (DFlashParams) and random initialisation;
mimo_fn.speculative.dflash runs it.

Legend: H hidden size (the target's), L target layers read, N draft query heads, G draft KV heads,
D draft head dim, F draft MLP size.
"""

from dataclasses import dataclass

import torch

from mimo_fn.config import ModelConfig


@dataclass(frozen=True)
class DFlashConfig:
    target_layers: tuple[int, ...]  # target layers whose output (residual stream) feeds the context
    mask_token_id: int  # the token that stands for every unknown block position
    block_size: int = 16  # tokens per block: the last verified one and block_size - 1 drafts
    num_layers: int = 1
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 8192
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def check(self, cfg: ModelConfig) -> None:
        """ValueError naming the field that does not fit this config or the target's."""
        if not self.target_layers or any(not 0 <= i < cfg.num_layers for i in self.target_layers):
            raise ValueError(f"DFlashConfig.target_layers = {self.target_layers}: expected layers of the "
                             f"target, in [0, {cfg.num_layers})")
        if not 0 <= self.mask_token_id < cfg.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id = {self.mask_token_id}: outside [0, {cfg.vocab_size})")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size = {self.block_size}: a block needs >= 2 tokens")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"DFlashConfig: num_heads {self.num_heads} must divide by num_kv_heads "
                             f"{self.num_kv_heads}, and head_dim {self.head_dim} be even")


@dataclass(frozen=True)
class DraftLayer:
    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor  # [N*D, H]
    wk: torch.Tensor  # [G*D, H]
    wv: torch.Tensor  # [G*D, H]
    wo: torch.Tensor  # [H, N*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    mlp_norm: torch.Tensor  # [H]
    w_gate: torch.Tensor  # [F, H]
    w_up: torch.Tensor  # [F, H]
    w_down: torch.Tensor  # [H, F]


@dataclass(frozen=True)
class DFlashParams:
    fc: torch.Tensor  # [H, L*H]: the target layers' hidden states, side by side, to one
    hidden_norm: torch.Tensor  # [H]
    layers: tuple[DraftLayer, ...]
    norm: torch.Tensor  # [H]
    vocab: torch.Tensor | None = None  # int64 [Vd]: the tokens it may propose (draft_vocab; None: all)


def init_dflash(cfg: ModelConfig, dcfg: DFlashConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> DFlashParams:
    """Random draft weights (normal, std 0.02; norms 1), deterministic in seed."""
    dcfg.check(cfg)
    gen = torch.Generator().manual_seed(seed)
    H, N, G, D, Fi = cfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size

    def normal(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype=dtype, device=device)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = tuple(DraftLayer(ones(H), normal(N * D, H), normal(G * D, H), normal(G * D, H), normal(H, N * D),
                              ones(D), ones(D), ones(H), normal(Fi, H), normal(Fi, H), normal(H, Fi))
                   for _ in range(dcfg.num_layers))
    return DFlashParams(normal(H, len(dcfg.target_layers) * H), ones(H), layers, ones(H))
