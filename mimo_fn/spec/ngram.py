"""Prompt-lookup (n-gram) drafts for speculative decoding: no draft model.

The last n tokens of a sequence (n from max_n down to min_n) are looked up earlier in the
same sequence, prompt and generated tokens alike; the tokens that followed the latest earlier
occurrence are the draft. It is strong wherever the output copies its input (code edits,
retrieval, quoting a long document, repetitive rollouts). Elsewhere it proposes nothing,
and the step then costs what a plain decode step costs.

A proposer is any object with `propose(rid, tokens, k) -> list[int]`: at most k draft tokens to
follow request rid's `tokens`. A proposer that reads the target's hidden states also has
`target_layers`, `observe(rid, hidden_TLH)` and `forget(rid)` (mimo_fn.spec.dflash). Where a
proposer has `propose_many([(rid, tokens, k)]) -> [drafts]` or `observe_many([(rid,
hidden_TLH)])`, the engine calls those once a step instead, for a batched draft model. The engine
verifies every draft against the target model, so a proposer changes the speed of decoding:
not greedy decoding's tokens (up to rounding: see the README), nor the distribution of sampled
ones.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramProposer:
    min_n: int = 2  # shortest suffix looked up
    max_n: int = 4  # longest suffix looked up (tried first: a longer match predicts better)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramProposer: need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        if k <= 0:
            return []
        seq_L = torch.as_tensor(list(tokens), dtype=torch.long)
        for n in range(min(self.max_n, len(seq_L) - 1), self.min_n - 1, -1):
            windows_WN = seq_L[:-1].unfold(0, n, 1)  # every n-gram that ends before the last token
            hits = (windows_WN == seq_L[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n  # what followed the latest occurrence
                return seq_L[start:start + k].tolist()
        return []
