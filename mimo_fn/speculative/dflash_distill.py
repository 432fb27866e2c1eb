"""Training a DFlash draft by self-distillation: the data, the training forward, the loop.

The data are the target's own greedy continuations of prompts, with the target's hidden states
at the draft's target_layers for every token (`greedy_data`). A training example is an anchor
position a in a sequence's generated part: the draft reads the hidden states of tokens 0 .. a-1
(its context, as DFlashProposer reads a request's verified tokens), predicts the block
[token a, mask x (B-1)] at positions a .. a+B-1 in one non-causal forward, and is scored against
the target's greedy tokens a+1 .. a+B-1 (`block_logits`, `block_loss`). Block position k is
weighted exp(-(k-1) / gamma): a draft is accepted only up to its first miss, so the early
positions decide the acceptance length (DFlash's recipe; gamma 0 weighs all alike).
A draft with its own vocabulary (DFlashParams.vocab, mimo_fn.speculative.draft_vocab) is scored
on those rows of the LM head alone; a label outside it counts nothing.
`block_logits` computes, for every anchor of a batch at once, what `dflash.draft_logits` computes
for one block (tests/test_train_dflash.py checks it does). `train` runs AdamW over random
batches of anchors and measures, every so often, the mean acceptance length that the real
Engine gets with the draft on held-out prompts (`accept_length`: Engine.spec_stats()).

Legend: S sequences, T / C tokens of a sequence (C as context), A anchors a sequence, B block
size, J = B - 1 drafts, L target layers read, H hidden, N / G / D draft query heads, KV heads and
head dim, R query heads per KV head, V vocab.
"""

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.batch import Batch
from mimo_fn.config import ModelConfig
from mimo_fn.engine import Engine, EngineConfig
from mimo_fn.layers.linear import linear
from mimo_fn.layers.norm import rms_norm_ref
from mimo_fn.model import init_state, prefill
from mimo_fn.params import Params
from mimo_fn.quant import QTensor, dequantize
from mimo_fn.speculative.dflash import DFlashConfig, DFlashParams, DFlashProposer, _heads, _rope
from mimo_fn.speculative.draft_vocab import head_rows, to_draft_ids


@dataclass(frozen=True)
class GreedyData:
    """Sequences the target continued greedily: prompt + continuation, and the target's hidden
    states at the draft's layers for each of their tokens."""

    tokens: list[torch.Tensor]  # int64 [T] per sequence (host)
    hidden: list[torch.Tensor]  # [T, L, H] per sequence (the target's dtype; its device, or pinned host memory)
    prompt_lens: list[int]

    @cached_property
    def by_length(self) -> dict[int, list[int]]:
        """Sequence indices by length, shortest first (a training batch takes sequences of one length)."""
        out: dict[int, list[int]] = {}
        for i, t in enumerate(self.tokens):
            out.setdefault(len(t), []).append(i)
        return dict(sorted(out.items()))


def greedy_data(cfg: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], new_tokens: int,
                layers: Sequence[int], page_size: int = 16, batch_tokens: int = 16384,
                on_host: bool = False, decode_batch: int = 256) -> GreedyData:
    """The target's greedy continuations of `prompts` (new_tokens each, no stop tokens) through
    Engine.generate, decode_batch sequences at a time at most (its max_batch: a decode step at the
    released dims reads every expert from a few dozen sequences on, so more of them a step cost
    little more), then one prefill per group of sequences (about batch_tokens tokens) that
    captures their hidden states at `layers`. on_host: keep those in pinned host memory (L x H
    values a token: 24 KB at the released dims, 51 GB for 16K sequences of 128 tokens), from
    where each training step copies its batch to the GPU."""
    if decode_batch < 1:
        raise ValueError(f"greedy_data: decode_batch {decode_batch}, expected >= 1")
    prompts = [list(p) for p in prompts]
    longest = max(len(p) for p in prompts) + new_tokens
    rows = min(len(prompts), decode_batch)
    engine = Engine(cfg, params, EngineConfig(max_tokens=rows * (longest + page_size) + page_size,
                                              page_size=page_size, chunk_size=max(batch_tokens, longest),
                                              max_batch=rows, share_prompts=False))
    seqs = [p + o.tokens for p, o in zip(prompts, engine.generate(prompts, new_tokens))]
    del engine  # its KV pool
    hidden: list[torch.Tensor] = []
    i = 0
    while i < len(seqs):
        group = [seqs[i]]
        while i + len(group) < len(seqs) and sum(map(len, group)) + len(seqs[i + len(group)]) <= batch_tokens:
            group.append(seqs[i + len(group)])
        state = init_state(cfg, params, max_tokens=sum(map(len, group)) + page_size * (len(group) + 1),
                           page_size=page_size)
        state, out = prefill(state, Batch.from_tokens(list(range(len(group))), group), capture_hidden=tuple(layers))
        part = out.hidden_TLH
        if on_host and part.is_cuda:  # straight into pinned memory: one copy, at the pinned rate
            part = torch.empty(part.shape, dtype=part.dtype, pin_memory=True).copy_(part)
        hidden += list(part.split([len(s) for s in group]))
        del state, out
        i += len(group)
    return GreedyData([torch.tensor(s) for s in seqs], hidden, [len(p) for p in prompts])


