"""K/V kept across generate calls (EngineConfig.prefix_cache): a later prompt that begins with
tokens of a finished request (the next turn of a multi-turn rollout, the same prompt again, the
same system prompt with another question) forks their K/V and prefills only the rest.

Legend: P = page_size; F = the tokens an entry holds K/V for; n = the tokens a prompt forks;
W = the sliding window.

When a request finishes, the engine keeps its sequence as an entry: F tokens of K/V (its prompt
and generated tokens; the last drawn token has none), the token that followed them, and, where
the call returned them, the log-prob of each of tokens 1..F and the routed experts of tokens
0..F-1. A prompt that shares c > P tokens with an entry forks the first
n = min(c - 1, F, len(prompt) - 1) of them: the engine hands the entry to the scheduler as a held
prefix (sched.adder, rule 6) with prefix_len n, the request forks that much of its K/V
(model.fork up to n: the whole pages in common, the partly filled last one copied) and prefills
from token n, and its outputs for the tokens before take the entry's. One token short of what
the two share is what gives token n's log-prob (it needs the logits after token n - 1, which no
later step computes again), and the prompt's last token always runs (its logits draw the first
new token). An entry made by a call that returned no log-probs or routed experts serves only
requests that ask for none. An entry that another covers (Entry.covers: its tokens and outputs
all, and forks wherever it does; the turn before, once the next turn finishes) goes when that
one is added, unless in use. What a proposer keeps of a request (a DFlash draft's context)
stays with its entry: a fork takes that of the first n tokens (proposer.fork with upto), and
the engine has the proposer forget it when it releases the entry's sequence (Engine._release).

A fork at n reads the sliding-window layers' K/V of tokens n - W + 1 .. n - 1, so where an entry
can be forked depends on the sliding-window pool:
- As large as the full pool (the default), the engine keeps every sliding-window page of a
  sequence (init_state's swa_slack covers all of it): the pool has a page for each full-attention
  page, so nothing runs dry, and an entry forks at any point.
- Bounded (EngineConfig.max_swa_tokens), a sequence lets its pages behind the window go as usual,
  but for those of the window at its prompt's end (model.keep_swa, set once its prompt is
  prefilled), and an entry keeps those and the ones of its last W tokens (a slack of at least one
  token more: an overlapped decode step may have written a token past the entry). It forks only
  where they suffice (Entry.forks, the most it can at or below the n a prompt would take): a
  turn that continues the entry's prompt and answer forks all of it, the same prompt again (a
  GRPO group drawn again, a turn drawn again) all but its last token; a prompt that shares only
  an earlier part of the entry's prompt (a system prompt) forks nothing. The pool is split so
  that entries never run it dry: with s pages a sequence in flight may hold and e pages an entry may
  (swa_pages), and c those of a prefill pass's chunk (cache.swa_pool_pages), the engine runs at
  most cap = min(max_batch, (pool - c) // (s + 2 e)) requests at once, and entries get what those
  leave, (pool - c - cap s) // e of them (max_entries): two for each request at least, the entry
  it forks (in use until the call ends) and the one it leaves. An
  entry is covered by another (and goes) only if that one forks wherever it does, so the turn
  before stays too, least recently used.

The engine's side (entries kept when requests finish, room made for waiting requests) is in
mimo_fn.engine.passes; requests.Live is a request's progress there. Entries go least recently
used first when the pool lacks the pages
the next waiting request needs (make_room), or past max_entries (one a page of the full pool,
which bounds the host memory of their tokens and outputs; fewer with a bounded sliding-window
pool), and all of them at update_weights and release_memory (their K/V is stale or gone). A hit
changes how a prompt is split into steps, which can change bf16 rounding as any change of batch
does: with the cache on, a call repeated need not give the same tokens.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from mimo_fn.cache import swa_pages_held


@dataclass
class Entry:
    seq: int  # the engine's sequence holding the K/V (a finished request's id)
    tokens: list[int]  # F + 1: the F tokens of the K/V, then the one that followed
    logprobs: torch.Tensor | None  # float32 [F]: log p of tokens 1..F given those before
    experts: torch.Tensor | None  # [F, MoE layers, K] on the host: the routed experts of tokens 0..F-1
    hashes: list[int]  # its keys in PrefixCache._index: _page_hashes of its tokens' whole pages
    # [lo, hi] ranges of n a fork of the first n tokens can take: where the sliding-window pages it
    # reads are held ((0, F) where the entry holds all of them; the module docstring)
    forks: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        return len(self.tokens) - 1

    def has(self, logprobs: bool, experts: bool) -> bool:
        """Whether it holds the outputs a call asks for."""
        return (self.logprobs is not None or not logprobs) and (self.experts is not None or not experts)

    def fork_point(self, n: int) -> int:
        """The most tokens up to n a fork can take (Entry.forks), -1 if none."""
        return max((min(n, hi) for lo, hi in self.forks if lo <= n), default=-1)

    def covers(self, other: "Entry") -> bool:
        """Whether every fork of other can take this entry instead: its tokens begin with other's,
        it holds the outputs other does, and it forks wherever other does."""
        return (len(self.tokens) >= len(other.tokens)
                and all(any(a <= lo and hi <= b for a, b in self.forks) for lo, hi in other.forks)
                and self.has(other.logprobs is not None, other.experts is not None)
                and self.tokens[:len(other.tokens)] == other.tokens)

    def outputs(self, device, logprobs: bool, experts: bool) -> dict:
        """What a request that forks the entry takes (requests.Live's fields; prompt_copies.take_prefix
        cuts them to the tokens it forks): the log-probs (one token past the K/V) and routed experts
        a call returns, experts on device."""
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


def _common(a: list[int], b: list[int], start: int) -> int:
    """How many tokens a and b begin with alike, given that their first `start` are."""
    n, end = start, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """The entries of one engine (one rank; every TP rank of a DP group makes the same ones)."""

    def __init__(self, page_size: int, max_entries: int, swa_slack: int | None = None,
                 max_running: int | None = None):
        self.page = page_size
        self.max_entries = max_entries  # bounds the host memory of the entries' outputs (and their SWA pages)
        # init_state's swa_slack for the engine: None keeps every sliding-window page (an unbounded pool)
        self.swa_slack = swa_slack
        self.max_running = max_running  # a bounded sliding-window pool: requests in flight beside the entries
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # seq -> entry, least recently used first
        # hash of the first j whole pages -> the entries whose tokens begin with them (every j of each)
        self._index: dict[int, list[int]] = {}

    @classmethod
    def for_engine(cls, cfg, config, proposer, hidden: tuple[int, ...]):
        """The cache of an engine of model cfg with EngineConfig config (None with prefix_cache off):
        with a bounded sliding-window pool, split between requests in flight and entries (the module
        docstring). A ValueError where the engine cannot keep one: a proposer that reads hidden
        states (layers `hidden`) without fork and forget, or a bounded pool too small for one request
        and two entries."""
        if not config.prefix_cache:
            return None
        if hidden and not (proposer.can_fork and proposer.can_forget):
            raise ValueError(f"EngineConfig.prefix_cache needs a proposer that reads no hidden states or has "
                             f"fork(sources, upto) and forget(rid) ({proposer.name} reads layers {hidden})")
        page = config.page_size
        pages = -(-config.max_tokens // page)
        swa_pages = -(-(config.max_swa_tokens or config.max_tokens) // page)
        if not (cfg.swa_layers and cfg.full_layers) or swa_pages >= pages:
            return cls(page, max_entries=pages)
        slack = max(config.num_draft_tokens, 1)
        per_seq, entry = cls.swa_pages(cfg, page, slack, config.num_draft_tokens + 1)
        room = swa_pages - -(-config.chunk_size // page)  # a prefill pass's chunk (cache.swa_pool_pages)
        cap = min(config.max_batch, room // (per_seq + 2 * entry))
        if cap < 1:
            raise ValueError(
                f"EngineConfig.prefix_cache with max_swa_tokens = {config.max_swa_tokens}: the sliding-window pool "
                f"holds {swa_pages} pages of {page} tokens, fewer than one request in flight ({per_seq}: its window, "
                f"slack {slack} and a step's tokens, and the window kept at its prompt's end), two entries "
                f"({entry} each) and a {config.chunk_size}-token prefill pass need: give it at least "
                f"{(swa_pages - room + per_seq + 2 * entry) * page} tokens, or None (as large as max_tokens)")
        return cls(page, max_entries=min(pages, (room - cap * per_seq) // entry), swa_slack=slack, max_running=cap)

    @staticmethod
    def swa_pages(cfg, page: int, slack: int, step_tokens: int) -> tuple[int, int]:
        """(s, e) of a bounded sliding-window pool: the most pages a request in flight holds (its
        window and slack, and a step's new pages: cache.swa_pool_pages; and the window kept at its
        prompt's end: model.keep_swa) and an entry holds (its last window and slack, and that one)."""
        held, kept = swa_pages_held(cfg, page, slack), swa_pages_held(cfg, page, 0)
        return held + -(-step_tokens // page) + kept, held + kept

    def __contains__(self, seq: int) -> bool:
        return seq in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def _touch(self, e: Entry) -> Entry:
        self.entries.move_to_end(e.seq)
        return e

    def _sharing(self, hashes: list[int], pages: int) -> list[Entry]:
        """The entries whose first `pages` whole pages hash as those of hashes (a prompt's or an
        entry's _page_hashes), newest first; the caller checks the tokens (hashes can collide)."""
        return [self.entries[s] for s in reversed(self._index.get(hashes[pages - 1], ()))]

    def match(self, prompt: list[int], logprobs: bool, experts: bool) -> tuple[Entry, int] | None:
        """The entry, with the outputs asked for, whose K/V `prompt` forks the most of, and how much:
        n = min(c - 1, F, len(prompt) - 1) for the c tokens both begin with (the module docstring),
        at least a page, or the most below that the entry can fork (Entry.fork_point); None if
        none. Of equal n, the newest. Tokens are compared past the shared pages for each candidate,
        and in full only for one that would be the best."""
        hashes = _page_hashes(prompt, self.page, len(prompt) // self.page) if self.entries else []
        best = None
        for j in range(len(hashes), 0, -1):  # the deepest page any entry shares holds the longest c
            if best is not None and best[1] >= (j + 1) * self.page - 1:
                break  # an entry first met at depth j shares c < (j + 1) * P tokens: n < that - 1
            shared = j * self.page
            for e in self._sharing(hashes, j):
                n = e.fork_point(min(_common(e.tokens, prompt, shared) - 1, e.length, len(prompt) - 1))
                if (e.has(logprobs, experts) and n >= self.page and (best is None or n > best[1])
                        and e.tokens[:shared] == prompt[:shared]):
                    best = (e, n)
        if best is not None:
            self._touch(best[0])
        return best

    def add(self, seq: int, tokens: list[int], logprobs: torch.Tensor | None, experts: torch.Tensor | None,
            in_use, forks: tuple[tuple[int, int], ...] | None = None) -> list[int]:
        """Keep sequence seq (len(tokens) - 1 tokens of K/V, forkable at the Entry.forks given;
        None: anywhere) as an entry; returns the sequences to release: seq itself where an entry
        covers it (Entry.covers; or no fork can take a page of it), else the entries it covers, but
        those in in_use (the sequences this call holds for its requests), and the least recently
        used beyond max_entries (seq itself if every other is in use)."""
        pages = len(tokens) // self.page
        forks = ((0, len(tokens) - 1),) if forks is None else forks
        if all(hi < self.page for _, hi in forks):
            return [seq]
        new = Entry(seq, list(tokens), logprobs, experts, _page_hashes(tokens, self.page, pages), forks)
        for e in self._sharing(new.hashes, pages):
            if e.covers(new):
                self._touch(e)
                return [seq]
        gone = [self.drop(e.seq).seq for j in range(1, pages + 1) for e in self._sharing(new.hashes, j)
                if len(e.tokens) // self.page == j and e.seq not in in_use and new.covers(e)]
        self.entries[seq] = new
        for h in new.hashes:
            self._index.setdefault(h, []).append(seq)
        while len(self.entries) > self.max_entries and (old := self.least_recent(in_use)) is not None:
            gone.append(self.drop(old).seq)
        return gone

    def drop_covered(self, seqs) -> None:
        """Drop those of entries seqs that another entry covers (an entry a call held while its
        requests forked it, once they are entries too)."""
        for e in [self.entries[s] for s in seqs if s in self.entries]:
            if any(o is not e and o.covers(e) for o in self._sharing(e.hashes, len(e.hashes))):
                self.drop(e.seq)

    def drop(self, seq: int) -> Entry:
        e = self.entries.pop(seq)
        for h in e.hashes:
            self._index[h].remove(seq)
            if not self._index[h]:
                del self._index[h]
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
                first: int, logprobs: bool, experts: bool
                ) -> tuple[dict[int, tuple[Entry, int]], list[tuple[int, list[int]]]]:
    """The entries a generate call forks and how many tokens of each, by rid (prompt i is rid
    first + i, group g's prefix first + len(prompts) + g), and the groups it keeps. Each prompt
    forks one prefix: its entry, or its group's (prompt_copies.shared_prefixes: (prefix length,
    prompt indices)) where that is a page longer at least (a group whose prefix would add a few
    tokens to what its prompts fork would cost a pass for them); a group left with fewer than two
    distinct prompts (keys: prompt_copies.prompt_keys) is dropped, and its prompts keep their
    entries. A group's prefix forks an entry too."""
    found = {i: hit for i, p in enumerate(prompts) if (hit := cache.match(p, logprobs, experts))}
    kept = []
    for length, members in groups:
        mine = [i for i in members if i not in found or found[i][1] + cache.page <= length]
        if len({keys[i] if keys[i] >= 0 else first + i for i in mine}) > 1:
            kept.append((length, mine))
    grouped = {i for _, members in kept for i in members}
    hits = {first + i: hit for i, hit in found.items() if i not in grouped}
    hits.update((first + len(prompts) + g, hit) for g, (length, members) in enumerate(kept)
                if (hit := cache.match(prompts[members[0]][:length], logprobs, experts)))
    return hits, kept


def fork_ranges(kv, seq) -> tuple[tuple[int, int], ...]:
    """Entry.forks of sequence seq (cache.KVCache kv, cache.SeqPages seq): a fork of its first n
    tokens reads sliding-window pages (n - W + 1) // P .. ceil(n / P) - 1, so for each run a..b-1
    of pages it holds, n from a * P + W - 1 (0 where a = 0) to b * P, at most its length."""
    if not kv.swa.k:
        return ((0, seq.length),)
    page, out, j = kv.page_size, [], 0
    while j < len(seq.swa):
        a = j
        while j < len(seq.swa) and seq.swa[j] >= 0:
            j += 1
        lo, hi = a * page + kv.window - 1 if a else 0, min(j * page, seq.length)
        if j > a and lo <= hi:
            out.append((lo, hi))
        j += 1
    return tuple(out)


def entry_outputs(cfg, r, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(log-probs of tokens 1..n, routed experts of tokens 0..n-1 on the host) of request r (a
    requests.Live), for an entry; None where the request returns none."""
    lp = torch.tensor((r.prompt_logprobs + r.logprobs)[:n], dtype=torch.float32) if r.want_logprobs else None
    experts = None
    if r.want_experts and r.experts:  # in 16 bits (ids < 256 at the released dims)
        experts = torch.cat(r.experts)[:n].to("cpu", torch.int16 if cfg.num_experts < 2**15 else torch.int32)
    return lp, experts
