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
only verified rows are kept, and the engine verifies every draft (or, with min_confidence p, the
leading drafts whose product of probabilities under their steps' logits stays >= p:
speculative.draft_cut), so the drafts change the speed of decoding, not its tokens. The keys
and values of position p depend only on x_{p+1} and h_p, so a fork of a request's first u
tokens takes its rows below u - 1 (row u - 1 waits for the fork's own token u).

Storage. Each layer's keys [C, G, D] and values [C, G, E] live in pages of a KVCache made by
mimo_fn.cache's allocator (init_context_cache: one "layer" a MTP layer, pages of MTP_PAGE_SIZE
tokens, the pool doubled when it runs out, context_cache.grow), as the DFlash draft's context does: a
request takes pages with cache.extend (its length: the positions every layer holds), a fork
shares the source's whole pages and copies the last, partly filled one (cache.fork), forget
gives them back (cache.release_seq). The observed hidden states stay a per-request tensor
[n, H] (grown by doubling, copied on fork): all of the sequence, as a prefix cache entry may be
forked anywhere.

A step runs, per layer, one batched call over every request (mimo_fn.speculative.mtp_step):
projections and MLP over all rows, the rows' keys and values written into the pages with one
indexed copy, and attention through kernels.attention.dispatch.attention over page tables
(Triton on CUDA, the paged reference elsewhere) in the layer's window, with its sinks. The
verified rows of a request are the last queries of its n keys. A chain step's keys and values
are scratch past the verified positions (the next step's verified rows overwrite them); to keep
them contiguous, a layer li >= 2, which the chain reaches at step li, puts step j's at logical
position n - 1 + j - (li - 1), closing up over the steps that ran other layers, and attends in a
window li - 1 shorter: exactly the keys of the chain above while k <= window + 1 (checked). On
CUDA the chain after layer 0 (its k - 1 steps and k LM-head argmaxes) replays a CUDA graph per
(batch bucket, steps, table width) (mimo_fn.speculative.draft_graphs; padding requests repeat
request 0, as mimo_fn.graphs pads the target's), unless cuda_graphs=False; the verified rows,
ragged, run eagerly. A grown pool has new addresses, so its graphs are captured again;
`clear_graphs` drops them (Engine.release_memory does, and frees the pages with the target's
under the "kv_cache" tag, `kv_cache_tensors`, and the MTP weights under "weights",
`weight_tensors`).
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch.utils import _pytree as pytree

from mimo_fn.cache import KVCache, SeqPages, advance, release_seq
from mimo_fn.cache import fork as cache_fork
from mimo_fn.config import DENSE, SWA, ModelConfig
from mimo_fn.graphs import MIN_TABLE_WIDTH, batch_bucket
from mimo_fn.layers.norm import rms_norm
from mimo_fn.params import Layer, Params, WeightInfo, describe, from_flat, to_flat, weight_dtype
from mimo_fn.speculative.context_cache import ensure_free, extend_growing, init_context_cache
from mimo_fn.speculative.draft_cut import check_cut, confident_prefix
from mimo_fn.speculative.draft_graphs import DraftGraphs
from mimo_fn.speculative.mtp_step import mtp_chain, mtp_rows
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


MTP_PAGE_SIZE = 16  # tokens per page of the MTP layers' K/V (a chain's scratch rows fit a page or two)


@dataclass
class _Seq:
    """A request's observed hidden states (grown by doubling; rows past `observed` are free)."""

    hidden: torch.Tensor  # [cap, H] (post final norm)
    observed: int = 0  # positions 0 .. observed - 1


class MTPProposer(Proposer):
    """Engine proposer (EngineConfig.proposer, with num_draft_tokens = k drafts a step) backed by
    MTP layers: the chain of the module docstring, every request of a step batched."""

    has_graphs = True

    def __init__(self, params: MTPParams, target: Params, cfg: ModelConfig, cuda_graphs: bool = True,
                 min_confidence: float = 0.0):
        self.min_confidence = check_cut(min_confidence, "MTPProposer")  # draft_cut: 0 verifies every draft
        H = cfg.hidden_size
        if not params.layers:
            raise ValueError("MTPProposer: no MTP layers")
        if params.layers[0].eh_proj.shape != (H, 2 * H):
            raise ValueError(f"MTPProposer: eh_proj is {list(params.layers[0].eh_proj.shape)}, expected {[H, 2 * H]} "
                             f"for the target's hidden size {H}")
        self.params, self.target, self.cfg = params, target, cfg
        self.mcfg = mtp_model_config(cfg)
        self.target_layers = (cfg.num_layers - 1,)
        num, window = len(params.layers), self.mcfg.window(0)
        if window and num - 1 > window:
            raise ValueError(f"MTPProposer: {num} MTP layers under a sliding window of {window}: expected at most "
                             f"{window + 1} (a chain step's keys sit up to layers - 2 slots before its position)")
        # the window of each layer's chain calls, whose slots sit shift(li) before their positions
        self.windows = tuple(window - _shift(li) if window else 0 for li in range(num))
        ref = params.layers[0].enorm
        self.cache: KVCache = init_context_cache(num, MTP_PAGE_SIZE, cfg.num_swa_kv_heads, cfg.head_dim, ref.dtype,
                                                 ref.device, v_dim=cfg.v_head_dim)
        self.pages: dict[int, SeqPages] = {}  # rid -> its K/V pages; length: positions every layer holds
        self._seqs: dict[int, _Seq] = {}
        self._graphs = DraftGraphs("MTPProposer", cuda_graphs)  # the chain's, by (padded R, steps, table width)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the chain replays CUDA graphs on CUDA (False once a capture failed)."""
        return self._graphs.enabled

    # the per-request state

    def _hidden_room(self, rid: int, need: int) -> _Seq:
        """rid's record with room for `need` hidden states."""
        s = self._seqs.get(rid)
        if s is None or s.hidden.shape[0] < need:
            cap = max(64, need, 2 * (0 if s is None else s.hidden.shape[0]))
            new = _Seq(self.params.layers[0].enorm.new_empty(cap, self.cfg.hidden_size))
            if s is not None:
                new.hidden[:s.observed] = s.hidden[:s.observed]
                new.observed = s.observed
            s = self._seqs[rid] = new
        return s

    def context_len(self, rid: int) -> int:
        s = self._seqs.get(rid)
        return 0 if s is None else s.observed

    def cached_len(self, rid: int) -> int:
        """Positions whose keys and values every MTP layer holds (at most context_len)."""
        seq = self.pages.get(rid)
        return 0 if seq is None else seq.length

    def observe_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """The target's hidden states [T, 1, H] (its last layer) of each request's next verified tokens."""
        items = [(rid, h) for rid, h in items if h.shape[0]]
        if not items:
            return
        final_TH = lm_head_input(torch.cat([h[:, -1] for _, h in items]), self.target, self.cfg)
        for (rid, h), rows_TH in zip(items, final_TH.split([h.shape[0] for _, h in items])):
            s = self._hidden_room(rid, self.context_len(rid) + h.shape[0] + 1)
            s.hidden[s.observed:s.observed + h.shape[0]] = rows_TH.to(s.hidden.dtype)
            s.observed += h.shape[0]

    def observe(self, rid: int, hidden_TLH: torch.Tensor) -> None:
        self.observe_many([(rid, hidden_TLH)])

    def fork(self, sources, upto=None) -> None:
        """{dst: src}: dst starts with src's state of its first upto[dst] tokens (all of it by
        default): a copy of those hidden states, and the K/V pages below position upto - 1 (the
        row of position u - 1 reads token u, which dst may not share) as cache.fork gives them:
        whole pages shared, the last partly filled one copied."""
        ends, kv_ends = {}, {}
        for dst, src in sources.items():
            if self.context_len(dst):
                raise ValueError(f"MTPProposer.fork: sequence {dst} holds context already")
            n = (upto or {}).get(dst, self.context_len(src))
            if n > self.context_len(src):
                raise ValueError(f"MTPProposer.fork: sequence {src} holds {self.context_len(src)} tokens of "
                                 f"context, fewer than the {n} sequence {dst} forks")
            if n:
                ends[dst] = n
                if min(self.cached_len(src), n - 1):
                    kv_ends[dst] = min(self.cached_len(src), n - 1)
        for dst, n in ends.items():
            d = self._hidden_room(dst, n + 1)
            d.hidden[:n] = self._seqs[sources[dst]].hidden[:n]
            d.observed = n
            if dst in self.pages:  # pages of a dst with no context are only room
                self.cache = release_seq(self.cache, self.pages.pop(dst))
        if kv_ends:
            self._room(len(kv_ends))  # cache.fork copies at most one page a copy, the last
            self.cache, self.pages = cache_fork(self.cache, self.pages, {dst: sources[dst] for dst in kv_ends},
                                                kv_ends)

    def forget(self, rid: int) -> None:
        self._seqs.pop(rid, None)
        seq = self.pages.pop(rid, None)
        if seq is not None:
            self.cache = release_seq(self.cache, seq)

    def _room(self, pages: int) -> None:
        """At least `pages` free pages (context_cache.ensure_free)."""
        self.cache, grown = ensure_free(self.cache, pages)
        if grown:
            self.clear_graphs()  # they hold the old pool's addresses

    def _reserve(self, need: dict[int, int]) -> None:
        """Pages for need[rid] positions of each rid (its verified ones and the chain's after them)."""
        more = {rid: n - self.cached_len(rid) for rid, n in need.items()}
        self.cache, self.pages, grown = extend_growing(self.cache, self.pages, more)
        if grown:
            self.clear_graphs()  # they hold the old pool's addresses

    def _slots(self, rid: int, pos: Sequence[int]) -> list[int]:
        """Flat slots (page * S + offset) of rid's logical positions pos."""
        table, S = self.pages[rid].full, MTP_PAGE_SIZE
        return [table[p // S] * S + p % S for p in pos]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The MTP layers' weights (not the target's embedding and LM head they read): what
        Engine.release_memory frees under the "weights" tag, backed up on the host."""
        return [t for t in pytree.tree_leaves(self.params) if isinstance(t, torch.Tensor)]

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The page tensors (each layer's keys, then values): what Engine.release_memory frees
        and resume_memory brings back under the "kv_cache" tag (none before the first proposal).
        A ValueError while a request is held: its state would be lost."""
        if self._seqs or self.pages:
            rid = min(set(self._seqs) | set(self.pages))
            raise ValueError(f"MTPProposer: {len(set(self._seqs) | set(self.pages))} requests hold MTP state "
                             f"(e.g. request {rid}); forget them first")
        pool = self.cache.full
        return list(pool.k + pool.v) if pool.num_pages else []

    def clear_graphs(self) -> None:
        """Drop the chain's CUDA graphs (captured again on first use)."""
        self._graphs.clear()

    # drafting

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_many([(rid, tokens, k)])[0]

    def propose_many(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Each request's k drafts after its tokens, whose last is the only one not observed."""
        out: list[list[int]] = [[] for _ in asks]
        live = [(i, rid, tokens, k) for i, (rid, tokens, k) in enumerate(asks) if k > 0 and self.context_len(rid)]
        if live:
            drafts_RJ, probs_RJ = self._drafts(live)
            keep = [k for *_, k in live]
            if self.min_confidence:  # each request's own k drafts under the cut, as propose_device's counts
                k_R = torch.tensor(keep, device=probs_RJ.device)
                asked_RJ = torch.arange(probs_RJ.shape[1], device=probs_RJ.device) < k_R[:, None]
                keep = confident_prefix(torch.where(asked_RJ, probs_RJ, 0.0), self.min_confidence).tolist()
            for r, row in enumerate(drafts_RJ.tolist()):
                out[live[r][0]] = row[:keep[r]]
        return out

    def propose_device(self, asks: Sequence[tuple[int, Sequence[int], int]]):
        """The drafts of `propose_many`, left on the device as [R, k] (Proposer.propose_device),
        where every request asks for the same k > 0 and has context; under a confidence cut the
        pair (drafts, how many of each request's to verify [R])."""
        live = [(i, rid, tokens, k) for i, (rid, tokens, k) in enumerate(asks) if k > 0 and self.context_len(rid)]
        if (len(live) != len(asks) or len({k for *_, k in asks}) != 1
                or type(self).propose_many is not MTPProposer.propose_many):
            return None  # (a subclass that drafts its own way in propose_many keeps it)
        k = asks[0][2]
        drafts_RJ, probs_RJ = self._drafts(live)
        if self.min_confidence:
            return drafts_RJ[:, :k], confident_prefix(probs_RJ[:, :k], self.min_confidence)
        return drafts_RJ[:, :k]

    def _drafts(self, live) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain's drafts [R, kmax] on the device for the live asks (i, rid, tokens, k > 0), and
        under a cut each draft's probability under its step's logits (fp32 [R, kmax]; else None)."""
        for _, rid, tokens, _ in live:
            if self.context_len(rid) != len(tokens) - 1:
                raise ValueError(f"MTPProposer: sequence {rid} has {self.context_len(rid)} observed tokens, "
                                 f"expected {len(tokens) - 1} (all but the last of {len(tokens)})")
        kmax, num, window = max(k for *_, k in live), len(self.params.layers), self.mcfg.window(0)
        if window and num > 2 and kmax > window + 1:
            raise ValueError(f"MTPProposer: {kmax} drafts with {num} MTP layers under a sliding window of {window}: "
                             f"expected at most {window + 1} (the chain's keys would leave the window)")
        rids = [rid for _, rid, _, _ in live]
        n_R = [self.context_len(rid) for rid in rids]
        # each request's pages hold its verified positions, then the chain's kmax - 1 rows
        self._reserve({rid: n + kmax - 1 for rid, n in zip(rids, n_R)})
        width = max(len(self.pages[rid].full) for rid in rids)
        table_RW = torch.tensor([self.pages[rid].full + (-1,) * (width - len(self.pages[rid].full)) for rid in rids],
                                dtype=torch.int32)
        out_RH = self._commit(live, n_R, table_RW)
        # chain step j (1-based) of a request at position n - 1 + j, in layer li, sits at logical
        # position n - 1 + j - shift(li) of li's keys (module docstring)
        steps = [(j, min(j, num - 1)) for j in range(1, kmax)]
        logical_JR = [[n - 1 + j - _shift(li) for n in n_R] for j, li in steps]
        J, R = len(steps), len(rids)
        pos_JR = torch.tensor([[n - 1 + j for n in n_R] for j, _ in steps], dtype=torch.long).view(J, R)
        slot_JR = torch.tensor([[s for rid, p in zip(rids, row) for s in self._slots(rid, [p])] for row in logical_JR],
                               dtype=torch.long).view(J, R)
        kv_lens_JR = (torch.tensor(logical_JR, dtype=torch.int32) + 1).view(J, R)
        return self._chain(out_RH, pos_JR, slot_JR, kv_lens_JR, table_RW)

    def _commit(self, live, n_R: list[int], table_RW: torch.Tensor) -> torch.Tensor:
        """Every MTP layer on each request's verified rows (x_{p+1}, h_p) from its first position
        not cached (at least its last, n - 1) on, their keys and values written into its pages;
        returns layer 0's output at each request's position n - 1 [R, H]."""
        dev = self.params.layers[0].enorm.device
        firsts = [min(self.cached_len(rid), n - 1) for (_, rid, _, _), n in zip(live, n_R)]
        counts = [n - c for c, n in zip(firsts, n_R)]
        pos_T = torch.cat([torch.arange(c, n) for c, n in zip(firsts, n_R)]).to(dev)
        tok_T = torch.tensor([t for (_, _, tokens, _), c, n in zip(live, firsts, n_R) for t in tokens[c + 1:n + 1]],
                             device=dev)
        h_TH = torch.cat([self._seqs[rid].hidden[c:n] for (_, rid, _, _), c, n in zip(live, firsts, n_R)])
        slot_T = torch.tensor([s for (_, rid, _, _), c, n in zip(live, firsts, n_R)
                               for s in self._slots(rid, range(c, n))], device=dev)
        cu_q_R1 = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(dev)
        kv_lens_R = torch.tensor(n_R, dtype=torch.int32, device=dev)
        table_RW, pool = table_RW.to(dev), self.cache.full
        for li, layer in enumerate(self.params.layers):
            y_TH = mtp_rows(layer, self.mcfg, self.target, pool.k[li], pool.v[li], tok_T, h_TH, pos_T, slot_T,
                            table_RW, cu_q_R1, kv_lens_R, self.mcfg.window(0), max_q_len=max(counts))
            if li == 0:
                out_RH = y_TH[cu_q_R1[1:].long() - 1]
        self.cache, self.pages = advance(self.cache, self.pages, {
            rid: n - self.cached_len(rid) for (_, rid, _, _), n in zip(live, n_R)})
        return out_RH

    def _chain(self, out_RH, pos_JR, slot_JR, kv_lens_JR, table_RW) -> tuple[torch.Tensor, torch.Tensor | None]:
        """mtp_step.mtp_chain on these inputs (host tensors but out_RH): the drafts [R, kmax] and,
        under a cut, their probabilities, on CUDA from a CUDA graph per (padded R, steps, table
        width). Padding requests repeat request 0: the same keys and values to the same slots, the
        same reads; dropped."""
        pool, dev = self.cache.full, out_RH.device

        def chain(*inputs):
            return mtp_chain(self.params.layers, self.mcfg, self.target, pool.k, pool.v, *inputs, self.windows,
                             probs=self.min_confidence > 0)

        if not (self._graphs.enabled and out_RH.is_cuda):
            return chain(out_RH, *(x.to(dev) for x in (pos_JR, slot_JR, kv_lens_JR, table_RW)))
        R, width = out_RH.shape[0], max(MIN_TABLE_WIDTH, 1 << (table_RW.shape[1] - 1).bit_length())
        pad = batch_bucket(R) - R
        table = torch.full((R, width), -1, dtype=torch.int32)
        table[:, :table_RW.shape[1]] = table_RW
        inputs = [torch.cat([x, x[:1].expand(pad, *x.shape[1:])]) for x in (out_RH, table)]
        per_step = [torch.cat([x, x[:, :1].expand(x.shape[0], pad)], dim=1) for x in (pos_JR, slot_JR, kv_lens_JR)]
        key = ("chain", R + pad, pos_JR.shape[0], width, self.min_confidence > 0)  # probs or not
        drafts, probs = self._graphs.run(key, [inputs[0], *per_step, inputs[1]], chain, dev)
        return drafts[:R], None if probs is None else probs[:R]


def _shift(li: int) -> int:
    """How many slots before its position a chain step's keys sit in MTP layer li: the chain
    reaches layer li >= 1 at step li, so its positions n .. n + li - 2 hold no keys of li (the
    steps before ran other layers); li's keys close up over them."""
    return max(li - 1, 0)


def lm_head_input(x_TH: torch.Tensor, target: Params, cfg: ModelConfig) -> torch.Tensor:
    """The target's residual stream after its last layer, through its final norm (what its LM
    head multiplies, lm_head(x) = linear(lm_head_input(x), lm_head))."""
    return rms_norm(x_TH, target.norm, cfg.rms_norm_eps)
