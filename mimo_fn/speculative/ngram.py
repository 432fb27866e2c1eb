"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model.

The last n tokens of a sequence (n from max_n down to min_n) are looked up earlier in the
same sequence, prompt and generated tokens alike; the tokens that followed the latest earlier
occurrence are the draft. It is strong wherever the output copies its input (code edits,
retrieval, quoting a long document, repetitive rollouts). Elsewhere it proposes nothing,
and the step then costs what a plain decode step costs.

The engine calls it through the Proposer protocol (mimo_fn.speculative.proposer); it keeps a
tensor of each request's tokens, which fork and forget need not touch (a fork starts its own).
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mimo_fn.speculative.proposer import Proposer


class JoinedTokens(Sequence):
    """What the engine passes proposers as `tokens`: prompt + generated tokens as one read-only
    sequence, without copying either, so a proposer that reads only the last token (a DFlash
    draft) costs O(1) per step, not O(context)."""

    def __init__(self, head: list[int], tail: list[int]):
        self._head, self._tail = head, tail

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __iter__(self):
        return itertools.chain(self._head, self._tail)  # list(tokens) at list speed (prompt lookup)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return (self._head + self._tail)[i]
            h = len(self._head)  # copy only the range asked for (a proposer reading its new tokens)
            return self._head[start:min(stop, h)] + self._tail[max(start - h, 0):max(stop - h, 0)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"token index {i} out of range for {len(self)} tokens")
        return self._head[i] if i < len(self._head) else self._tail[i - len(self._head)]


@dataclass(frozen=True)
class NgramProposer(Proposer):
    min_n: int = 2  # shortest suffix looked up
    max_n: int = 4  # longest suffix looked up (tried first: a longer match predicts better)
    # rid -> (its tokens as a tensor buffer, how many are in it): a step converts only the tokens
    # added since the last, not the whole context (a list of 32K ints took 1.5 ms to convert)
    _seqs: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramProposer: need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def _tensor(self, rid: int, tokens: Sequence[int]) -> torch.Tensor:
        """rid's tokens [L] as a tensor, from its buffer; tokens that are not the buffer's plus
        new ones (another sequence under the same rid) start it over."""
        buf, n = self._seqs.get(rid, (None, 0))
        length = len(tokens)
        if buf is None or length < n or (n and int(buf[n - 1]) != tokens[n - 1]):
            buf, n = torch.empty(max(64, length), dtype=torch.long), 0
        if length > buf.numel():
            buf = torch.cat([buf[:n], torch.empty(max(length, 2 * buf.numel()) - n, dtype=torch.long)])
        buf[n:length] = torch.as_tensor(tokens[n:length], dtype=torch.long)
        self._seqs[rid] = (buf, length)
        return buf[:length]

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        seq_L = self._tensor(rid, tokens) if k > 0 else None
        length = 0 if seq_L is None else len(seq_L)
        top = min(self.max_n, length - 1)  # the longest suffix an earlier occurrence can match
        if top < self.min_n:
            return []
        # One pass over the context finds where the last token occurred before (ends e <= L-2 of
        # candidate occurrences, each followed by a token); the tokens before it are compared at
        # those candidates only, not over the whole context once per n. At 32K random tokens of
        # a 150K vocabulary a call took 0.026 ms instead of 0.144; a context that repeats its
        # last token at a third of its positions pays 2-3x the old cost (docs/benchmarks.md).
        end_C = (seq_L[:length - 1] == seq_L[length - 1]).nonzero().view(-1)
        if not len(end_C):  # the last token is new: no suffix occurred before
            return []
        match_C = torch.ones(len(end_C), dtype=torch.bool)
        matched = [match_C]  # matched[j]: the last j + 1 tokens match at the candidate
        for j in range(1, top):
            before_C = end_C - j
            match_C = match_C & (before_C >= 0) & (seq_L[before_C.clamp_min(0)] == seq_L[length - 1 - j])
            matched.append(match_C)
        for n in range(top, self.min_n - 1, -1):
            hits = end_C[matched[n - 1]]
            if len(hits):
                start = int(hits[-1]) + 1  # what followed the latest occurrence
                return seq_L[start:start + k].tolist()
        return []

    def forget(self, rid: int) -> None:
        self._seqs.pop(rid, None)
