"""The step functions: forward (the reference, no cache) and the paged steps init_state,
prefill, decode and release, all built on one decoder layer.

Legend: T tokens, H hidden, V vocab, N query heads, G kv heads, D q/k head dim,
E v head dim, K experts per token, L layers, M MoE layers.
"""

import math
from collections import Counter
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch.utils._pytree import tree_leaves

from mimo_fn import options
from mimo_fn._types import Bool, Float, Int, Tensor, typed
from mimo_fn.batch import Batch, StepMeta, step_meta
from mimo_fn.cache import DEFAULT_PAGE_SIZE, KVCache, SeqPages, advance, extend, init_cache, release_seq
from mimo_fn.cache import fork as cache_fork
from mimo_fn.cache import keep_swa as cache_keep_swa
from mimo_fn.cache import truncate as cache_truncate
from mimo_fn.config import ModelConfig
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.layers.attention import attend_dense, attend_paged, project_out, project_qkv
from mimo_fn.layers.linear import linear
from mimo_fn.layers.mlp import dense_mlp
from mimo_fn.layers.moe import moe
from mimo_fn.layers.norm import add_rms_norm, rms_norm, rms_norm_quantized
from mimo_fn.parallel.dp_attention import gather_tokens, local_rows, num_valid_rows, scatter_tokens
from mimo_fn.parallel.ep_gather import gather_rows
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.params import DenseMLP, Layer, Params

# attention between the projections: (layer index, q_TND, k_TGD, v_TGE) -> o_TNE
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@typed
def decoder_layer(
    x_tH: Float[Tensor, "t H"], layer: Layer, cfg: ModelConfig, i: int, pos_T: Int[Tensor, " T"], attn_fn: AttnFn,
    mesh: Mesh | None = None, ep_rows: int | None = None, routed_tK: Int[Tensor, "t K"] | None = None,
    deterministic: bool = False, moe_rows_t: Bool[Tensor, " t"] | None = None,
) -> tuple[Float[Tensor, "t H"], Int[Tensor, "t K"] | None]:
    """One pre-norm decoder layer over this rank's rows x_tH of the step's T tokens (all of them
    on one rank). Returns the new residual rows and the routed expert ids [t, K] (None on a
    dense layer). With a mesh, collectives happen here, in plain sight: the TP all-gather before
    attention, the reduce-scatter after it, and the EP dispatch/combine inside `moe` (ep_rows:
    as there). routed_tK: routing replay on a MoE layer (moe's routed_TK). deterministic: the
    layers' kernels whose tiling no token count changes (attn_fn brings its own; the RMSNorm
    kernel is one row a program already, so it is batch-invariant either way). moe_rows_t: the
    rows a MoE layer routes (moe's rows_T; Batch.moe_rows_T)."""
    mesh = mesh or Mesh.single()
    det = deterministic
    num_tokens = pos_T.shape[0]
    attn = layer.attn
    if mesh.tp == 1:  # no gather: the norm and the q / k / v linears' FP8 quantisation in one kernel
        h_TH = rms_norm_quantized(x_tH, layer.attn_norm, cfg.rms_norm_eps, (attn.wq, attn.wk, attn.wv), det)
    else:
        h_TH = gather_tokens(rms_norm(x_tH, layer.attn_norm, cfg.rms_norm_eps), mesh, num_tokens, fp8=True)
    q_TND, k_TGD, v_TGE = project_qkv(h_TH, attn, cfg, i, pos_T, det)
    o_TH = project_out(attn_fn(i, q_TND, k_TGD, v_TGE), attn, det)  # partial sum over this rank's heads
    x_tH, h_tH = add_rms_norm(x_tH, scatter_tokens(o_TH, mesh), layer.mlp_norm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, DenseMLP):  # replicated: each rank runs its own rows
        return x_tH + dense_mlp(h_tH, layer.mlp, det), None
    # x_tH + the block's output: the add rides in the experts' sum over k (moe's residual_TH)
    return moe(h_tH, layer.mlp, cfg, mesh, num_valid_rows(num_tokens, mesh), ep_rows, routed_tK, det,
               residual_TH=x_tH, rows_T=moe_rows_t)


