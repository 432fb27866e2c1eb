"""MTP drafts: the multi-token-prediction layers MiMo-V2-Flash is released with, as a proposer.

Legend: T rows of a step (all requests'), H hidden, N query heads, G KV heads, D q/k head dim,
E v head dim, V vocab, C cached positions of one request.

As released (config.json `num_nextn_predict_layers`, tensors `model.mtp.layers.{i}.*`, read and
written by mimo_fn.speculative.mtp_checkpoint), MTP layer i maps a token and a hidden state to
the next hidden state:
  x_TH   eh_proj [H, 2H] of [enorm(embed(token)); hnorm(h)] (RMS norms, the target's embedding)
  y_TH   one decoder layer (mimo_fn.model.decoder_layer) of a sliding-window attention layer as
         the target's SWA layers have it (their KV heads, window, RoPE base and sinks;
         `input_layernorm`, `pre_mlp_layernorm`) and the dense MLP (intermediate_size)
  out_TH final_layernorm(y): the target's LM head reads it, and the next step takes it as its h
The layer is the one-layer model `mtp_model_config(cfg)`, so its weights are described, made and
run as the target's own layers are.

Drafting is a chain of k steps at successive positions, as SGLang's MTP (EAGLE-style) path
runs it. For a request whose tokens x_0 .. x_n are known and whose target hidden states
h_0 .. h_{n-1} were observed (h_p: the residual stream after the target's last layer, through
its final norm: what its LM head reads), every MTP layer first takes position p's row
(x_{p+1}, h_p) for each observed p it has not taken yet, which writes its keys and values at
p; layer 0's output at p = n-1 gives draft d_1. Step j >= 1 runs layer min(j, layers - 1) at
position n-1+j on (d_j, the step before's output), attending that layer's keys of positions up
to n-1 and of the chain's earlier steps in it; its output gives d_{j+1}. Chain rows are scratch:
only verified rows are kept, and the engine verifies every draft, so the drafts change the
speed of decoding, not its tokens. The keys and values of position p depend only on x_{p+1} and
h_p, so a fork of a request's first u tokens takes its rows below u - 1 (row u - 1 waits for
the fork's own token u).

Per request the proposer keeps its observed hidden states [n, H] and each layer's keys and
values [C, G, D] / [C, G, E] on the target's device, all of the sequence (a prefix cache entry
may be forked anywhere); attention runs request by request in the plain-torch reference
(kernels/attention/ref.py), the projections and MLPs batched over all requests of a step.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch.utils import _pytree as pytree

from mimo_fn.config import DENSE, SWA, ModelConfig
from mimo_fn.kernels.attention.ref import attend
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.model import decoder_layer
from mimo_fn.params import Layer, Params, WeightInfo, describe, from_flat, to_flat, weight_dtype
from mimo_fn.speculative.proposer import Proposer


def mtp_model_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer model an MTP layer's decoder layer is: sliding-window attention, dense MLP."""
    return replace(cfg, num_layers=1, layer_types=(SWA,), mlp_types=(DENSE,))


@dataclass(frozen=True)
class MTPLayer:
    enorm: torch.Tensor  # [H]
    hnorm: torch.Tensor  # [H]
    eh_proj: torch.Tensor  # [H, 2H]: [embedding; hidden] to one
    block: Layer  # the decoder layer (mtp_model_config's layer 0)
    final_norm: torch.Tensor  # [H]


@dataclass(frozen=True)
class MTPParams:
    layers: tuple[MTPLayer, ...]


for _cls in (MTPLayer, MTPParams):
    pytree.register_pytree_node(
        _cls, lambda obj: ([getattr(obj, f.name) for f in fields(obj)], type(obj)),
        lambda children, cls: cls(*children))


_TOP = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
        "final_norm": "final_layernorm.weight"}  # MTPLayer field -> hub name under model.mtp.layers.{i}.
_BLOCK_RENAMES = {"post_attention_layernorm": "pre_mlp_layernorm"}  # the released name of the MLP's norm