@typed
def block_logits(params: DFlashParams, dcfg: DFlashConfig, target: Params, hidden_SCLH: Float[Tensor, "S C L H"],
                 tokens_SC: Int[Tensor, "S C"], anchors_SA: Int[Tensor, "S A"]) -> Float[Tensor, "S A J V"]:
    """The draft's logits at block positions 1 .. B-1 of every anchor: anchor a of sequence s
    sees the context of its tokens 0 .. a-1 and its own block, nothing else (differentiable;
    the attention in fp32 as dflash.draft_logits computes it)."""
    S, C, _, H = hidden_SCLH.shape
    A, B, D, N, G = anchors_SA.shape[1], dcfg.block_size, dcfg.head_dim, dcfg.num_heads, dcfg.num_kv_heads
    R, eps, theta = N // G, dcfg.rms_norm_eps, dcfg.rope_theta
    dev = hidden_SCLH.device
    pos_C = torch.arange(C, device=dev)
    # dflash.context_kv, with the reference norm (the fused CUDA norm kernel has no backward)
    ctx_XH = rms_norm_ref(linear(hidden_SCLH.flatten(0, 1).flatten(1).to(params.fc.dtype), params.fc),
                          params.hidden_norm, eps)  # X = S*C context rows
    pos_X = pos_C.repeat(S)
    ctx = [(_rope(_norm_heads_ref(_heads(linear(ctx_XH, layer.wk), D), layer.k_norm, eps), pos_X, theta),
            _heads(linear(ctx_XH, layer.wv), D)) for layer in params.layers]
    pos_P = (anchors_SA[..., None] + torch.arange(B, device=dev)).flatten()  # P = S*A*B block rows
    block_SAB = torch.cat([tokens_SC.gather(1, anchors_SA)[..., None],
                           torch.full((S, A, B - 1), dcfg.mask_token_id, device=dev)], dim=-1)
    hidden_before_SAC = pos_C < anchors_SA[..., None]  # the context an anchor's block sees
    x_PH = target.embed[block_SAB.flatten()].to(params.fc.dtype)
    for layer, (k_ctx, v_ctx) in zip(params.layers, ctx):
        h_PH = rms_norm_ref(x_PH, layer.attn_norm, eps)
        q = _rope(_norm_heads_ref(_heads(linear(h_PH, layer.wq), D), layer.q_norm, eps), pos_P, theta)
        k = _rope(_norm_heads_ref(_heads(linear(h_PH, layer.wk), D), layer.k_norm, eps), pos_P, theta)
        v = _heads(linear(h_PH, layer.wv), D)
        q_SABGRD = q.float().view(S, A, B, G, R, D)
        k_blk, v_blk = k.float().view(S, A, B, G, D), v.float().view(S, A, B, G, D)
        k_ctx, v_ctx = k_ctx.float().view(S, C, G, D), v_ctx.float().view(S, C, G, D)
        s_ctx = torch.einsum("sabgrd,scgd->sabgrc", q_SABGRD, k_ctx)
        s_ctx = s_ctx.masked_fill(~hidden_before_SAC[:, :, None, None, None, :], float("-inf"))
        s_blk = torch.einsum("xbgrd,xegd->xbgre", q_SABGRD.flatten(0, 1),
                             k_blk.flatten(0, 1)).view(S, A, B, G, R, B)  # no mask inside the block
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1) / math.sqrt(D), dim=-1)
        o = torch.einsum("sabgrc,scgd->sabgrd", p[..., :C], v_ctx) + torch.einsum(
            "xbgre,xegd->xbgrd", p[..., C:].flatten(0, 1), v_blk.flatten(0, 1)).view(S, A, B, G, R, D)
        x_PH = x_PH + linear(o.reshape(S * A * B, N * D).to(x_PH.dtype), layer.wo)
        h_PH = rms_norm_ref(x_PH, layer.mlp_norm, eps)
        x_PH = x_PH + linear(F.silu(linear(h_PH, layer.w_gate)) * linear(h_PH, layer.w_up), layer.w_down)
    x_QH = x_PH.view(S, A, B, H)[:, :, 1:].reshape(-1, H)  # Q = S*A*J drafted rows
    out_QV = linear(rms_norm_ref(x_QH, params.norm, eps).to(target.embed.dtype), target.lm_head)
    return out_QV.view(S, A, B - 1, -1)


