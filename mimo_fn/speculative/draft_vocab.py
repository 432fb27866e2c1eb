"""A draft's own vocabulary: the tokens it may propose, a subset of the target's.

A draft's LM head over the target's whole vocabulary (152K rows at the released dims) is a large
part of its work: reading it is a large share of a small draft's step at batch 1, and it is about
half the FLOPs of a training step (docs/benchmarks.md, speculative decoding). The tokens a draft gets right are the
frequent ones, so a draft can score only the Vd most frequent tokens of its training data
(EAGLE-3 keeps 32K, its d2t map; SGLang's --speculative-token-map, FR-Spec's token list, does the
same for EAGLE drafts): its LM head is those rows of the target's, and its argmax maps back to the
target's ids. Drafting stays lossless: the
target verifies every draft as before; a token outside the vocabulary is one the draft cannot
guess, and the target's own token follows the last accepted draft as always.

DFlashParams.vocab holds the ids (int64 [Vd], sorted; None: the whole vocabulary), saved with the
draft as the tensor `draft_vocab`.

Legend: V target vocabulary, Vd draft vocabulary, H hidden, S any shape of labels.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.params import Params, Weight
from mimo_fn.quant import QTensor, dequantize


@typed
def frequent_tokens(seqs: Sequence[Tensor], starts: Sequence[int], size: int) -> Int[Tensor, " Vd"]:
    """int64 [<= size], sorted: the `size` most frequent tokens of seqs[i][starts[i]:] (the
    continuations a draft learns to predict), ties to the smaller id."""
    if size <= 0:
        raise ValueError(f"draft vocabulary of {size} tokens: expected at least 1")
    counts = Counter()
    for seq, start in zip(seqs, starts):
        counts.update(seq[start:].tolist())
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return torch.tensor(sorted(t for t, _ in top), dtype=torch.long)


@typed
def coverage(vocab: Int[Tensor, " Vd"], seqs: Sequence[Tensor], starts: Sequence[int]) -> float:
    """The share of the continuations' tokens (seqs[i][starts[i]:]) that vocab holds."""
    conts = torch.cat([seq[start:] for seq, start in zip(seqs, starts)])
    return torch.isin(conts, vocab.cpu()).float().mean().item() if conts.numel() else 1.0


def check_vocab(vocab: torch.Tensor, vocab_size: int, what: str) -> None:
    """ValueError unless vocab is int64 [Vd], 0 < Vd, strictly increasing ids in [0, vocab_size)."""
    ok = vocab.dtype == torch.long and vocab.dim() == 1 and vocab.numel() > 0
    if ok:
        v = vocab.cpu()
        ok = bool(v[0] >= 0 and v[-1] < vocab_size and (v[1:] > v[:-1]).all())
    if not ok:
        raise ValueError(f"{what}: expected int64 [Vd] token ids, strictly increasing, in [0, {vocab_size}); got "
                         f"{vocab.dtype} {list(vocab.shape)}")


@typed
def head_rows(lm_head: Weight, vocab: Int[Tensor, " Vd"], dtype: torch.dtype,
              out: Float[Tensor, "Vd H"] | None = None) -> Float[Tensor, "Vd H"]:
    """[Vd, H] the target LM head's rows of vocab (an FP8 head dequantised to dtype), into out if given."""
    dense = dequantize(lm_head, dtype) if isinstance(lm_head, QTensor) else lm_head
    if out is None:
        return dense.index_select(0, vocab.to(dense.device))
    return torch.index_select(dense, 0, vocab.to(dense.device), out=out)


def head_version(lm_head) -> int:
    """A number that changes when the LM head is written in place (a weight update)."""
    return (lm_head.data if isinstance(lm_head, QTensor) else lm_head)._version


class DraftHead:
    """The target as a draft reads it: its LM head cut to the draft's vocabulary (Params with that
    lm_head; the target itself where vocab is None). `refresh()` copies the rows again, in place
    (the CUDA graphs that read them keep their address), after the target's LM head was written."""

    def __init__(self, target: Params, vocab: torch.Tensor | None):
        self.source, self.vocab, self.params = target, vocab, target
        if vocab is not None:
            check_vocab(vocab, target.embed.shape[0], "DFlashParams.vocab")
            self.vocab = vocab.to(target.embed.device)
            self.params = replace(target, lm_head=head_rows(target.lm_head, self.vocab, target.embed.dtype))
            self._version = head_version(target.lm_head)

    def refresh(self) -> None:
        if self.vocab is not None and head_version(self.source.lm_head) != self._version:
            head_rows(self.source.lm_head, self.vocab, self.params.lm_head.dtype, out=self.params.lm_head)
            self._version = head_version(self.source.lm_head)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (an argmax of the draft's logits) as the target's token ids."""
        return ids if self.vocab is None else self.vocab[ids]


@typed
def to_draft_ids(labels: Int[Tensor, "*S"], vocab: Int[Tensor, " Vd"] | None, vocab_size: int,
                 ignore: int = -100) -> Int[Tensor, "*S"]:
    """Target token ids as draft-vocabulary ids (labels for the draft's logits); `ignore` where a
    token is outside the vocabulary."""
    if vocab is None:
        return labels
    table = torch.full((vocab_size,), ignore, dtype=torch.long, device=labels.device)
    table[vocab.to(labels.device)] = torch.arange(vocab.numel(), device=labels.device)
    return table[labels]
