"""DFlash block drafts for speculative decoding: a small draft model that proposes a whole
block of tokens in one forward pass, conditioned on the target model's hidden states.

Legend: B block size (the last verified token + B-1 drafts), C context tokens, H hidden size
(the target's), L target layers read, N draft query heads, G draft KV heads, D draft head dim,
F draft MLP size, V vocabulary.

The design is z-lab's DFlash (github.com/z-lab/dflash), written here from its description:
  ctx_CH  hidden_norm(fc(the target's hidden states after each layer in target_layers, side
          by side)) for every verified token: the draft's context
  x_BH    the target's embedding of [last verified token, mask, ..., mask]
  a layer pre-norm attention: queries from the block, keys and values from the context and the
          block together (RMS-normed queries and keys, rotary positions), no causal mask;
          then a SwiGLU MLP
  drafts  the argmax of the target's LM head on norm(x) at block positions 1 .. B-1
Each layer's context keys and values are cached per sequence, so a step projects only the
tokens verified since the step before. Plain torch: the draft is small next to the target.
`draft_logits` drafts one sequence the plain way (the reference); `DFlashProposer` drafts
every sequence of a step at once (`draft_logits_batched`): one set of projections, MLP and LM
head GEMMs for all of them, and per sequence one attention call over its cache in place.

No DFlash draft has been trained for MiMo-V2-Flash. `init_dflash` makes random weights: they
drive the whole mechanism (and show its cost) but hardly ever guess right. A trained draft in
z-lab's checkpoint layout loads with `mimo_fn.spec.dflash_checkpoint.load_dflash`; the forward
here was checked line by line against z-lab's published model code (dflash/model.py: context
keys and values from hidden_norm(fc(...)) without the layer's input norm, q/k norms per head,
rotary positions over context then block, no mask, the draft's final norm, then the target's
LM head).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.params import Params


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


def _rope(x_TnD: torch.Tensor, pos_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions over the whole head, the two halves rotated as pairs (x_i, x_{i+D/2})."""
    d = x_TnD.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x_TnD.device, dtype=torch.float32) / d)  # [D/2]
    ang = pos_T.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, D/2]
    x1, x2 = x_TnD.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_TnD.dtype)


def _heads(x_TX: torch.Tensor, d: int) -> torch.Tensor:
    return x_TX.view(x_TX.shape[0], -1, d)