def describe_mtp(cfg: ModelConfig, num_layers: int) -> dict[str, WeightInfo]:
    """Every MTP weight by its path ('layers.1.block.attn.wq', 'layers.0.eh_proj'), in checkpoint
    order: shape, init and hub name (model.mtp.layers.{i}.*). The decoder layer's weights are
    those `describe` gives layer 0 of mtp_model_config(cfg), renamed."""
    if num_layers < 1:
        raise ValueError(f"MTP: num_nextn_predict_layers = {num_layers}: expected at least 1 MTP layer")
    H = cfg.hidden_size
    block = {path.removeprefix("layers.0."): info for path, info in describe(mtp_model_config(cfg)).items()
             if path.startswith("layers.0.")}
    out = {}
    for i in range(num_layers):
        h = f"model.mtp.layers.{i}."
        out[f"layers.{i}.enorm"] = WeightInfo((H,), "ones", (h + _TOP["enorm"],))
        out[f"layers.{i}.hnorm"] = WeightInfo((H,), "ones", (h + _TOP["hnorm"],))
        out[f"layers.{i}.eh_proj"] = WeightInfo((H, 2 * H), "normal", (h + _TOP["eh_proj"],), quantizable=True)
        for path, info in block.items():
            key = info.hub[0].replace("model.layers.0.", h)
            for old, new in _BLOCK_RENAMES.items():
                key = key.replace(old, new)
            out[f"layers.{i}.block.{path}"] = replace(info, hub=(key,))
        out[f"layers.{i}.final_norm"] = WeightInfo((H,), "ones", (h + _TOP["final_norm"],))
    return out


def mtp_from_flat(cfg: ModelConfig, num_layers: int, flat: dict) -> MTPParams:
    mcfg = mtp_model_config(cfg)
    layers = []
    for i in range(num_layers):
        p = f"layers.{i}."
        block = from_flat(mcfg, {"embed": None, "norm": None, "lm_head": None,
                                 **{"layers.0." + k.removeprefix(p + "block."): v for k, v in flat.items()
                                    if k.startswith(p + "block.")}}).layers[0]
        layers.append(MTPLayer(flat[p + "enorm"], flat[p + "hnorm"], flat[p + "eh_proj"], block, flat[p + "final_norm"]))
    return MTPParams(tuple(layers))


def mtp_to_flat(params: MTPParams) -> dict:
    """{path: weight} as describe_mtp names them (the inverse of mtp_from_flat)."""
    out = {}
    for i, layer in enumerate(params.layers):
        p = f"layers.{i}."
        out.update({p + name: getattr(layer, name) for name in _TOP})
        dummy = Params(None, (layer.block,), None, None)
        out.update({p + "block." + k.removeprefix("layers.0."): v for k, v in to_flat(dummy).items()
                    if k.startswith("layers.0.")})
    return out


def init_mtp(cfg: ModelConfig, num_layers: int, seed: int = 0, dtype: torch.dtype | str = torch.float32,
             device: str | torch.device = "cpu") -> MTPParams:
    """Random MTP weights (as init_params draws the target's: normal std 0.02, norms 1), deterministic in seed."""
    dtype = weight_dtype(dtype, "init_mtp")
    gen = torch.Generator().manual_seed(seed)
    flat = {}
    for path, info in describe_mtp(cfg, num_layers).items():
        if info.init == "normal":
            t = torch.randn(info.shape, generator=gen) * 0.02
        else:
            t = (torch.ones if info.init == "ones" else torch.zeros)(info.shape)
        flat[path] = t.to(device=device, dtype=torch.float32 if info.fp32 else dtype)
    return mtp_from_flat(cfg, num_layers, flat)


@dataclass
class _Seq:
    """What the proposer keeps of one request (grown by doubling; rows past the counts are free)."""

    hidden: torch.Tensor  # [cap, H] observed hidden states (post final norm)
    keys: list[torch.Tensor]  # per MTP layer [cap, G, D]
    values: list[torch.Tensor]  # per MTP layer [cap, G, E]
    observed: int = 0  # hidden states held: positions 0 .. observed - 1
    cached: int = 0  # positions whose keys and values every layer holds (<= observed)