def _norm_heads_ref(x_TnD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    """dflash._norm_heads with the reference norm: each head RMS-normed on its own."""
    return rms_norm_ref(x_TnD.reshape(-1, x_TnD.shape[-1]), w_D, eps).view_as(x_TnD)


def block_loss(logits_SAJV: torch.Tensor, labels_SAJ: torch.Tensor, gamma: float) -> torch.Tensor:
    """Cross-entropy per block position, position k (1-based) weighted exp(-(k-1) / gamma)
    (gamma <= 0: all alike), the weights summing to one. A label of -100 (a token outside the
    draft's vocabulary) adds nothing."""
    J = logits_SAJV.shape[2]
    w_J = torch.ones(J) if gamma <= 0 else torch.exp(-torch.arange(J, dtype=torch.float32) / gamma)
    ce_SAJ = F.cross_entropy(logits_SAJV.float().flatten(0, 2), labels_SAJ.flatten(), reduction="none")
    return (ce_SAJ.view(labels_SAJ.shape).mean(dim=(0, 1)) * (w_J / w_J.sum()).to(ce_SAJ.device)).sum()


def sample_batch(data: GreedyData, block_size: int, seqs: int, anchors: int, rng: random.Random,
                 device: torch.device | None = None):
    """(hidden_SCLH, tokens_SC, anchors_SA, labels_SAJ) of random sequences and `anchors` random
    anchors each, anchors in the generated part with a whole block of targets after them, on
    `device` (default: the data's). The sequences are of one length, that of the first, drawn from
    all: `seqs` of the shortest length, fewer of a longer one (as many context rows a step), so
    data of short and long prompts trains on both without padding the short ones to the long."""
    pick = rng.randrange(len(data.tokens))
    C = len(data.tokens[pick])
    same = data.by_length[C]
    picks = [pick] + [rng.choice(same) for _ in range(max(1, seqs * min(data.by_length) // C) - 1)]
    L, H = data.hidden[0].shape[1:]
    dev = device or data.hidden[0].device
    hidden = torch.empty(len(picks), C, L, H, dtype=data.hidden[0].dtype, device=dev)
    tokens = torch.empty(len(picks), C, dtype=torch.long)
    anchor_rows = []
    for s, i in enumerate(picks):
        n, first = len(data.tokens[i]), data.prompt_lens[i]  # the first generated token anchors the first block
        hidden[s, :n].copy_(data.hidden[i], non_blocking=True)  # (from pinned host memory: no host copy)
        tokens[s, :n] = data.tokens[i]
        last = n - block_size
        if last < first:
            raise ValueError(f"sequence {i}: {n - first} generated tokens, too few for a block of {block_size}")
        anchor_rows.append([rng.randint(first, last) for _ in range(anchors)])
    anchors_SA = torch.tensor(anchor_rows)
    labels = tokens.gather(1, (anchors_SA[..., None] + torch.arange(1, block_size)).flatten(1))
    return hidden, tokens.to(dev), anchors_SA.to(dev), labels.view(len(picks), anchors, block_size - 1).to(dev)


def accept_length(cfg: ModelConfig, params: Params, dparams: DFlashParams, dcfg: DFlashConfig,
                  prompts: Sequence[Sequence[int]], new_tokens: int, page_size: int = 16) -> tuple[float, list]:
    """(mean acceptance length, outputs) of the real Engine decoding `prompts` greedily with the
    draft (num_draft_tokens = block_size - 1): Engine.spec_stats()'s mean_accept_length."""
    longest = max(len(p) for p in prompts) + new_tokens
    proposer = DFlashProposer(dparams, dcfg, params, cfg)
    engine = Engine(cfg, params, EngineConfig(max_tokens=len(prompts) * (longest + 2 * page_size), page_size=page_size,
                                              num_draft_tokens=dcfg.block_size - 1, proposer=proposer))
    outs = engine.generate([list(p) for p in prompts], new_tokens)
    return engine.spec_stats()["mean_accept_length"], outs


def leaves(params: DFlashParams) -> list[torch.Tensor]:
    """The draft's own tensors, in a fixed order (what the optimiser updates)."""
    return [params.fc, params.hidden_norm, params.norm] + [getattr(layer, f.name) for layer in params.layers
                                                           for f in fields(layer)]


def cast(params: DFlashParams, dtype: torch.dtype) -> DFlashParams:
    """A detached copy of the draft's weights in dtype."""
    layers = tuple(replace(layer, **{f.name: getattr(layer, f.name).detach().to(dtype) for f in fields(layer)})
                   for layer in params.layers)
    return DFlashParams(params.fc.detach().to(dtype), params.hidden_norm.detach().to(dtype), layers,
                        params.norm.detach().to(dtype), params.vocab)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    seqs: int = 16  # sequences a step
    anchors: int = 8  # anchors (blocks) a sequence and step
    lr: float = 1e-3  # peak; a tiny draft (the CPU test's) learns faster at 1e-2
    warmup: int = 20  # steps of linear learning-rate warm-up; cosine decay to 10% after
    weight_decay: float = 0.0
    gamma: float = 4.0  # block position k weighted exp(-(k-1)/gamma); 0: all alike
    eval_every: int = 100  # steps between acceptance measurements (and one before the first step, one after the last)
    seed: int = 0
    # a time budget: training ends after this many seconds (or `steps`, whichever comes first), the
    # learning rate following whichever of the two is further along
    max_seconds: float | None = None


def train(cfg: ModelConfig, params: Params, dparams: DFlashParams, dcfg: DFlashConfig, data: GreedyData,
          tc: TrainConfig, evaluate: Callable[[DFlashParams], float] | None = None,
          progress: bool = True, autocast: torch.dtype | None = None) -> tuple[DFlashParams, list[dict]]:
    """Train dparams (fp32 master weights, updated in place) on data; returns them and the
    history: one {"step", "loss", "accept_length"} per evaluation (loss: the mean over the
    steps since the one before; accept_length: evaluate(draft) where given). autocast: run the
    forward in that dtype (bf16 on CUDA)."""
    target = params
    if dparams.vocab is not None:  # the draft scores its own vocabulary: those rows of the LM head
        target = replace(params, lm_head=head_rows(params.lm_head, dparams.vocab, params.embed.dtype))
    elif isinstance(params.lm_head, QTensor):  # the LM head's FP8 GEMM has no backward: a plain copy
        target = replace(params, lm_head=dequantize(params.lm_head, params.embed.dtype))
    weights = leaves(dparams)
    for w in weights:
        w.requires_grad_(True)
    opt = torch.optim.AdamW(weights, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)

    start = time.monotonic()

    def done_part(step: int) -> float:
        """How far training is, 0 .. 1: by steps, or by the time budget where that is further."""
        part = step / tc.steps
        if tc.max_seconds:
            part = max(part, (time.monotonic() - start) / tc.max_seconds)
        return min(part, 1.0)

    def lr_at(step: int) -> float:
        if step < tc.warmup:
            return (step + 1) / tc.warmup
        t = max(0.0, done_part(step) - tc.warmup / tc.steps) / (1 - tc.warmup / tc.steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    rng = random.Random(tc.seed)
    history, losses = [], []

    def record(step: int) -> None:
        row = {"step": step, "loss": sum(losses) / len(losses) if losses else None}
        if evaluate is not None:
            row["accept_length"] = evaluate(dparams)
        history.append(row)
        losses.clear()
        loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
        acc = f"{row['accept_length']:.3f}" if row.get("accept_length") is not None else "-"
        where = f"{step}/{tc.steps}" if tc.max_seconds is None else \
            f"{step} ({time.monotonic() - start:.0f} of {tc.max_seconds:.0f} s)"
        tqdm.write(f"step {where}  loss {loss}  accept length {acc}")

    record(0)
    start = time.monotonic()  # the budget is the training's, not the first measurement's
    dev_type = params.embed.device.type
    # the bar counts steps, or seconds of the time budget where there is one
    bar = tqdm(total=tc.steps if tc.max_seconds is None else round(tc.max_seconds),
               unit="step" if tc.max_seconds is None else "s", desc="train dflash", disable=not progress)
    for step in range(1, tc.steps + 1):
        hidden, tokens, anchors, labels = sample_batch(data, dcfg.block_size, tc.seqs, tc.anchors, rng,
                                                       params.embed.device)
        with torch.autocast(dev_type, dtype=autocast, enabled=autocast is not None):
            logits = block_logits(dparams, dcfg, target, hidden, tokens, anchors)
        loss = block_loss(logits, to_draft_ids(labels, dparams.vocab, cfg.vocab_size), tc.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        out_of_time = tc.max_seconds is not None and time.monotonic() - start >= tc.max_seconds
        if tc.max_seconds is None:
            bar.update(1)
        elif (n := min(bar.total, round(time.monotonic() - start))) != bar.n:  # a line a second, not a step
            bar.n = n
            bar.set_postfix(step=step, refresh=True)
        if step % tc.eval_every == 0 or step == tc.steps or out_of_time:
            record(step)
        if out_of_time:
            break
    bar.close()
    for w in weights:
        w.requires_grad_(False)
    return dparams, history
