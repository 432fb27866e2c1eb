"""K/V kept across generate calls (EngineConfig.prefix_cache): a later prompt that begins with
the tokens of a finished request or of an earlier prompt (the next turn of a multi-turn rollout,
the same prompt again) forks their K/V and prefills only the rest. A prompt that shares only
part of an earlier one (the same system prompt, another question) does not: the sliding-window
pages at that point are gone (prompts of one call still share it: prompt_copies).

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

The functions at the end are the engine's side (Engine.generate calls them; engine._Live is a
request's progress there). Entries go least recently used first when the pool lacks the pages
the next waiting request needs (make_room), or past one entry a page of the pool (which bounds
the host memory of their tokens and outputs), and all of them at update_weights and
release_memory (their K/V is stale or gone). A hit changes how a prompt is split into steps, which can change bf16 rounding
as any change of batch does: with the cache on, a call repeated need not give the same tokens.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from mimo_fn.model import fork, release, truncate
from mimo_fn.sched.policy import order_waiting
from mimo_fn.sched.state import reserved_tokens


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

    def outputs(self, device, logprobs: bool, experts: bool) -> dict:
        """What a request that forks the entry takes (engine._Live's fields; prompt_copies.take_prefix):
        the log-probs (one token past the K/V) and routed experts a call returns, experts on device."""
        return {"prompt_logprobs": self.logprobs.tolist() if logprobs else [],
                "experts": [self.experts.to(device=device, dtype=torch.int32)] if experts else []}


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

    @classmethod
    def for_engine(cls, config, num_pages: int, swa_limit: int | None, proposer: str, hidden: tuple[int, ...]):
        """The cache of an engine with EngineConfig config (None with prefix_cache off): a ValueError
        where the engine cannot keep one (a bounded sliding-window pool, whose cap on requests in
        flight would not count the entries' pages; a proposer with per-request hidden states)."""
        if not config.prefix_cache:
            return None
        if swa_limit is not None:
            raise ValueError(f"EngineConfig.prefix_cache needs a sliding-window pool as large as the full one "
                             f"(max_swa_tokens = {config.max_swa_tokens} < max_tokens = {config.max_tokens})")
        if hidden:
            raise ValueError(f"EngineConfig.prefix_cache needs a proposer that reads no hidden states ({proposer} "
                             f"reads layers {hidden})")
        return cls(config.page_size, max_entries=num_pages)

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


def entries_for(cache: PrefixCache, prompts: list[list[int]], groups: list[tuple[int, list[int]]], keys: list[int],
                first: int, logprobs: bool, experts: bool) -> tuple[dict[int, Entry], list[tuple[int, list[int]]]]:
    """The entries a generate call forks, by rid (prompt i is rid first + i, group g's prefix
    first + len(prompts) + g), and the groups it keeps. Each prompt forks one prefix: its entry
    or its group's (prompt_copies.shared_prefixes: (prefix length, prompt indices)), whichever is
    longer; a group left with fewer than two distinct prompts (keys: prompt_copies.prompt_keys) is
    dropped, and its prompts keep their entries. A group's prefix forks an entry too."""
    found = {i: e for i, p in enumerate(prompts) if (e := cache.match(p, logprobs, experts))}
    kept = []
    for length, members in groups:
        mine = [i for i in members if i not in found or found[i].length < length]
        if len({keys[i] if keys[i] >= 0 else first + i for i in mine}) > 1:
            kept.append((length, mine))
    grouped = {i for _, members in kept for i in members}
    hits = {first + i: e for i, e in found.items() if i not in grouped}
    hits.update((first + len(prompts) + g, e) for g, (length, members) in enumerate(kept)
                if (e := cache.match(prompts[members[0]][:length], logprobs, experts)))
    return hits, kept


def keep_finished(engine, rids, live, in_use, logprobs: bool, capture: bool) -> None:
    """Finished requests: keep each as an entry, its sequence cut back to the whole pages of its
    tokens, or release it (engine.generate's `live` requests; in_use: the sequences the call holds
    for its requests; logprobs / capture: what the call returns)."""
    cache, gone = engine.prefix_cache, []
    for rid in rids:
        r = live[rid]
        tokens = r.prompt + r.tokens
        n = cache.length_to_keep(tokens, engine.state.seqs[rid].length)
        if n == 0:
            gone.append(rid)
            continue
        try:  # swa_slack keeps the window's pages for it
            engine.state = truncate(engine.state, {rid: n})
        except ValueError:  # (it cannot go back that far: not kept)
            gone.append(rid)
            continue
        gone += cache.add(rid, tokens[:n + 1], *_outputs(engine.cfg, r, n, logprobs, capture), set(in_use))
    if gone:
        engine.state = release(engine.state, gone)


def keep_prompts(engine, rids, live, in_use, logprobs: bool, capture: bool) -> None:
    """Prompts just prefilled: keep the whole pages of each (less its last token) as an entry of its
    own, a new sequence that holds them in common with the request (model.fork up to them)."""
    cache, gone = engine.prefix_cache, []
    for rid in rids:
        r = live[rid]
        n = cache.length_to_keep(r.prompt, len(r.prompt))
        have = cache.find(r.prompt[:n + 1]) if n else None
        if n == 0 or have is not None and (have.logprobs is not None or not logprobs) and (
                have.experts is not None or not capture):  # kept already, with these outputs
            continue
        seq = engine._next_id  # the engine's sequence ids
        try:  # swa_slack keeps its window's pages
            engine.state = fork(engine.state, {seq: rid}, {seq: n})
        except ValueError:  # (the request is past them: not kept)
            continue
        engine._next_id += 1
        gone += cache.add(seq, r.prompt[:n + 1], *_outputs(engine.cfg, r, n, logprobs, capture), set(in_use))
    if gone:
        engine.state = release(engine.state, gone)


def _outputs(cfg, r, n: int, logprobs: bool, capture: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(log-probs of tokens 1..n, routed experts of tokens 0..n-1 on the host) of request r, for an
    entry; None where the call returns none."""
    lp = torch.tensor((r.prompt_logprobs + r.logprobs)[:n], dtype=torch.float32) if logprobs else None
    experts = None
    if capture and r.experts:  # in 16 bits (ids < 256 at the released dims)
        experts = torch.cat(r.experts)[:n].to("cpu", torch.int16 if cfg.num_experts < 2**15 else torch.int32)
    return lp, experts


def make_room(engine, st, in_use) -> bool:
    """The KV pool lacks what the first waiting request of scheduler state st needs: let entries
    go, least recently used first, none in in_use (held for this call's requests), until it fits
    as the adder counts it, or none is left. Returns whether any went."""
    page, cfg, went = engine.config.page_size, engine.sched_config, False
    first = order_waiting(st.waiting, cfg.policy)[0]
    need = first.footprint_tokens(page)
    if first.prefix_key in dict(st.held) and cfg.copies_share_pages:  # its prefix's pages held in common
        need -= first.prefix_len // page * page
    in_use = set(in_use)
    while engine._free_pages() * page - reserved_tokens(st, cfg) < need:
        seq = engine.prefix_cache.least_recent(in_use)
        if seq is None:
            break
        engine.prefix_cache.drop(seq)
        engine.state = release(engine.state, [seq])
        went = True
    return went