class MTPProposer(Proposer):
    """Engine proposer (EngineConfig.proposer, with num_draft_tokens = k drafts a step) backed by
    MTP layers: the chain of the module docstring, every request of a step batched."""

    def __init__(self, params: MTPParams, target: Params, cfg: ModelConfig):
        H = cfg.hidden_size
        if not params.layers:
            raise ValueError("MTPProposer: no MTP layers")
        if params.layers[0].eh_proj.shape != (H, 2 * H):
            raise ValueError(f"MTPProposer: eh_proj is {list(params.layers[0].eh_proj.shape)}, expected {[H, 2 * H]} "
                             f"for the target's hidden size {H}")
        self.params, self.target, self.cfg = params, target, cfg
        self.mcfg = mtp_model_config(cfg)
        self.target_layers = (cfg.num_layers - 1,)
        self._seqs: dict[int, _Seq] = {}

    # the per-request state

    def _seq(self, rid: int, need: int) -> _Seq:
        """rid's record with room for `need` positions."""
        s = self._seqs.get(rid)
        if s is None or s.hidden.shape[0] < need:
            cap = max(64, need, 2 * (0 if s is None else s.hidden.shape[0]))
            ref = self.params.layers[0].enorm
            G, D, E = self.cfg.num_swa_kv_heads, self.cfg.head_dim, self.cfg.v_head_dim
            new = _Seq(ref.new_empty(cap, self.cfg.hidden_size), [ref.new_empty(cap, G, D) for _ in self.params.layers],
                       [ref.new_empty(cap, G, E) for _ in self.params.layers])
            if s is not None:
                new.hidden[:s.observed] = s.hidden[:s.observed]
                for dst, src in zip(new.keys + new.values, s.keys + s.values):
                    dst[:s.cached] = src[:s.cached]
                new.observed, new.cached = s.observed, s.cached
            s = self._seqs[rid] = new
        return s

    def context_len(self, rid: int) -> int:
        s = self._seqs.get(rid)
        return 0 if s is None else s.observed

    def observe_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """The target's hidden states [T, 1, H] (its last layer) of each request's next verified tokens."""
        items = [(rid, h) for rid, h in items if h.shape[0]]
        if not items:
            return
        final_TH = lm_head_input(torch.cat([h[:, -1] for _, h in items]), self.target, self.cfg)
        for (rid, h), rows_TH in zip(items, final_TH.split([h.shape[0] for _, h in items])):
            s = self._seq(rid, self.context_len(rid) + h.shape[0] + 1)
            s.hidden[s.observed:s.observed + h.shape[0]] = rows_TH.to(s.hidden.dtype)
            s.observed += h.shape[0]

    def observe(self, rid: int, hidden_TLH: torch.Tensor) -> None:
        self.observe_many([(rid, hidden_TLH)])

    def fork(self, sources, upto=None) -> None:
        """{dst: src}: dst starts with src's state of its first upto[dst] tokens (all of it by
        default); keys and values only below position upto - 1 (the row of position u - 1
        reads token u, which dst may not share)."""
        for dst, src in sources.items():
            if self.context_len(dst):
                raise ValueError(f"MTPProposer.fork: sequence {dst} holds context already")
            n = (upto or {}).get(dst, self.context_len(src))
            if n > self.context_len(src):
                raise ValueError(f"MTPProposer.fork: sequence {src} holds {self.context_len(src)} tokens of "
                                 f"context, fewer than the {n} sequence {dst} forks")
            if not n:
                continue
            s, d = self._seqs[src], self._seq(dst, n + 1)
            c = min(s.cached, n - 1)
            d.hidden[:n] = s.hidden[:n]
            for a, b in zip(d.keys + d.values, s.keys + s.values):
                a[:c] = b[:c]
            d.observed, d.cached = n, c

    def forget(self, rid: int) -> None:
        self._seqs.pop(rid, None)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(self.params) if isinstance(t, torch.Tensor)]

    # drafting

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(rid, tokens, k)])[0]

    def propose_many(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Each request's k drafts after its tokens, whose last is the only one not observed."""
        out: list[list[int]] = [[] for _ in asks]
        live = [(i, rid, tokens, k) for i, (rid, tokens, k) in enumerate(asks) if k > 0 and self.context_len(rid)]
        for _, rid, tokens, _ in live:
            if self.context_len(rid) != len(tokens) - 1:
                raise ValueError(f"MTPProposer: sequence {rid} has {self.context_len(rid)} observed tokens, "
                                 f"expected {len(tokens) - 1} (all but the last of {len(tokens)})")
        if not live:
            return out
        dev = self.params.layers[0].enorm.device
        # verified rows every layer takes: positions from the first not cached (at least the last) on
        rows = []  # (request index in live, position, next token)
        for b, (_, rid, tokens, _) in enumerate(live):
            s = self._seqs[rid]
            rows += [(b, p, tokens[p + 1]) for p in range(min(s.cached, s.observed - 1), s.observed)]
        owner = [b for b, _, _ in rows]
        pos_T = torch.tensor([p for _, p, _ in rows], device=dev)
        tok_T = torch.tensor([t for _, _, t in rows], device=dev)
        h_TH = torch.cat([self._seqs[live[b][1]].hidden[p:p + 1] for b, p, _ in rows])
        last = [max(r for r, b in enumerate(owner) if b == c) for c in range(len(live))]  # each request's row n-1
        for li in range(len(self.params.layers)):
            y_TH = self._layer(li, tok_T, h_TH, pos_T, owner, live, commit=True)
            if li == 0:
                out_BH = y_TH[last]
        for _, rid, _, _ in live:
            s = self._seqs[rid]
            s.cached = s.observed
        drafts = [[] for _ in live]
        scratch: dict = {}  # (layer, request) -> the chain's keys and values in that layer
        step_rows = list(range(len(live)))
        for j in range(max(k for *_, k in live)):
            d_B = linear(out_BH.to(self.target.embed.dtype), self.target.lm_head).argmax(dim=-1)
            for b, t in zip(step_rows, d_B.tolist()):
                drafts[b].append(t)
            step_rows_next = [r for r, b in enumerate(step_rows) if live[b][3] > j + 1]
            if not step_rows_next:
                break
            li = min(j + 1, len(self.params.layers) - 1)
            keep = torch.tensor(step_rows_next, device=dev)
            step_rows = [step_rows[r] for r in step_rows_next]
            pos_B = torch.tensor([self._seqs[live[b][1]].observed + j for b in step_rows], device=dev)
            out_BH = self._layer(li, d_B[keep], out_BH[keep], pos_B, step_rows, live, commit=False, scratch=scratch)
        for b, (i, _, _, k) in enumerate(live):
            out[i] = drafts[b][:k]
        return out

    def _layer(self, li: int, tok_T, h_TH, pos_T, owner: list[int], live, commit: bool, scratch=None):
        """MTP layer li on rows (token, hidden, position) of requests owner[t] (indices into live);
        returns its output after the final norm. commit: verified rows, whose keys and values are
        written into the requests' caches; else chain rows, kept in `scratch` for this chain."""
        layer, mcfg, eps = self.params.layers[li], self.mcfg, self.cfg.rms_norm_eps
        e_TH = rms_norm(self.target.embed[tok_T].to(layer.enorm.dtype), layer.enorm, eps)
        x_TH = linear(torch.cat([e_TH, rms_norm(h_TH.to(e_TH.dtype), layer.hnorm, eps)], dim=-1), layer.eh_proj)

        def attn_fn(_, q_TND, k_TGD, v_TGE):
            o = q_TND.new_empty(q_TND.shape[0], q_TND.shape[1], v_TGE.shape[2])
            for b in sorted(set(owner)):
                r = torch.tensor([t for t, c in enumerate(owner) if c == b], device=q_TND.device)
                s = self._seqs[live[b][1]]
                if commit:
                    s.keys[li][pos_T[r]] = k_TGD[r].to(s.keys[li].dtype)
                    s.values[li][pos_T[r]] = v_TGE[r].to(s.values[li].dtype)
                    n = int(pos_T[r].max()) + 1
                    k_LGD, v_LGE, kpos = s.keys[li][:n], s.values[li][:n], torch.arange(n, device=q_TND.device)
                else:
                    ks, vs, ps = scratch.setdefault((li, b), ([], [], []))
                    ks.append(k_TGD[r]), vs.append(v_TGE[r]), ps.append(pos_T[r])
                    c = s.cached
                    k_LGD = torch.cat([s.keys[li][:c].to(k_TGD.dtype), *ks])
                    v_LGE = torch.cat([s.values[li][:c].to(v_TGE.dtype), *vs])
                    kpos = torch.cat([torch.arange(c, device=q_TND.device), *ps])
                o[r] = attend(q_TND[r], k_LGD.to(q_TND.dtype), v_LGE.to(q_TND.dtype), pos_T[r], kpos, mcfg.scale,
                              mcfg.window(0), layer.block.attn.sinks)
            return o

        y_TH, _ = decoder_layer(x_TH, layer.block, mcfg, 0, pos_T, attn_fn)
        return rms_norm(y_TH, layer.final_norm, eps)


def lm_head_input(x_TH: torch.Tensor, target: Params, cfg: ModelConfig) -> torch.Tensor:
    """The target's residual stream after its last layer, through its final norm (what its LM
    head multiplies, lm_head(x) = linear(lm_head_input(x), lm_head))."""
    return rms_norm(x_TH, target.norm, cfg.rms_norm_eps)