def _norm_heads(x_TnD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of every head on its own (the queries' and keys' normalisation)."""
    return rms_norm(x_TnD.reshape(-1, x_TnD.shape[-1]), w_D, eps).view_as(x_TnD)


@typed
def context_kv(params: DFlashParams, dcfg: DFlashConfig, hidden_CLH: Float[Tensor, "C L H"],
               pos_C: Int[Tensor, " C"]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [C, G, D] for verified tokens, from the target's hidden states."""
    ctx_CH = rms_norm(linear(hidden_CLH.flatten(1).to(params.fc.dtype), params.fc), params.hidden_norm,
                      dcfg.rms_norm_eps)
    out = []
    for layer in params.layers:
        k_CGD = _norm_heads(_heads(linear(ctx_CH, layer.wk), dcfg.head_dim), layer.k_norm, dcfg.rms_norm_eps)
        out.append((_rope(k_CGD, pos_C, dcfg.rope_theta), _heads(linear(ctx_CH, layer.wv), dcfg.head_dim)))
    return out


@typed
def draft_logits(params: DFlashParams, dcfg: DFlashConfig, target: Params, ctx_kv: Sequence[tuple],
                 tokens_B: Int[Tensor, " B"], pos_B: Int[Tensor, " B"]) -> Float[Tensor, "B V"]:
    """Logits [B, V] of the block [verified token, mask, ...] at positions pos_B, every block
    position seeing the whole context (ctx_kv: each layer's [C, G, D] keys and values) and the
    whole block."""
    D, N, G = dcfg.head_dim, dcfg.num_heads, dcfg.num_kv_heads
    x_BH = target.embed[tokens_B].to(params.fc.dtype)
    for layer, (k_ctx_CGD, v_ctx_CGD) in zip(params.layers, ctx_kv):
        h_BH = rms_norm(x_BH, layer.attn_norm, dcfg.rms_norm_eps)
        q_BND = _rope(_norm_heads(_heads(linear(h_BH, layer.wq), D), layer.q_norm, dcfg.rms_norm_eps), pos_B,
                      dcfg.rope_theta)
        k_BGD = _rope(_norm_heads(_heads(linear(h_BH, layer.wk), D), layer.k_norm, dcfg.rms_norm_eps), pos_B,
                      dcfg.rope_theta)
        k_SGD = torch.cat([k_ctx_CGD, k_BGD])  # S = C + B keys
        v_SGD = torch.cat([v_ctx_CGD, _heads(linear(h_BH, layer.wv), D)])
        rep = N // G  # query heads per KV head
        scores_NBS = torch.einsum("bnd,snd->nbs", q_BND.float(), k_SGD.repeat_interleave(rep, dim=1).float())
        p_NBS = torch.softmax(scores_NBS / math.sqrt(D), dim=-1)  # no mask: the block attends both ways
        o_BND = torch.einsum("nbs,snd->bnd", p_NBS, v_SGD.repeat_interleave(rep, dim=1).float())
        x_BH = x_BH + linear(o_BND.reshape(len(tokens_B), N * D).to(x_BH.dtype), layer.wo)
        h_BH = rms_norm(x_BH, layer.mlp_norm, dcfg.rms_norm_eps)
        x_BH = x_BH + linear(F.silu(linear(h_BH, layer.w_gate)) * linear(h_BH, layer.w_up), layer.w_down)
    return linear(rms_norm(x_BH, params.norm, dcfg.rms_norm_eps).to(target.embed.dtype), target.lm_head)


@typed
def draft_logits_batched(params: DFlashParams, dcfg: DFlashConfig, target: Params, kv_caches: Sequence[torch.Tensor],
                         lengths: Sequence[int], tokens_RB: Int[Tensor, "R B"], pos_RB: Int[Tensor, "R B"],
                         rows: int) -> Float[Tensor, "R J V"]:
    """`draft_logits` for R sequences at once, the logits of block positions 1 .. rows (J = rows).

    kv_caches[r] is sequence r's cache [num_layers, 2, G, capacity, D] (keys, values) holding
    lengths[r] context tokens and room for B more: each layer writes the block's own keys and
    values there (scratch past the context: the next `observe` overwrites them), so attention
    reads one contiguous run of C + B keys without copying the context.
    """
    D, N = dcfg.head_dim, dcfg.num_heads
    R, B = tokens_RB.shape
    eps, theta = dcfg.rms_norm_eps, dcfg.rope_theta
    pos_P = pos_RB.flatten()  # P = R*B block rows, sequence-major
    x_PH = target.embed[tokens_RB.flatten()].to(params.fc.dtype)
    for li, layer in enumerate(params.layers):
        h_PH = rms_norm(x_PH, layer.attn_norm, eps)
        q_PND = _rope(_norm_heads(_heads(linear(h_PH, layer.wq), D), layer.q_norm, eps), pos_P, theta)
        k_PGD = _rope(_norm_heads(_heads(linear(h_PH, layer.wk), D), layer.k_norm, eps), pos_P, theta)
        v_PGD = _heads(linear(h_PH, layer.wv), D)
        o_PND = torch.empty_like(q_PND)
        for r, (kv, n) in enumerate(zip(kv_caches, lengths)):
            blk = slice(r * B, (r + 1) * B)
            kv[li, 0, :, n:n + B] = k_PGD[blk].transpose(0, 1)
            kv[li, 1, :, n:n + B] = v_PGD[blk].transpose(0, 1)
            o_1NBD = F.scaled_dot_product_attention(  # no mask: the block attends both ways
                q_PND[blk].transpose(0, 1)[None], kv[li, 0, :, :n + B][None], kv[li, 1, :, :n + B][None],
                enable_gqa=True)
            o_PND[blk] = o_1NBD[0].transpose(0, 1)
        x_PH = x_PH + linear(o_PND.reshape(R * B, N * D), layer.wo)
        h_PH = rms_norm(x_PH, layer.mlp_norm, eps)
        x_PH = x_PH + linear(F.silu(linear(h_PH, layer.w_gate)) * linear(h_PH, layer.w_up), layer.w_down)
    x_RJH = x_PH.view(R, B, -1)[:, 1:1 + rows]
    return linear(rms_norm(x_RJH.reshape(R * rows, -1), params.norm, eps).to(target.embed.dtype),
                  target.lm_head).view(R, rows, -1)


class DFlashProposer:
    """Engine proposer (EngineConfig.proposer) backed by a DFlash draft model.

    The engine hands it the target's hidden states at `target_layers` for every token whose
    KV it keeps (`observe_many`), asks for each step's drafts of all sequences at once
    (`propose_many`), and `forget`s a sequence when it ends. `observe` / `propose` are the
    one-sequence forms of the protocol (mimo_fn.spec.ngram).
    """

    def __init__(self, params: DFlashParams, dcfg: DFlashConfig, target: Params, cfg: ModelConfig):
        dcfg.check(cfg)
        if params.fc.shape != (cfg.hidden_size, len(dcfg.target_layers) * cfg.hidden_size):
            raise ValueError(f"DFlashProposer: fc is {list(params.fc.shape)}, expected "
                             f"{[cfg.hidden_size, len(dcfg.target_layers) * cfg.hidden_size]} for these target_layers")
        self.params, self.dcfg, self.target = params, dcfg, target
        self.target_layers = dcfg.target_layers
        # rid -> [num_layers, 2, G, capacity, D] keys and values of the observed tokens, and their count;
        # capacity doubles as the context grows, and keeps block_size spare slots for a draft's own keys
        self._kv: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def context_len(self, rid: int) -> int:
        return self._len.get(rid, 0)

    def context(self, rid: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cached (keys, values) [C, G, D] of sequence rid (views)."""
        n, kv = self.context_len(rid), self._kv.get(rid)
        if kv is None:  # nothing observed: no cache to make for it
            return []
        return [(kv[li, 0, :, :n].transpose(0, 1), kv[li, 1, :, :n].transpose(0, 1)) for li in range(kv.shape[0])]

    def _reserve(self, rid: int, need: int) -> torch.Tensor:
        """rid's cache with room for `need` tokens (grown by doubling, the context copied over)."""
        kv = self._kv.get(rid)
        if kv is None or kv.shape[3] < need:
            cap = max(need, 2 * kv.shape[3] if kv is not None else 64)
            d = self.dcfg
            grown = self.params.fc.new_empty(len(self.params.layers), 2, d.num_kv_heads, cap, d.head_dim)
            if kv is not None:
                grown[:, :, :, :self._len[rid]] = kv[:, :, :, :self._len[rid]]
            self._kv[rid] = kv = grown
        return kv

    def observe(self, rid: int, hidden_TLH: torch.Tensor) -> None:
        """The target's hidden states of the sequence's next verified tokens, in order."""
        self.observe_many([(rid, hidden_TLH)])

    def observe_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """observe() for several sequences, their context projections as one batch."""
        items = [(rid, h) for rid, h in items if h.shape[0] > 0]
        if not items:
            return
        dev = items[0][1].device
        pos_T = torch.cat([torch.arange(self.context_len(rid), self.context_len(rid) + h.shape[0], device=dev)
                           for rid, h in items])
        new = context_kv(self.params, self.dcfg, torch.cat([h for _, h in items]), pos_T)  # per layer [T, G, D]
        row = 0
        for rid, h in items:
            n, t = self.context_len(rid), h.shape[0]
            kv = self._reserve(rid, n + t + self.dcfg.block_size)
            for li, (k_TGD, v_TGD) in enumerate(new):
                kv[li, 0, :, n:n + t] = k_TGD[row:row + t].transpose(0, 1)
                kv[li, 1, :, n:n + t] = v_TGD[row:row + t].transpose(0, 1)
            self._len[rid] = n + t
            row += t

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts after `tokens`, whose last token is the only one not observed yet. The
        block is always block_size long (what the draft was trained on); the first k count."""
        return self.propose_many([(rid, tokens, k)])[0]

    def propose_many(self, requests: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """propose() for each (rid, tokens, k), all drafted in one batched forward."""
        out: list[list[int]] = [[] for _ in requests]
        live = [(i, rid, tokens, min(k, self.dcfg.block_size - 1))
                for i, (rid, tokens, k) in enumerate(requests) if k > 0]
        if not live:
            return out
        device, n = self.target.embed.device, self.dcfg.block_size
        for _, rid, tokens, _ in live:
            if self.context_len(rid) != len(tokens) - 1:
                raise ValueError(f"DFlashProposer: sequence {rid} has {self.context_len(rid)} observed tokens, "
                                 f"expected {len(tokens) - 1} (all but the last of {len(tokens)})")
        kv_caches = [self._reserve(rid, len(tokens) - 1 + n) for _, rid, tokens, _ in live]
        tokens_RB = torch.tensor([[tokens[-1]] + [self.dcfg.mask_token_id] * (n - 1) for _, _, tokens, _ in live],
                                 device=device)
        starts_R1 = torch.tensor([[len(tokens) - 1] for _, _, tokens, _ in live], device=device)
        rows = max(k for *_, k in live)
        logits_RJV = draft_logits_batched(
            self.params, self.dcfg, self.target, kv_caches, [len(tokens) - 1 for _, _, tokens, _ in live],
            tokens_RB, starts_R1 + torch.arange(n, device=device), rows)
        drafts_RJ = logits_RJV.argmax(dim=-1).tolist()
        for r, (i, _, _, k) in enumerate(live):
            out[i] = drafts_RJ[r][:k]
        return out

    def forget(self, rid: int) -> None:
        self._kv.pop(rid, None)
        self._len.pop(rid, None)
