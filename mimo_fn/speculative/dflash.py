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
Each layer's context keys and values are cached, so a step projects only the tokens verified
since the step before. `draft_logits` drafts one sequence the plain way (the reference);
`DFlashProposer` drafts every sequence of a step at once (`draft_logits_batched`): one set of
projections, MLP and LM head GEMMs for all of them. Its cache is paged through mimo_fn.cache,
the target's allocator: a KVCache of its own (init_context_cache: pages of DRAFT_PAGE_SIZE tokens,
a page tensor per draft layer, the pool doubled when it runs out, context_cache.grow), whose pages its
sequences take with cache.extend, share with their forks with cache.fork (a copy of a prompt holds
the pages its source filled, as the target's K/V does) and give back with cache.release_seq. A step
writes every sequence's new keys and values with one indexed copy per layer, and attends with
one call per layer: each of the R x B block rows is a one-query "sequence" over its own
sequence's pages, of length context + B, which is exactly the draft's mask (every block row
sees the whole context and the whole block). On CUDA that call is the Triton split-K decode
kernel (kernels/attention/decode.py), elsewhere the paged reference. On CUDA the draft's forward
is also captured in a CUDA graph per shape (the batch padded as mimo_fn.graphs pads the
target's, the page table to a power of two; mimo_fn.speculative.draft_graphs, as the MTP
proposer's chain): launching its small ops from Python took longer than running them
(docs/benchmarks.md, speculative decoding). A grown pool has new addresses,
so its graphs are captured again; `clear_graphs` drops them (Engine.release_memory does, and
frees the page pools with the target's under the "kv_cache" tag, `kv_cache_tensors`, and the
draft's weights under "weights", `weight_tensors`).

`init_dflash` makes random weights, mimo_fn.speculative.dflash_distill trains them on the target's
own greedy continuations, and `dflash_checkpoint.load_dflash` reads z-lab's layout. The forward was
checked line by line against z-lab's model code (dflash/model.py: context keys and values from
hidden_norm(fc(...)) without the layer's input norm, q/k norms per head, rotary positions over
context then block, no mask, the draft's final norm, then the target's LM head: only the rows of
the draft's vocabulary where it has one, DFlashParams.vocab, mimo_fn.speculative.draft_vocab).
"""

import math
from collections.abc import Sequence
from dataclasses import fields

import torch
import torch.nn.functional as F

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.cache import KVCache, SeqPages, advance, release_seq
from mimo_fn.cache import fork as cache_fork
from mimo_fn.config import ModelConfig
from mimo_fn.graphs import MIN_TABLE_WIDTH, batch_bucket
from mimo_fn.kernels.attention.dispatch import attention
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm
from mimo_fn.params import Params
from mimo_fn.speculative.context_cache import ensure_free, extend_growing, init_context_cache
from mimo_fn.speculative.dflash_params import DFlashConfig, DFlashParams, init_dflash  # noqa: F401 (init_dflash: re-exported)
from mimo_fn.speculative.draft_cut import check_cut, confident_drafts
from mimo_fn.speculative.draft_graphs import DraftGraphs
from mimo_fn.speculative.draft_vocab import DraftHead
from mimo_fn.speculative.proposer import Proposer


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


DRAFT_PAGE_SIZE = 16  # tokens per page of the draft's context cache


@typed
def draft_logits_batched(params: DFlashParams, dcfg: DFlashConfig, target: Params, k_pages: Sequence[Tensor],
                         v_pages: Sequence[Tensor], last_R: Int[Tensor, " R"], ctx_R: Int[Tensor, " R"],
                         table_RW: Int[Tensor, "R W"], rows: int) -> Float[Tensor, "R J V"]:
    """`draft_logits` for R sequences at once, the logits of block positions 1 .. rows (J = rows).

    k_pages / v_pages: the page pool of each draft layer, [pages, S, G, D] (the context cache's
    full pool). Sequence r's context, its ctx_R[r] tokens, sits in the pages of table_RW's row r
    (-1 padded); its block [last_R[r], mask, ...] takes positions ctx .. ctx + B - 1 in pages
    the caller reserved, where the block's keys and values go: scratch past the context, which
    the next `observe` overwrites. Each of the P = R*B block rows (sequence-major) is a
    one-query sequence of length ctx + B over its sequence's pages; their positions, slots,
    tables and lengths are derived here, on the device (a step sends three small tensors).
    """
    D, N, G, B, S = dcfg.head_dim, dcfg.num_heads, dcfg.num_kv_heads, dcfg.block_size, k_pages[0].shape[1]
    R, dev = table_RW.shape[0], last_R.device
    eps, theta = dcfg.rms_norm_eps, dcfg.rope_theta
    tokens_RB = torch.cat([last_R[:, None], last_R.new_full((R, B - 1), dcfg.mask_token_id)], dim=1)
    pos_RB = ctx_R[:, None] + torch.arange(B, device=dev)
    pos_P = pos_RB.flatten()
    slot_P = (table_RW.gather(1, pos_RB // S).long() * S + pos_RB % S).flatten()
    # a row per block row (contiguous copies: with R = 1 a reshape would be a stride-0 view)
    table_PW = table_RW.repeat_interleave(B, dim=0)
    kv_lens_P = (ctx_R + B).to(torch.int32).repeat_interleave(B)
    cu_q_P1 = torch.arange(R * B + 1, dtype=torch.int32, device=dev)  # one query per row
    x_PH = target.embed[tokens_RB.flatten()].to(params.fc.dtype)
    for li, layer in enumerate(params.layers):
        h_PH = rms_norm(x_PH, layer.attn_norm, eps)
        q_PND = _rope(_norm_heads(_heads(linear(h_PH, layer.wq), D), layer.q_norm, eps), pos_P, theta)
        k_PGD = _rope(_norm_heads(_heads(linear(h_PH, layer.wk), D), layer.k_norm, eps), pos_P, theta)
        k_pages[li].view(-1, G, D)[slot_P] = k_PGD
        v_pages[li].view(-1, G, D)[slot_P] = _heads(linear(h_PH, layer.wv), D)
        # no mask: each row reads its sequence's context and the whole block (kv_lens_P)
        o_PND = attention(q_PND, k_pages[li], v_pages[li], table_PW, cu_q_P1, kv_lens_P, D ** -0.5, max_q_len=1)
        x_PH = x_PH + linear(o_PND.reshape(R * B, N * D), layer.wo)
        h_PH = rms_norm(x_PH, layer.mlp_norm, eps)
        x_PH = x_PH + linear(F.silu(linear(h_PH, layer.w_gate)) * linear(h_PH, layer.w_up), layer.w_down)
    x_RJH = x_PH.view(R, B, -1)[:, 1:1 + rows]
    return linear(rms_norm(x_RJH.reshape(R * rows, -1), params.norm, eps).to(target.embed.dtype),
                  target.lm_head).view(R, rows, -1)


def _pad_rows(x: torch.Tensor, copies: int, rows: int) -> torch.Tensor:
    """x with `copies` more copies of its first `rows` rows appended (a padded batch's rows)."""
    return torch.cat([x, x[:rows].repeat(copies, *(1,) * (x.dim() - 1))]) if copies else x


class DFlashProposer(Proposer):
    """Engine proposer (EngineConfig.proposer) backed by a DFlash draft model.

    The engine hands it the target's hidden states at `target_layers` for every token whose
    KV it keeps (`observe_many` after a prompt chunk, `observe_verified` after a verify step:
    every fed row and how many stay, written already by `observe_fed` during the step), asks
    for each step's drafts of all sequences at once (`propose_many`), and `forget`s a sequence
    when it ends. `observe` / `propose` are the one-sequence forms of the protocol
    (mimo_fn.speculative.proposer). min_confidence > 0: a confidence cut (speculative.draft_cut):
    each request's drafts are verified only while the draft's own estimate that all of them are
    right stays >= min_confidence.
    """

    has_graphs = True

    def __init__(self, params: DFlashParams, dcfg: DFlashConfig, target: Params, cfg: ModelConfig,
                 cuda_graphs: bool = True, min_confidence: float = 0.0):
        self.min_confidence = check_cut(min_confidence, "DFlashProposer")
        dcfg.check(cfg)
        if params.fc.shape != (cfg.hidden_size, len(dcfg.target_layers) * cfg.hidden_size):
            raise ValueError(f"DFlashProposer: fc is {list(params.fc.shape)}, expected "
                             f"{[cfg.hidden_size, len(dcfg.target_layers) * cfg.hidden_size]} for these target_layers")
        self.params, self.dcfg, self.target = params, dcfg, target
        self.head = DraftHead(target, params.vocab)  # what the draft reads of the target: its LM head's rows
        self.target_layers = dcfg.target_layers
        # the context cache: keys and values [pages, DRAFT_PAGE_SIZE, G, D] per draft layer, in its
        # full pool; no pages until the first observe, doubled when it runs out (the pages copied
        # over, so page ids stay)
        self.cache: KVCache = init_context_cache(len(params.layers), DRAFT_PAGE_SIZE, dcfg.num_kv_heads,
                                                 dcfg.head_dim, params.fc.dtype, params.fc.device)
        # rid -> its pages (room for the next block included) and observed tokens (its length)
        self.seqs: dict[int, SeqPages] = {}
        # CUDA graphs of the draft forward and the context writes, by (kind, padded R, ...)
        self._graphs = DraftGraphs("DFlashProposer", cuda_graphs)
        self._fed = None  # what observe_fed wrote (_fed_key), for the observe_verified after it

    @property
    def cuda_graphs(self) -> bool:
        """Whether the draft replays CUDA graphs on CUDA (False once a capture failed)."""
        return self._graphs.enabled

    def context_len(self, rid: int) -> int:
        seq = self.seqs.get(rid)
        return 0 if seq is None else seq.length

    def _slots(self, rid: int, start: int, stop: int) -> torch.Tensor:
        """int64 [stop - start] flat slots (page * S + offset) of positions start .. stop - 1 of rid (host)."""
        pages, S = self.seqs[rid].full, DRAFT_PAGE_SIZE
        if stop - start <= 64:  # a step's few rows: a loop, not a tensor of every page and three ops
            return torch.tensor([pages[p // S] * S + p % S for p in range(start, stop)], dtype=torch.long)
        pos = torch.arange(start, stop)
        return torch.tensor(pages, dtype=torch.long)[pos // S] * S + pos % S

    def _pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's flat (keys, values) [pages * S, G, D]."""
        d, pool = self.dcfg, self.cache.full
        return [(k.view(-1, d.num_kv_heads, d.head_dim), v.view(-1, d.num_kv_heads, d.head_dim))
                for k, v in zip(pool.k, pool.v)]

    def context(self, rid: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cached (keys, values) [C, G, D] of sequence rid (copies)."""
        n = self.context_len(rid)
        if n == 0:  # nothing observed: no cache to read
            return []
        slot_C = self._slots(rid, 0, n).to(self.params.fc.device)
        return [(k[slot_C], v[slot_C]) for k, v in self._pools()]

    def _room(self, pages: int) -> None:
        """At least `pages` free pages (context_cache.ensure_free)."""
        self.cache, grown = ensure_free(self.cache, pages)
        if grown:
            self.clear_graphs()  # they hold the old pool's addresses

    def _reserve(self, need: dict[int, int]) -> None:
        """Pages for need[rid] tokens of each rid (its context and what goes after it)."""
        more = {rid: n - self.context_len(rid) for rid, n in need.items()}
        self.cache, self.seqs, grown = extend_growing(self.cache, self.seqs, more)
        if grown:
            self.clear_graphs()  # they hold the old pool's addresses

    def _advance(self, kept: dict[int, int]) -> None:
        """kept[rid] more tokens of rid are its context now."""
        self.cache, self.seqs = advance(self.cache, self.seqs, kept)

    def observe(self, rid: int, hidden_TLH: torch.Tensor) -> None:
        """The target's hidden states of the sequence's next verified tokens, in order."""
        self.observe_many([(rid, hidden_TLH)])

    def observe_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """observe() for several sequences (each once): their context projections as one batch,
        written into the cache with one indexed copy per layer."""
        items = [(rid, h) for rid, h in items if h.shape[0] > 0]
        if not items:
            return
        dev, d = items[0][1].device, self.dcfg
        pos_T = torch.cat([torch.arange(self.context_len(rid), self.context_len(rid) + h.shape[0])
                           for rid, h in items]).to(dev)
        self._reserve({rid: self.context_len(rid) + h.shape[0] + d.block_size for rid, h in items})
        slot_T = torch.cat([self._slots(rid, self.context_len(rid), self.context_len(rid) + h.shape[0])
                            for rid, h in items])
        self._advance({rid: h.shape[0] for rid, h in items})
        self._write_context(torch.cat([h for _, h in items]), pos_T, slot_T.to(dev))

    def fork(self, sources, upto=None) -> None:
        """{dst: src}: new sequence dst starts with a copy of src's context, all of it or its first
        upto[dst] tokens, as the engine's copies of a prompt take its KV instead of prefilling it,
        and prompts that begin with a prefix cache entry's tokens take part of it (model.fork). As
        there (cache.fork), dst holds the pages src filled in common with it and a copy of the last,
        partly filled one: both write only past their context, so neither touches a shared page."""
        ends = {}
        for dst, src in sources.items():
            if self.context_len(dst):
                raise ValueError(f"DFlashProposer.fork: sequence {dst} holds context already")
            n = (upto or {}).get(dst, self.context_len(src))
            if n > self.context_len(src):
                raise ValueError(f"DFlashProposer.fork: sequence {src} holds {self.context_len(src)} tokens of "
                                 f"context, fewer than the {n} sequence {dst} forks")
            if n:
                ends[dst] = n
        for dst in ends:  # pages of a dst with no context (it drafted after one token) are only room
            if dst in self.seqs:
                self.cache = release_seq(self.cache, self.seqs.pop(dst))
        if ends:
            self._room(len(ends))  # cache.fork copies at most one page a copy, the last
            self.cache, self.seqs = cache_fork(self.cache, self.seqs, {dst: sources[dst] for dst in ends}, ends)

    def _write_context(self, hidden_TLH: torch.Tensor, pos_T: torch.Tensor, slot_T: torch.Tensor) -> None:
        """Project tokens' hidden states to each layer's keys and values and write them at slot_T."""
        for (k, v), (k_TGD, v_TGD) in zip(self._pools(), context_kv(self.params, self.dcfg, hidden_TLH, pos_T)):
            k[slot_T], v[slot_T] = k_TGD, v_TGD

    def observe_fed(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """observe_verified's writes queued while the verify step runs (Proposer.observe_fed)."""
        self._fed = self._write_fed(items)

    def observe_verified(self, items: Sequence[tuple[int, torch.Tensor, int]]) -> None:
        """observe() after a verify step: for each (rid, hidden_QLH of every token the step fed
        it, kept), the first `kept` rows are its next verified tokens. Every fed row is written
        (by observe_fed if it had these rows), the context advances by kept."""
        if not items:
            return
        if any(self.context_len(rid) == 0 for rid, _, _ in items):  # a sequence with no context yet
            self.observe_many([(rid, h[:kept]) for rid, h, kept in items])
            return
        rows, fed, self._fed = [(rid, h) for rid, h, _ in items], self._fed, None
        if fed is None or fed != self._fed_key(rows):
            self._write_fed(rows)
        self._advance({rid: kept for rid, _, kept in items})

    def _fed_key(self, items) -> tuple:
        return tuple((rid, self.context_len(rid), h.shape[0], h.data_ptr()) for rid, h in items)

    def _write_fed(self, items: Sequence[tuple[int, torch.Tensor]]) -> tuple | None:
        """Every sequence's fed rows projected and written after its context, Q each (the most
        any fed; a shorter feed repeats its last row), one fixed shape (on CUDA a CUDA graph):
        rows past those kept land past the context, where the next writes replace them before
        any read. Returns their _fed_key; None (nothing written) if one has no context yet."""
        if not items or any(self.context_len(rid) == 0 for rid, _ in items):
            return None
        q, R, d = max(h.shape[0] for _, h in items), len(items), self.dcfg
        self._reserve({rid: self.context_len(rid) + q + d.block_size for rid, _ in items})
        pos_T = torch.cat([torch.arange(self.context_len(rid), self.context_len(rid) + q) for rid, _ in items])
        slot_T = torch.cat([self._slots(rid, self.context_len(rid), self.context_len(rid) + q) for rid, _ in items])
        hidden_TLH = torch.cat([torch.cat([h, h[-1:].expand(q - h.shape[0], *h.shape[1:])]) for _, h in items])
        inputs = (hidden_TLH, pos_T, slot_T)
        if self.cuda_graphs and self.params.fc.is_cuda:
            Rp = batch_bucket(R)  # padding rows repeat sequence 0's: the same values to the same slots
            self._graphed(("observe", Rp, q), [_pad_rows(x, Rp - R, q) for x in inputs], self._write_context)
        else:
            self._write_context(*(x.to(self.params.fc.device) for x in inputs))
        return self._fed_key(items)

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts after `tokens`, whose last token is the only one not observed yet. The
        block is always block_size long (what the draft was trained on); the first k count."""
        return self.propose_many([(rid, tokens, k)])[0]

    def logits_many(self, requests: Sequence[tuple[int, Sequence[int], int]]) -> torch.Tensor:
        """Draft logits [R, J, Vd] of block positions 1 .. J = max k (at most block_size - 1), for
        the R requests (rid, tokens, k), each k > 0, in order, all in one batched forward (Vd:
        the draft's vocabulary, V without one; self.head.to_target maps an argmax to token ids)."""
        n, d = self.dcfg.block_size, self.dcfg
        for rid, tokens, _ in requests:
            if self.context_len(rid) != len(tokens) - 1:
                raise ValueError(f"DFlashProposer: sequence {rid} has {self.context_len(rid)} observed tokens, "
                                 f"expected {len(tokens) - 1} (all but the last of {len(tokens)})")
        ctx = [len(tokens) - 1 for _, tokens, _ in requests]
        self.head.refresh()
        self._reserve({rid: c + n for (rid, _, _), c in zip(requests, ctx)})  # the block goes after the context
        pages = [self.seqs[rid].full for rid, _, _ in requests]
        width, graphed = max(map(len, pages)), self.cuda_graphs and self.params.fc.is_cuda
        if graphed:  # a graph per power-of-two width
            width = max(MIN_TABLE_WIDTH, 1 << (width - 1).bit_length())
        args = (torch.tensor([tokens[-1] for _, tokens, _ in requests]), torch.tensor(ctx),
                self.cache.page_tables([pages], width)[0])  # last_R, ctx_R, table_RW (-1 padded)
        rows = min(max(k for *_, k in requests), n - 1)
        if not graphed:
            return draft_logits_batched(self.params, d, self.head.params, self.cache.full.k, self.cache.full.v,
                                        *(a.to(self.target.embed.device) for a in args), rows)
        # from a CUDA graph; padding sequences repeat sequence 0 (the same keys and values to the same
        # slots, the same reads), their logits dropped
        R, Rp = len(requests), batch_bucket(len(requests))
        out = self._graphed(("draft", Rp, width, rows), [_pad_rows(a, Rp - R, 1) for a in args],
                            lambda *static: draft_logits_batched(self.params, d, self.head.params, self.cache.full.k,
                                                                 self.cache.full.v, *static, rows))
        return out[:R].clone()

    def _graphed(self, key: tuple, inputs: list[torch.Tensor], fn):
        """fn(*static inputs) replayed from the CUDA graph of `key` (mimo_fn.speculative.draft_graphs)."""
        return self._graphs.run(key, inputs, fn, self.params.fc.device)

    def propose_many(self, requests: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """propose() for each (rid, tokens, k), all drafted in one batched forward."""
        out: list[list[int]] = [[] for _ in requests]
        live = [(i, (rid, tokens, min(k, self.dcfg.block_size - 1)))
                for i, (rid, tokens, k) in enumerate(requests) if k > 0]
        if not live:
            return out
        logits_RJV = self.logits_many([ask for _, ask in live])
        drafts_RJ = self.head.to_target(logits_RJV.argmax(dim=-1)).tolist()
        cut = confident_drafts(logits_RJV, self.min_confidence).tolist() if self.min_confidence else None
        for r, (i, (_, _, k)) in enumerate(live):
            out[i] = drafts_RJ[r][:k if cut is None else min(k, cut[r])]
        return out

    def propose_device(self, requests: Sequence[tuple[int, Sequence[int], int]]):
        """The drafts of `propose_many`, left on the device as [R, J] (Proposer.propose_device),
        where every request asks for the same k > 0; with a confidence cut, with how many of each
        row to verify."""
        ks = {min(k, self.dcfg.block_size - 1) for *_, k in requests}
        if len(ks) != 1 or min(ks) <= 0 or type(self).propose_many is not DFlashProposer.propose_many:
            return None  # (a subclass that drafts its own way in propose_many keeps it)
        logits_RJV = self.logits_many(requests)
        drafts_RJ = self.head.to_target(logits_RJV.argmax(dim=-1))
        return (drafts_RJ, confident_drafts(logits_RJV, self.min_confidence)) if self.min_confidence else drafts_RJ

    def clear_graphs(self) -> None:
        """Drop the draft's CUDA graphs and their memory pool (captured again on first use)."""
        self._graphs.clear()

    def weight_tensors(self) -> list[torch.Tensor]:
        """The draft's own weights (not the target's embedding and LM head it reads; its copy of
        that head's rows where it has a vocabulary): what Engine.release_memory frees under the
        "weights" tag, backed up on the host."""
        p, head = self.params, self.head
        own = [p.fc, p.hidden_norm, p.norm] + [getattr(layer, f.name) for layer in p.layers for f in fields(layer)]
        return own + ([head.vocab, head.params.lm_head] if head.vocab is not None else [])

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """The context cache's page tensors (each layer's keys, then values): what
        Engine.release_memory frees and resume_memory brings back under the "kv_cache" tag (none
        before the first observe). A ValueError while a sequence still holds pages: their context
        would be lost."""
        if self.seqs:
            raise ValueError(f"DFlashProposer: {len(self.seqs)} sequences hold draft context pages "
                             f"(e.g. request {min(self.seqs)}); forget them first")
        pool = self.cache.full
        return list(pool.k + pool.v) if pool.num_pages else []

    def forget(self, rid: int) -> None:
        self._fed = None  # (a pass that failed between observe_fed and observe_verified)
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self.cache = release_seq(self.cache, seq)
