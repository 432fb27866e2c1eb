"""K/V kept across generate calls (EngineConfig.prefix_cache): a later prompt that begins with
the tokens of a finished request (the next turn of a multi-turn rollout, the same system prompt
or document a call later) forks their K/V and prefills only the rest.

Legend: P = page_size; F = the tokens an entry holds K/V for, a multiple of P.

When a request finishes, the engine cuts its sequence back to the whole pages of its tokens
(prompt, then generated; the last drawn token has no K/V) and keeps it as an entry: F tokens of
K/V, the token that followed them, and, where the call returned them, the log-prob of each of
tokens 1..F and the routed experts of tokens 0..F-1. When a prompt is prefilled, the engine
also keeps its whole pages, less the last token, as an entry of their own (model.fork up to
them: pages in common, none copied), so that the same prompt again, or a longer one that
begins with it, forks them: the request itself moves on, and the sliding-window pages at the
end of its prompt would be gone by the time it finishes. A prompt longer than F whose first F + 1
tokens are an entry's uses it: the engine hands the entry to the scheduler as a held prefix
(sched.adder, rule 6), the request forks its K/V (model.fork: its pages, held in common, no
copy) and prefills from token F, and its outputs for the tokens before take the entry's. Matching
one token past the K/V is what gives token F's log-prob (it needs the logits after token F - 1,
which no later step computes again). An entry made by a call that returned no log-probs or
routed experts serves only requests that ask for none.

Entries go least recently used first when the pool lacks the pages the next waiting request
needs (Engine._make_room), or past one entry a page of the pool (which bounds the host memory of
their tokens and outputs), and all of them at update_weights and release_memory (their K/V is
stale or gone). A hit changes how a prompt is split into steps, which can change bf16 rounding
as any change of batch does: with the cache on, a call repeated need not give the same tokens.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    seq: int  # the engine's sequence holding the K/V (a finished request's id)
    tokens: list[int]  # F + 1: the F tokens of the K/V, then the one that followed
    logprobs: torch.Tensor | None  # float32 [F]: log p of tokens 1..F given those before
    experts: torch.Tensor | None  # [F, MoE layers, K] on the host: the routed experts of tokens 0..F-1
    key: tuple[int, int]  # its place in PrefixCache._index

    @property
    def length(self) -> int:
        return len(self.tokens) - 1


def _page_hashes(tokens: list[int], page: int, pages: int) -> list[int]:
    """[j]: a hash of tokens[:(j + 1) * page], each from the one before and one page of tokens
    (O(len) over all prefixes; ints and tuples of ints hash the same in every process)."""
    h, out = 0, []
    for j in range(pages):
        h = hash((h, tuple(tokens[j * page:(j + 1) * page])))
        out.append(h)
    return out


class PrefixCache:
    """The entries of one engine (one rank; every TP rank of a DP group makes the same ones)."""

    def __init__(self, page_size: int, max_entries: int):
        self.page = page_size
        self.max_entries = max_entries  # bounds the host memory of the entries' outputs
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # seq -> entry, least recently used first
        self._index: dict[tuple[int, int], list[int]] = {}  # (hash of the F tokens, token F) -> seqs

    def __contains__(self, seq: int) -> bool:
        return seq in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def _key(self, tokens: list[int], length: int) -> tuple[int, int]:
        return _page_hashes(tokens, self.page, length // self.page)[-1], tokens[length]

    def _touch(self, e: Entry) -> Entry:
        self.entries.move_to_end(e.seq)
        return e

    def match(self, prompt: list[int], logprobs: bool, experts: bool) -> Entry | None:
        """The longest entry whose F + 1 tokens begin `prompt`, F < len(prompt), with the outputs
        asked for; None if none."""
        if not self.entries:
            return None
        pages = (len(prompt) - 1) // self.page
        hashes = _page_hashes(prompt, self.page, pages)
        for j in range(pages, 0, -1):
            n = j * self.page
            for seq in reversed(self._index.get((hashes[j - 1], prompt[n]), ())):
                e = self.entries[seq]
                if (e.tokens == prompt[:n + 1] and (e.logprobs is not None or not logprobs)
                        and (e.experts is not None or not experts)):
                    return self._touch(e)
        return None

    def find(self, tokens: list[int]) -> Entry | None:
        """The entry of exactly these F + 1 tokens, if any."""
        length = (len(tokens) - 1) // self.page * self.page
        if not self.entries or not length or length != len(tokens) - 1:
            return None
        return next((self.entries[s] for s in self._index.get(self._key(tokens, length), ())
                     if self.entries[s].tokens == tokens), None)

    def length_to_keep(self, tokens: list[int], kv_len: int) -> int:
        """F for a finished request whose prompt and generated tokens are `tokens`, with kv_len
        tokens of K/V: whole pages of the tokens that have K/V and a token after them; 0: none."""
        return min(len(tokens) - 1, kv_len) // self.page * self.page

    def add(self, seq: int, tokens: list[int], logprobs: torch.Tensor | None, experts: torch.Tensor | None,
            in_use) -> list[int]:
        """Keep sequence seq (cut back to len(tokens) - 1 tokens) as an entry; returns the
        sequences to release: an entry of the same tokens it replaces, or seq itself where that
        one stays (it is in use, in_use: the sequences this call holds for its requests, or has
        outputs seq lacks), and the least recently used beyond max_entries."""
        length = len(tokens) - 1
        key = self._key(tokens, length)
        same = [s for s in self._index.get(key, ()) if self.entries[s].tokens == tokens]
        outputs = (logprobs is not None) + (experts is not None)
        if same and (same[0] in in_use or outputs < self._outputs(self.entries[same[0]])):
            self._touch(self.entries[same[0]])
            return [seq]
        gone = [self.drop(s).seq for s in same]
        self.entries[seq] = Entry(seq, list(tokens), logprobs, experts, key)
        self._index.setdefault(key, []).append(seq)
        while len(self.entries) > self.max_entries and (old := self.least_recent(in_use)) is not None:
            gone.append(self.drop(old).seq)
        return gone

    @staticmethod
    def _outputs(e: Entry) -> int:
        return (e.logprobs is not None) + (e.experts is not None)

    def drop(self, seq: int) -> Entry:
        e = self.entries.pop(seq)
        self._index[e.key].remove(seq)
        if not self._index[e.key]:
            del self._index[e.key]
        return e

    def least_recent(self, in_use) -> int | None:
        """The least recently used entry's sequence, of those not in in_use; None if none."""
        return next((seq for seq in self.entries if seq not in in_use), None)

    def clear(self) -> list[int]:
        """Drop every entry; returns their sequences, to release."""
        seqs = list(self.entries)
        self.entries.clear()
        self._index.clear()
        return seqs


def merge_with_groups(hits: dict[int, Entry], groups: list[tuple[int, list[int]]], keys: list[int],
                      first: int) -> tuple[dict[int, Entry], list[tuple[int, list[int]]]]:
    """Each prompt forks one prefix: its cache entry (hits, by prompt index) or its group's
    (prompt_copies.shared_prefixes: (prefix length, prompt indices)), whichever is longer. A group
    left with fewer than two distinct prompts (keys: prompt_copies.prompt_keys) is dropped, and
    its prompts keep their entries."""
    kept = []
    for length, members in groups:
        mine = [i for i in members if i not in hits or hits[i].length < length]
        if len({keys[i] if keys[i] >= 0 else first + i for i in mine}) > 1:
            kept.append((length, mine))
    grouped = {i for _, members in kept for i in members}
    return {i: e for i, e in hits.items() if i not in grouped}, kept