def _ranged_layer(x_tH, layer: Layer, cfg: ModelConfig, i: int, *args, **kwargs):
    """decoder_layer inside a torch.profiler range "layer{i}" (options.layer_ranges)."""
    with torch.profiler.record_function(f"layer{i}"):
        return decoder_layer(x_tH, layer, cfg, i, *args, **kwargs)


@typed
def lm_head(x_TH: Float[Tensor, "T H"], params: Params, cfg: ModelConfig,
            deterministic: bool = False) -> Float[Tensor, "T V"]:
    return linear(rms_norm(x_TH, params.norm, cfg.rms_norm_eps), params.lm_head, deterministic=deterministic)


def check_deterministic(value, where: str) -> bool:
    """`value` as the deterministic flag; a ValueError naming `where` unless it is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: deterministic = {value!r}; expected True or False")
    return value


@typed
def check_tokens(tokens: Int[Tensor, "*T"], cfg: ModelConfig, what: str = "tokens") -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= cfg.vocab_size)][0].item()
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")


def _is_int_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not (
        t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _described(t) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def check_routed_experts(routed_TMK, cfg: ModelConfig, num_tokens: int) -> None:
    """A ValueError unless routed_TMK is routing to replay for num_tokens tokens: integer expert
    ids [T, MoE layers, top_k] in [0, num_experts), no expert twice for one token and layer."""
    want = (num_tokens, sum(cfg.is_moe(i) for i in range(cfg.num_layers)), cfg.top_k)
    if not _is_int_tensor(routed_TMK) or tuple(routed_TMK.shape) != want:
        raise ValueError(f"forward: routed_experts is {_described(routed_TMK)}; expected an integer tensor of shape "
                         f"[tokens, MoE layers, top_k] = {list(want)}")
    if routed_TMK.numel() and (int(routed_TMK.min()) < 0 or int(routed_TMK.max()) >= cfg.num_experts):
        bad = routed_TMK[(routed_TMK < 0) | (routed_TMK >= cfg.num_experts)][0].item()
        raise ValueError(f"forward: routed_experts holds expert id {bad}, outside [0, num_experts = {cfg.num_experts})")
    twice_TM = (routed_TMK.sort(-1).values.diff(dim=-1) == 0).any(-1)
    if twice_TM.any():
        t, m = twice_TM.nonzero()[0].tolist()
        raise ValueError(f"forward: routed_experts names an expert twice for token {t} in MoE layer {m}: "
                         f"{routed_TMK[t, m].tolist()}")


def forward(params: Params, cfg: ModelConfig, tokens_T: Int[Tensor, " T"],
            routed_experts: Int[Tensor, "T M K"] | None = None, deterministic: bool = False) -> Float[Tensor, "T V"]:
    """Logits of one sequence at positions 0..T-1, with no cache: the reference path. The
    tokens may live on any device: they move to the weights' (as prefill's do).
    routed_experts: routing replay (RL), the experts each token goes to in each MoE layer, as
    the engine returns them (Output.routed_experts, for the tokens it fed: prompt and output
    but the last); their gate weights come from this forward's routers, so a loss on the
    logits reaches the routers too. None: each router picks its own top-k.
    deterministic: the kernels of an engine with EngineConfig(deterministic=True), so each row's
    logits are the bits that engine gives the same token at the same position (docs/deterministic.md).
    On CUDA the kernels have no backward: call it under torch.no_grad() (a scoring pass)."""
    # checked here, before the shape check of _forward, so that a user gets a ValueError either way
    if not _is_int_tensor(tokens_T) or tokens_T.dim() != 1:
        raise ValueError(f"forward: tokens is {_described(tokens_T)}; expected a 1-D integer tensor of token ids")
    check_deterministic(deterministic, "forward")
    if deterministic and params.embed.is_cuda and torch.is_grad_enabled() and any(
            t.requires_grad for t in tree_leaves(params) if isinstance(t, torch.Tensor)):
        raise ValueError("forward: deterministic=True runs the engine's kernels, which have no backward, and these "
                         "params require grad; score under torch.no_grad(), or pass deterministic=False to train")
    if routed_experts is not None:
        check_routed_experts(routed_experts, cfg, tokens_T.shape[0])
    return _forward(params, cfg, tokens_T, routed_experts, deterministic)


@typed
def _forward(params: Params, cfg: ModelConfig, tokens_T: Int[Tensor, " T"],
             routed_TMK: Int[Tensor, "T M K"] | None = None, deterministic: bool = False) -> Float[Tensor, "T V"]:
    check_tokens(tokens_T, cfg)
    if tokens_T.shape[0] > cfg.max_position_embeddings:
        raise ValueError(f"forward: {tokens_T.shape[0]} tokens, past max_position_embeddings = "
                         f"{cfg.max_position_embeddings}")
    tokens_T = tokens_T.to(params.embed.device)
    pos_T = torch.arange(tokens_T.shape[0], device=tokens_T.device)

    def attn_fn(i: int, q_TND, k_TGD, v_TGE):
        return attend_dense(q_TND, k_TGD, v_TGE, pos_T, cfg, i, params.layers[i].attn.sinks, deterministic)

    x_TH = params.embed[tokens_T]
    moe_slot = {layer: m for m, layer in enumerate(i for i in range(cfg.num_layers) if cfg.is_moe(i))}
    for i, layer in enumerate(params.layers):
        routed_TK = None if routed_TMK is None or i not in moe_slot else routed_TMK[:, moe_slot[i]]
        x_TH, _ = decoder_layer(x_TH, layer, cfg, i, pos_T, attn_fn, routed_tK=routed_TK, deterministic=deterministic)
    return lm_head(x_TH, params, cfg, deterministic)


# ---------------------------------------------------------------------------------------------
# Paged steps: init_state, prefill, decode, release
# ---------------------------------------------------------------------------------------------


class StaleStateError(RuntimeError):
    """A state whose cache was donated to a step function was used again."""


class _Lease:
    """Liveness of one EngineState: cleared when a step consumes (donates) the state."""

    __slots__ = ("live",)

    def __init__(self) -> None:
        self.live = True


@dataclass(frozen=True)
class EngineState:
    cfg: ModelConfig
    params: Params
    cache: KVCache
    seqs: Mapping[int, SeqPages]  # sequences with pages, by id
    mesh: Mesh = field(default_factory=Mesh.single)  # this rank's place in the DP / TP / EP layout
    # every step runs kernels whose tiling and reduction order follow the model's fixed dims, never
    # the batch: a sequence's logits are the same bits whatever shares its steps (init_state)
    deterministic: bool = False
    lease: _Lease = field(default_factory=_Lease, compare=False, repr=False)

    def _consume(self) -> None:
        if not self.lease.live:
            raise StaleStateError("this EngineState was donated to an earlier prefill/decode/release; "
                                  "use the state that call returned")
        self.lease.live = False


@dataclass(frozen=True)
class StepOutput:
    logits_BV: torch.Tensor  # [B, V] logits of each sequence's last token, batch order
    logits_TV: torch.Tensor | None = None  # [T, V] every token's logits, when asked for
    routed_experts_TLK: torch.Tensor | None = None  # [T, L_moe, K] int32 expert ids, when asked for
    hidden_TLH: torch.Tensor | None = None  # [T, L, H] residual stream after each asked-for layer


@typed
def init_state(
    cfg: ModelConfig, params: Params, max_tokens: int, page_size: int = DEFAULT_PAGE_SIZE,
    max_swa_tokens: int | None = None, dtype: torch.dtype | None = None, mesh: Mesh | None = None,
    swa_slack: int = 0, deterministic: bool = False,
) -> EngineState:
    """A state with an empty cache: room for max_tokens in the full-attention pool and
    max_swa_tokens (default: max_tokens) in the sliding-window pool. With a mesh, `params`
    are this rank's shards and the cache holds this rank's KV heads only. swa_slack: how
    many tokens `truncate` may take back (sliding-window pages are kept that much longer).
    deterministic: EngineState.deterministic, for every step of this state and its successors."""
    check_deterministic(deterministic, "init_state")
    for name, value in (("max_tokens", max_tokens), ("page_size", page_size), ("max_swa_tokens", max_swa_tokens)):
        if (value is not None or name != "max_swa_tokens") and (
                not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"init_state: {name} = {value!r}, expected a positive int")
    full_pages = math.ceil(max_tokens / page_size)
    swa_pages = math.ceil((max_swa_tokens or max_tokens) / page_size)
    dtype = dtype or params.embed.dtype
    mesh = mesh or Mesh.single()
    mesh.validate(cfg)
    cache = init_cache(cfg, full_pages, swa_pages, page_size, dtype, params.embed.device, tp=mesh.tp,
                       swa_slack=swa_slack)
    return EngineState(cfg, params, cache, {}, mesh, deterministic)


def _paged_attn_fn(state: EngineState, cache: KVCache, meta: StepMeta) -> AttnFn:
    def attn_fn(i: int, q_TND, k_TGD, v_TGE):
        return attend_paged(q_TND, k_TGD, v_TGE, cache, meta, state.cfg, i, state.params.layers[i].attn.sinks,
                            state.deterministic)

    return attn_fn


def _run_layers(state: EngineState, batch: Batch, cache: KVCache, meta: StepMeta, all_logits: bool,
                capture_experts: bool, capture_hidden: Sequence[int] = (), ep_rows: int | None = None) -> StepOutput:
    """The step's forward. ep_rows: the rows each EP rank contributes to a "gather" dispatch,
    agreed by the caller (DecodeGraphs); None: agreed here, once for every layer."""
    cfg, mesh, det = state.cfg, state.mesh, state.deterministic
    device = state.params.embed.device
    attn_fn = _paged_attn_fn(state, cache, meta)
    num_tokens = batch.num_tokens
    x_tH = local_rows(state.params.embed[batch.tokens_T.to(device)], mesh)
    if ep_rows is None and mesh.ep > 1 and mesh.ep_dispatch == "gather":
        ep_rows = gather_rows(x_tH.shape[0], mesh, device)
    routed, hidden = [], {}
    # read once a step: with the ranges off the loop is the plain one
    run_layer = _ranged_layer if options.current().layer_ranges else decoder_layer
    # a row mask needs every row on this rank and no dispatch (elsewhere all rows are routed)
    rows_t = batch.moe_rows_T if mesh.tp == 1 and mesh.ep == 1 else None
    for i, layer in enumerate(state.params.layers):
        x_tH, ids_tK = run_layer(x_tH, layer, cfg, i, meta.pos_T, attn_fn, mesh, ep_rows, deterministic=det,
                                 moe_rows_t=rows_t)
        if capture_experts and ids_tK is not None:
            routed.append(gather_tokens(ids_tK.to(torch.int32), mesh, num_tokens))
        if i in capture_hidden:
            hidden[i] = gather_tokens(x_tH, mesh, num_tokens)
    x_TH = gather_tokens(x_tH, mesh, num_tokens)
    last_B = meta.cu_q_B1[1:].long() - 1
    if all_logits:
        logits_TV = lm_head(x_TH, state.params, cfg, det)
        out = StepOutput(logits_TV[last_B], logits_TV)
    else:
        out = StepOutput(lm_head(x_TH[last_B], state.params, cfg, det))
    if capture_experts:
        out = replace(out, routed_experts_TLK=torch.stack(routed, dim=1) if routed else None)
    if capture_hidden:
        out = replace(out, hidden_TLH=torch.stack([hidden[i] for i in capture_hidden], dim=1))
    return out


@typed
def prefill(
    state: EngineState, batch: Batch, *, all_logits: bool = False, capture_experts: bool = False,
    capture_hidden: Sequence[int] = (), graphs: DecodeGraphs | None = None,
) -> tuple[EngineState, StepOutput]:
    """Run the next chunk of each sequence in `batch` (a new id starts a sequence, a known id
    continues it) and return the new state and the last-token logits. Donates `state`.
    capture_hidden: layer indices whose output (the residual stream) comes back for every
    token, as StepOutput.hidden_TLH (a DFlash draft model reads them). graphs: replay the
    forward from CUDA graphs (mimo_fn.graphs) where the step's shape allows (every sequence
    the same few tokens: decode and speculative verify steps); None: run it eagerly.

    With a mesh, every TP rank of a DP group passes the same batch, and a DP group with
    nothing to do passes an empty batch: it still joins every collective (a zero-token step).
    """
    cfg, mesh = state.cfg, state.mesh
    run_layers = _run_layers if graphs is None else partial(graphs.run, _run_layers)
    if not state.lease.live:
        state._consume()  # raises StaleStateError
    if not batch.sampled:
        check_tokens(batch.tokens_T, cfg, "prefill batch")
    bad = [i for i in capture_hidden if not 0 <= i < cfg.num_layers]
    if bad:
        raise ValueError(f"prefill: capture_hidden layer {bad[0]} is not in [0, {cfg.num_layers})")
    if not batch.seq_ids and mesh.world == 1:
        raise ValueError("prefill: empty batch (only a multi-rank mesh runs zero-token steps)")
    new_tokens = dict(zip(batch.seq_ids, batch.lens))
    longest = next((s for s, n in new_tokens.items()
                    if n + (state.seqs[s].length if s in state.seqs else 0) > cfg.max_position_embeddings), None)
    if longest is not None:
        have = state.seqs[longest].length if longest in state.seqs else 0
        raise ValueError(f"prefill: sequence {longest} would reach {have + new_tokens[longest]} tokens ({have} in "
                         f"cache + {new_tokens[longest]} new), past max_position_embeddings = "
                         f"{cfg.max_position_embeddings}")
    cache, seqs = extend(state.cache, dict(state.seqs), new_tokens)  # OutOfPages leaves state intact
    meta = step_meta(batch, dict(state.seqs), seqs, cache, state.params.embed.device)
    state._consume()
    try:
        out = run_layers(state, batch, cache, meta, all_logits, capture_experts, tuple(capture_hidden))
    except BaseException:
        # The step wrote K/V only into slots the old state never reads (its free pages and the
        # unused tail of its last pages), so the old state is still whole: hand it back.
        state.lease.live = True
        raise
    cache, seqs = advance(cache, seqs, new_tokens)
    return replace(state, cache=cache, seqs=seqs, lease=_Lease()), out


@typed
def decode(
    state: EngineState, batch: Batch, *, all_logits: bool = False, capture_experts: bool = False,
    capture_hidden: Sequence[int] = (), graphs: DecodeGraphs | None = None,
) -> tuple[EngineState, StepOutput]:
    """One token for each of the batch's (existing) sequences. Donates `state`. graphs: as in
    prefill."""
    unknown = [s for s in batch.seq_ids if s not in state.seqs]
    if unknown:
        raise ValueError(f"decode: sequences {unknown} have no cache; prefill them first")
    if any(n != 1 for n in batch.lens):
        raise ValueError(f"decode: expected one token per sequence, got chunk lengths {list(batch.lens)}")
    return prefill(state, batch, all_logits=all_logits, capture_experts=capture_experts,
                   capture_hidden=capture_hidden, graphs=graphs)


@typed
def truncate(state: EngineState, lengths: Mapping[int, int]) -> EngineState:
    """Take sequences back to shorter lengths, {seq id: tokens to keep}: the tokens past them
    are forgotten, as if never prefilled (speculative decoding drops rejected drafts this
    way). Sliding-window layers allow going back by up to init_state's swa_slack tokens.
    Donates `state`; a ValueError changes nothing."""
    unknown = [s for s in lengths if s not in state.seqs]
    if unknown:
        raise ValueError(f"truncate: unknown sequence ids {unknown}; live ones are {sorted(state.seqs)}")
    if not state.lease.live:
        state._consume()  # raises StaleStateError
    cache, seqs = cache_truncate(state.cache, dict(state.seqs), dict(lengths))
    state._consume()
    return replace(state, cache=cache, seqs=seqs, lease=_Lease())


@typed
def fork(state: EngineState, sources: Mapping[int, int], upto: Mapping[int, int] | None = None) -> EngineState:
    """{dst: src}: sequence dst, whose tokens so far are a prefix of src's (none for a new id),
    takes src's K/V for the rest, as if it had prefilled src's tokens itself; no model runs. It
    holds the full-attention pages src has filled in common with src and copies the rest
    (cache.fork). upto[dst]: take src's first upto[dst] tokens only, a point whose sliding-window
    pages src still holds (a prefix cache entry's, by a prompt that shares only some of it).
    The caller vouches for the tokens: the engine forks identical prompts, prefilled once.
    Donates `state`; a ValueError or OutOfPages changes nothing."""
    upto = dict(upto or {})
    for dst, src in sources.items():
        if src not in state.seqs or src in sources or dst == src:
            raise ValueError(f"fork: sequence {dst} cannot copy {src}: the source must be a live sequence "
                             f"that is not itself forked in this call (live: {sorted(state.seqs)})")
        end = upto.get(dst, state.seqs[src].length)
        if not 0 <= end <= state.seqs[src].length:
            raise ValueError(f"fork: sequence {dst} cannot take the first {end} tokens of {src}, which has "
                             f"{state.seqs[src].length}")
        if dst in state.seqs and state.seqs[dst].length > end:
            raise ValueError(f"fork: sequence {dst} ({state.seqs[dst].length} tokens) is longer than " + (
                f"its source {src} ({end})" if dst not in upto else f"the {end} tokens of {src} it takes"))
    if not state.lease.live:
        state._consume()  # raises StaleStateError
    cache, seqs = cache_fork(state.cache, dict(state.seqs), dict(sources), upto)  # errors leave state intact
    state._consume()
    return replace(state, cache=cache, seqs=seqs, lease=_Lease())


def renew(state: EngineState) -> EngineState:
    """The same state under a new handle, after its buffers changed outside the step functions
    (mimo_fn.rl: memory released or resumed); the old handle raises StaleStateError from then on,
    as a donated state does."""
    state._consume()
    return replace(state, lease=_Lease())


@typed
def keep_swa(state: EngineState, points: Mapping[int, int]) -> EngineState:
    """{seq id: n}: the sequence keeps the sliding-window K/V that a fork of its first n tokens
    reads after it falls behind the window (cache.keep_swa), so that `fork(..., upto)` can take
    that point later. Donates `state`; a ValueError changes nothing."""
    unknown = [s for s in points if s not in state.seqs]
    if unknown:
        raise ValueError(f"keep_swa: unknown sequence ids {unknown}; live ones are {sorted(state.seqs)}")
    if not state.lease.live:
        state._consume()  # raises StaleStateError
    seqs = cache_keep_swa(state.cache, dict(state.seqs), dict(points))
    state._consume()
    return replace(state, seqs=seqs, lease=_Lease())


@typed
def release(state: EngineState, seq_ids: Sequence[int]) -> EngineState:
    """Free every page of the given sequences. Donates `state`."""
    unknown = [s for s in seq_ids if s not in state.seqs]
    if unknown:
        raise ValueError(f"release: unknown sequence ids {unknown}; live ones are {sorted(state.seqs)}")
    if len(set(seq_ids)) != len(seq_ids):  # checked before donating: the state stays valid
        repeated = sorted(s for s, n in Counter(seq_ids).items() if n > 1)
        raise ValueError(f"release: sequence ids {repeated} repeat; list each sequence once")
    state._consume()
    cache, seqs = state.cache, dict(state.seqs)
    for s in seq_ids:
        cache = release_seq(cache, seqs.pop(s))
    return replace(state, cache=cache, seqs=seqs, lease=_Lease())
