"""Paged KV cache: one page pool for the full-attention layers, a bounded one for the SWA layers.

Legend: P pages in a pool, S slots per page (page_size), G kv heads, D q/k head dim,
E v head dim, L logical pages of a sequence.

Pages are shared by all layers of one kind: logical page j of a sequence is the same
physical page in every full-attention layer, so one page table per pool serves them all.
A sliding-window layer only ever reads the last `window` positions, so SWA pages wholly
behind the window go back to the free list as the sequence advances; a sequence holds at
most ceil((window - 1) / S) + 1 SWA pages between steps, however long it grows, and a step's
new pages beside them (swa_pool_pages).

Bookkeeping (free lists, page tables) is host-side and immutable: alloc / release return
new records. The page tensors are donated: steps write into them in place.

A sequence made by `fork` holds the pages its source had filled in common with it, in both
pools: a step writes only at a sequence's length, which lies past every filled page, so no one
writes a shared page again (`truncate` refuses to cut back into one). Sharing the SWA pool's
pages too keeps each pool's pages in use no more than the full pool's, which is what lets the
full pool's admission cover a SWA pool at least as large (swa_seq_limit).

A DFlash draft model and the MTP layers keep their K/V in a KVCache of their own
(speculative/context_cache.py): its layers all in the full-attention pool, no sliding-window pool, pages
that grow with demand (grow) where the target's are fixed, and sequences that hold pages past
their length (room for the next drafts, which the draft writes and reads past its context).
"""

import math
from array import array
from dataclasses import dataclass, field, replace

import torch

from mimo_fn._types import typed
from mimo_fn.config import ModelConfig


class OutOfPages(ValueError):
    """A step needs more KV pages than are free. Nothing was changed: the caller may release
    sequences or shrink the batch and try again."""


@dataclass(frozen=True)
class Pool:
    k: tuple[torch.Tensor, ...]  # per layer of this kind: [P, S, G, D]
    v: tuple[torch.Tensor, ...]  # per layer of this kind: [P, S, G, E]
    free: tuple[int, ...]  # free physical pages; allocation takes from the end
    # pages that several sequences hold -> how many (copies of a prompt share the full-attention
    # pages it filled: fork); such a page is free again once its last holder gives it back.
    # Replaced, never changed in place, like `free`
    holders: dict[int, int] = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0] if self.k else 0


# Tokens per page. 128 lets one page hold a whole key block of the Triton attention kernels
# (128 keys for full attention, 32 for the window), so each K/V tile sits at one address that
# is read a block ahead, instead of a per-row gather through the page table: on an H200 at
# 32K tokens, full attention 1.18x and sliding-window 1.17x faster than pages of 16
# (docs/benchmarks.md). Fragmentation stays below one page per sequence.
DEFAULT_PAGE_SIZE = 128


@dataclass(frozen=True)
class SeqPages:
    length: int  # tokens in the cache
    full: tuple[int, ...]  # physical full-pool page of each logical page
    swa: tuple[int, ...]  # physical SWA-pool page of each logical page, -1 once freed
    # logical SWA pages [lo, hi) that stay when they fall behind the window (keep_swa: the window
    # of the point a prefix cache entry is forked at, its prompt's end)
    keep: tuple[int, int] = (0, 0)


class PageTables:
    """Page tables packed from page tuples, with each tuple's int32 row kept for the next step.

    A sequence's page tuple is replaced, not edited, when its pages change (once every page of
    tokens at decode), so most rows of a step's tables are the same objects as the step
    before: their bytes are reused, found by identity (the entry holds the tuple, so its id
    cannot be reused meanwhile). At 64 sequences x 256 pages a table took 0.42 ms to pack from
    the tuples on one CPU core, and 0.01 ms from these rows. Only the last step's rows are
    kept, so the memo never outgrows two tables. A KVCache
    owns one (KVCache.page_tables), shared by the records a step derives from it; a hit is
    checked against the tuple itself, so sharing never returns a stale row.
    """

    def __init__(self):
        self._last: dict[int, tuple[tuple[int, ...], bytes]] = {}

    def __call__(self, tables: list[list[tuple[int, ...]]], width: int) -> list[torch.Tensor]:
        """Per table, a list of page tuples (one per sequence) -> int32 [B, width], -1 padded."""
        last, now = self._last, {}
        self._last = now
        out = []
        for rows in tables:
            if width == 0:  # frombuffer refuses an empty buffer
                out.append(torch.zeros(len(rows), 0, dtype=torch.int32))
                continue
            parts = []
            for pages in rows:
                key = id(pages)
                hit = last.get(key)
                if hit is None or hit[0] is not pages:
                    hit = now.get(key) or (pages, array("i", pages).tobytes())
                now[key] = hit
                parts.append(hit[1])
                if len(pages) < width:
                    parts.append(b"\xff\xff\xff\xff" * (width - len(pages)))  # int32 -1, either byte order
            out.append(torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.int32).view(len(rows), width))
        return out


@dataclass(frozen=True)
class KVCache:
    page_size: int
    window: int  # sliding window of the SWA layers
    full: Pool
    swa: Pool
    full_layer_slot: tuple[int, ...]  # per model layer: index into full.k/v, or -1
    swa_layer_slot: tuple[int, ...]  # per model layer: index into swa.k/v, or -1
    # SWA pages are kept this many tokens longer than the window needs, so `truncate` can take
    # back up to this many tokens (speculative decoding drops the drafts the target rejects)
    swa_slack: int = 0
    # the packed page-table rows of the last step (batch.step_meta): a host-side memo that the
    # records derived from this one (extend, advance, ...) share; not part of the cache's state
    page_tables: PageTables = field(default_factory=PageTables, compare=False, repr=False)


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one page of the full pool and of the SWA pool (all layers of that kind)."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_head = page_size * (cfg.head_dim + cfg.v_head_dim) * elt
    return (len(cfg.full_layers) * cfg.num_kv_heads * per_head,
            len(cfg.swa_layers) * cfg.num_swa_kv_heads * per_head)


def swa_pages_held(cfg: ModelConfig, page_size: int, slack: int = 0) -> int:
    """Most SWA pages a sequence holds between steps: those of its last window + slack tokens."""
    return math.ceil((cfg.sliding_window + slack - 1) / page_size) + 1


def swa_pool_pages(cfg: ModelConfig, page_size: int, seqs: int, chunk: int, slack: int = 0,
                   step_tokens: int = 1) -> int:
    """SWA pages that `seqs` sequences in flight can hold at once: each its window and slack
    (swa_pages_held) and the pages a step adds to it, and once the pages of a prefill pass's
    `chunk` tokens. A step allocates a sequence's new pages before it frees those that fall
    behind: t new tokens take at most ceil(t / S) pages, so a decode or verify step (step_tokens
    each) adds seqs * ceil(step_tokens / S), and a prefill pass, whose tokens the scheduler's
    budget keeps to chunk among all its sequences, at most ceil(chunk / S) + seqs."""
    return (seqs * (swa_pages_held(cfg, page_size, slack) + math.ceil(step_tokens / page_size))
            + math.ceil(chunk / page_size))


def swa_seq_limit(cfg: ModelConfig, cache: KVCache, chunk: int, step_tokens: int = 1) -> int | None:
    """Most sequences that can be in flight at once (a prefill pass running at most `chunk`
    tokens among them, a decode step step_tokens each) without running the sliding-window pool
    dry (swa_pool_pages); None when it cannot run dry first: a sequence's SWA pages cover some of
    the positions its full-attention pages do, so a SWA pool at least as large as the full pool
    is covered by the full pool's admission. A ValueError when the pool holds less than one
    sequence needs."""
    swa, full, page = cache.swa, cache.full, cache.page_size
    if not swa.k or not full.k or swa.num_pages >= full.num_pages:
        return None
    need = swa_pool_pages(cfg, page, 1, chunk, cache.swa_slack, step_tokens)
    if swa.num_pages < need:
        raise ValueError(
            f"the sliding-window KV pool holds {swa.num_pages} pages of {page} tokens, fewer than the {need} one "
            f"sequence in flight can hold (window {cfg.sliding_window} + slack {cache.swa_slack} tokens, "
            f"page-rounded, + 1 page; a step's {step_tokens} tokens; a {chunk}-token prefill pass): give it at "
            f"least {need * page} tokens (EngineConfig.max_swa_tokens)")
    return (swa.num_pages - math.ceil(chunk / page)) // (swa_pages_held(cfg, page, cache.swa_slack)
                                                          + math.ceil(step_tokens / page))


@typed
def capacity(
    cfg: ModelConfig, nbytes: int, page_size: int = DEFAULT_PAGE_SIZE, dtype: torch.dtype = torch.bfloat16,
    max_seqs: int = 8, chunk: int = 16384, swa_slack: int = 0,
) -> tuple[int, int]:
    """(full pages, SWA pages) that fit in `nbytes`: the SWA pool sized for max_seqs sequences in
    flight, prefill passes of `chunk` tokens among them (swa_pool_pages; and keeping swa_slack
    tokens more), the full pool gets the rest."""
    full_b, swa_b = page_bytes(cfg, page_size, dtype)
    swa_pages = swa_pool_pages(cfg, page_size, max_seqs, chunk, swa_slack) if swa_b else 0
    if swa_pages * swa_b > nbytes:
        raise ValueError(f"capacity: {nbytes} bytes hold fewer than the {swa_pages} SWA pages that "
                         f"max_seqs={max_seqs} sequences at chunk={chunk} need ({swa_b} bytes each)")
    return (nbytes - swa_pages * swa_b) // full_b if full_b else 0, swa_pages


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can still get on `device`: the driver's free memory plus what
    torch's caching allocator holds unused; None off CUDA (no check there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def pool_page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tp: int = 1) -> tuple[int, int]:
    """Bytes of one page of each pool on a rank: under attention TP it keeps heads // tp KV heads
    of each kind (at least one: the head its query heads read)."""
    full_b, swa_b = page_bytes(cfg, page_size, dtype)
    return (full_b // cfg.num_kv_heads * max(1, cfg.num_kv_heads // tp),
            swa_b // cfg.num_swa_kv_heads * max(1, cfg.num_swa_kv_heads // tp))


def _check_room(cfg: ModelConfig, full_pages: int, swa_pages: int, page_size: int, dtype: torch.dtype,
                device: torch.device, tp: int) -> None:
    """A ValueError with the sizes, before a cache that cannot fit is allocated (rather than an
    out-of-memory error from the middle of the allocation)."""
    free = free_bytes(device)
    if free is None:
        return
    full_b, swa_b = pool_page_bytes(cfg, page_size, dtype, tp)
    need = full_pages * full_b + swa_pages * swa_b
    if need <= free:
        return
    fits = (free - swa_pages * swa_b) // full_b * page_size if full_b and free > swa_pages * swa_b else 0
    raise ValueError(
        f"the KV cache ({full_pages} full-attention pages + {swa_pages} sliding-window pages of {page_size} tokens) "
        f"needs {need / 2**30:.2f} GiB on {device}, which has {free / 2**30:.2f} GiB free: lower max_tokens "
        f"(about {fits} tokens fit beside this sliding-window pool) or max_swa_tokens, or free memory first")


def init_pool(num_layers: int, num_pages: int, page_size: int, heads: int, k_dim: int, v_dim: int,
              dtype: torch.dtype, device: str | torch.device) -> Pool:
    """A pool of num_pages pages, all free, for num_layers layers of `heads` KV heads."""
    k = tuple(torch.empty(num_pages, page_size, heads, k_dim, dtype=dtype, device=device) for _ in range(num_layers))
    v = tuple(torch.empty(num_pages, page_size, heads, v_dim, dtype=dtype, device=device) for _ in range(num_layers))
    return Pool(k, v, tuple(range(num_pages - 1, -1, -1)) if num_layers else ())


def init_cache(
    cfg: ModelConfig, num_full_pages: int, num_swa_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", tp: int = 1, swa_slack: int = 0,
) -> KVCache:
    """Empty pools. Under attention TP a rank keeps only its KV heads: heads / tp of them, or
    the one head its query heads read when tp exceeds the heads."""
    if page_size <= 0:
        raise ValueError(f"page_size = {page_size}: expected a positive int")
    if swa_slack < 0:
        raise ValueError(f"swa_slack = {swa_slack}: expected an int >= 0")
    _check_room(cfg, num_full_pages, num_swa_pages, page_size, dtype, torch.device(device), tp)
    full_heads, swa_heads = max(1, cfg.num_kv_heads // tp), max(1, cfg.num_swa_kv_heads // tp)

    def pool(layers: tuple[int, ...], pages: int, heads: int) -> Pool:
        if layers and pages <= 0:
            raise ValueError(f"cache pool for {len(layers)} layers needs pages > 0, got {pages}")
        return init_pool(len(layers), pages, page_size, heads, cfg.head_dim, cfg.v_head_dim, dtype, device)

    def slots(layers: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(layers.index(i) if i in layers else -1 for i in range(cfg.num_layers))

    return KVCache(page_size, cfg.sliding_window, pool(cfg.full_layers, num_full_pages, full_heads),
                   pool(cfg.swa_layers, num_swa_pages, swa_heads), slots(cfg.full_layers), slots(cfg.swa_layers),
                   swa_slack)


def _first_live_swa_page(length: int, window: int, page_size: int) -> int:
    """The first logical page a query at position >= length can still read."""
    return max(0, length - window + 1) // page_size


def pages_needed(cache: KVCache, seq: SeqPages, num_new: int) -> tuple[int, int]:
    """(full, SWA) pages a sequence must allocate to append num_new tokens (none where it holds
    that room already: a draft context's sequence holds pages past its length)."""
    more = max(0, math.ceil((seq.length + num_new) / cache.page_size) - len(seq.full))
    return (more if cache.full.k else 0, more if cache.swa.k else 0)


def extend(cache: KVCache, seqs: dict[int, SeqPages], new_tokens: dict[int, int]) -> tuple[KVCache, dict[int, SeqPages]]:
    """Allocate the pages that appending new_tokens[sid] tokens to each sequence needs.

    All or nothing: raises OutOfPages, changing nothing, if either pool falls short.
    """
    need_full = need_swa = 0
    for sid, n in new_tokens.items():
        f, s = pages_needed(cache, seqs.get(sid, SeqPages(0, (), ())), n)
        need_full, need_swa = need_full + f, need_swa + s
    for name, need, pool in (("full-attention", need_full, cache.full), ("sliding-window", need_swa, cache.swa)):
        if need > len(pool.free):
            raise OutOfPages(f"{name} KV pool: this step needs {need} more pages of {cache.page_size} tokens, "
                             f"{len(pool.free)} of {pool.num_pages} are free")
    seqs = dict(seqs)
    if need_full == need_swa == 0 and all(sid in seqs for sid in new_tokens):
        return cache, seqs  # most decode steps: every sequence still has room in its last page
    full_free, swa_free = list(cache.full.free), list(cache.swa.free)
    for sid, n in new_tokens.items():
        seq = seqs.get(sid, SeqPages(0, (), ()))
        f, s = pages_needed(cache, seq, n)
        new_full = tuple(full_free.pop() for _ in range(f))
        new_swa = tuple(swa_free.pop() for _ in range(s))
        if not cache.full.k:  # model without full layers: keep logical page counts in step
            new_full = (-1,) * s
        if not cache.swa.k:
            new_swa = (-1,) * f
        seqs[sid] = replace(seq, full=seq.full + new_full, swa=seq.swa + new_swa)
    cache = replace(cache, full=replace(cache.full, free=tuple(full_free)),
                    swa=replace(cache.swa, free=tuple(swa_free)))
    return cache, seqs


def advance(cache: KVCache, seqs: dict[int, SeqPages], new_tokens: dict[int, int]) -> tuple[KVCache, dict[int, SeqPages]]:
    """Record that the new tokens are written, and return SWA pages now wholly behind the window."""
    seqs = dict(seqs)
    freed = []
    for sid, n in new_tokens.items():
        seq = seqs[sid]
        length = seq.length + n
        first_live = _first_live_swa_page(max(0, length - cache.swa_slack), cache.window, cache.page_size)
        # pages before the previous first live page went back already (advance and truncate keep
        # every page behind the window at -1, but the kept ones): look only at those that fell
        # behind in this step, not at the whole dead prefix (255 pages of a 32K-token sequence)
        was_live = _first_live_swa_page(max(0, seq.length - cache.swa_slack), cache.window, cache.page_size)
        swa, (lo, hi) = seq.swa, seq.keep
        behind = [j for j in range(was_live, first_live) if swa[j] >= 0 and not lo <= j < hi]
        if behind:  # pages that fell behind the window go back to the pool
            freed += [swa[j] for j in behind]
            swa = swa[:was_live] + tuple(-1 if j in behind else swa[j] for j in range(was_live, first_live)) \
                + swa[first_live:]
        seqs[sid] = SeqPages(length, seq.full, swa, seq.keep)  # (not replace: 2x slower, every step)
    if not freed:
        return cache, seqs
    return replace(cache, swa=_give_back(cache.swa, freed)), seqs


def truncate(
    cache: KVCache, seqs: dict[int, SeqPages], lengths: dict[int, int]
) -> tuple[KVCache, dict[int, SeqPages]]:
    """Take sequences back to shorter lengths: pages wholly past a new length go back to the
    free lists (the K/V left in the last page's tail is overwritten by the next step).

    All or nothing: a ValueError, changing nothing, if a length is not in [0, current], if the
    sliding-window pages the shorter sequence reads again were freed already (keep them with
    swa_slack), or if its next write would land in a page it shares with a fork."""
    page = cache.page_size
    for sid, n in lengths.items():
        seq = seqs[sid]
        if not 0 <= n <= seq.length:
            raise ValueError(f"truncate: sequence {sid} has {seq.length} tokens, cannot take it to {n}")
        if n % page and (seq.full[n // page] in cache.full.holders or seq.swa[n // page] in cache.swa.holders):
            raise ValueError(f"truncate: sequence {sid} cannot go back to {n} tokens: page {n // page} holds "
                             "K/V it shares with a fork (mf.fork), which its next step would overwrite")
        first_live = _first_live_swa_page(n, cache.window, page)
        keep = -(-n // page)
        if cache.swa.k and any(p < 0 for p in seq.swa[first_live:keep]):
            # live SWA pages run from the first kept one to the end; a length n reads back to
            # position n - window + 1, so that page must be kept
            kept = max((i for i, p in enumerate(seq.swa) if p < 0), default=-1) + 1  # the last run of live pages
            raise ValueError(f"truncate: sequence {sid} ({seq.length} tokens) cannot go back to {n}: the "
                             f"sliding-window pages it would read again are freed; it can go back to "
                             f"{kept * cache.page_size + cache.window - 1} tokens at the least (swa_slack = "
                             f"{cache.swa_slack} tokens of history, counted from the longest the sequence has been)")
    full_gone, swa_gone = [], []
    seqs = dict(seqs)
    for sid, n in lengths.items():
        seq = seqs[sid]
        keep = -(-n // page)
        full_gone += seq.full[keep:] if cache.full.k else ()
        swa_gone += seq.swa[keep:] if cache.swa.k else ()
        lo, hi = seq.keep
        seqs[sid] = SeqPages(n, seq.full[:keep], seq.swa[:keep], (min(lo, keep), min(hi, keep)))
    return replace(cache, full=_give_back(cache.full, full_gone), swa=_give_back(cache.swa, swa_gone)), seqs


def fork(
    cache: KVCache, seqs: dict[int, SeqPages], sources: dict[int, int], upto: dict[int, int] | None = None
) -> tuple[KVCache, dict[int, SeqPages]]:
    """Sequences dst catch up with sources[dst], as if dst had prefilled the source's tokens
    past its own length itself: all of them, or the first upto[dst]. dst's tokens so far must be
    a prefix of its source's (the caller's promise; a new dst has none). In each pool dst holds
    the pages the source has filled in common with it (no copy; the module docstring says why
    that is safe), the SWA pool's only where the source still holds them (none behind the
    window). The source's last page, if partly filled, is copied into a page of dst's own, and
    so is dst's own partly filled page, whose earlier slots get the source's K/V of the same
    tokens. So a copy holds no more pages of either pool than its own tokens fill. All or
    nothing: OutOfPages, or a ValueError where the source no longer holds the sliding-window
    pages dst's window needs (a point far behind the source's length), changes nothing."""
    page = cache.page_size
    pools = (("full", cache.full), ("swa", cache.swa))
    lengths = {dst: (seqs[dst].length if dst in seqs else 0) for dst in sources}
    ends = {dst: (upto or {}).get(dst, seqs[src].length) for dst, src in sources.items()}
    new_tokens = {dst: ends[dst] - lengths[dst] for dst in sources}
    span = {}  # dst -> (its first new logical page, the first it does not share, the logical pages it ends with)
    need = dict.fromkeys(("full", "swa"), 0)
    for dst, src in sources.items():
        length = ends[dst]
        have, want = len(seqs[dst].swa) if dst in seqs else 0, -(-length // page)
        live = seqs[src].swa[max(have, _first_live_swa_page(length, cache.window, page)):want]
        if cache.swa.k and any(p < 0 for p in live):
            raise ValueError(f"fork: sequence {src} ({seqs[src].length} tokens) no longer holds the sliding-window "
                             f"pages {dst} needs at {length} tokens")
        span[dst] = (have, max(have, min(want, length // page)), max(have, want))
        for kind, _ in pools:  # a pool without layers holds -1 placeholders: they count for nothing
            need[kind] += sum(p >= 0 for p in getattr(seqs[src], kind)[span[dst][1]:want])
    for kind, pool in pools:
        if need[kind] > len(pool.free):
            raise OutOfPages(f"{'full-attention' if kind == 'full' else 'sliding-window'} KV pool: this fork "
                             f"needs {need[kind]} more pages of {page} tokens, {len(pool.free)} of "
                             f"{pool.num_pages} are free")
    seqs = dict(seqs)
    for kind, pool in pools:
        free, holders = list(pool.free), dict(pool.holders)
        for dst, src in sources.items():
            (have, own, want), table = span[dst], getattr(seqs[src], kind)
            for p in table[have:own]:
                if p >= 0:
                    holders[p] = holders.get(p, 1) + 1
            fresh = tuple(free.pop() if p >= 0 else -1 for p in table[own:want])
            seq = seqs.get(dst, SeqPages(0, (), ()))
            seqs[dst] = replace(seq, **{kind: getattr(seq, kind) + table[have:own] + fresh})
        cache = replace(cache, **{kind: replace(pool, free=tuple(free), holders=holders)})
        pairs = [(s, d) for dst, src in sources.items()
                 for j, (s, d) in enumerate(zip(getattr(seqs[src], kind), getattr(seqs[dst], kind)))
                 if j >= lengths[dst] // page and s >= 0 and d >= 0 and s != d]  # s == d: held in common
        if pairs:
            src_P, dst_P = torch.tensor(pairs, device=pool.k[0].device).T
            for t in pool.k + pool.v:
                t.index_copy_(0, dst_P, t.index_select(0, src_P))
    return advance(cache, seqs, new_tokens)


def keep_swa(cache: KVCache, seqs: dict[int, SeqPages], points: dict[int, int]) -> dict[int, SeqPages]:
    """Sequences sid keep the sliding-window pages a fork at points[sid] tokens reads (those of
    tokens points[sid] - window + 1 .. points[sid] - 1) when they fall behind the window, until
    released: a prefix cache entry can then be forked at its prompt's end (mimo_fn.engine.prefix_cache).
    One such point a sequence, set while its pages are still held; a ValueError changes nothing."""
    page, out = cache.page_size, dict(seqs)
    for sid, n in points.items():
        seq = seqs[sid]
        lo, hi = max(0, n - cache.window + 1) // page, -(-n // page)
        if not 0 < n <= seq.length or seq.keep != (0, 0) or (cache.swa.k and any(p < 0 for p in seq.swa[lo:hi])):
            raise ValueError(f"keep_swa: sequence {sid} ({seq.length} tokens, keeping pages {seq.keep}) cannot keep "
                             f"the sliding-window pages of a fork at {n} tokens: a point in [1, its length] whose "
                             "pages it still holds, once")
        out[sid] = replace(seq, keep=(lo, hi))
    return out


def _give_back(pool: Pool, pages) -> Pool:
    """Pages that a sequence drops (-1 entries skipped): a shared one loses a holder, the rest are free."""
    pages = [p for p in pages if p >= 0]
    if not pages:
        return pool
    if not pool.holders:
        return replace(pool, free=pool.free + tuple(pages))
    holders, free = dict(pool.holders), []
    for p in pages:
        n = holders.pop(p, 1)
        if n > 2:
            holders[p] = n - 1
        elif n == 1:
            free.append(p)
        # n == 2: the other holder keeps it, now alone
    return replace(pool, free=pool.free + tuple(free), holders=holders)


def release_seq(cache: KVCache, seq: SeqPages) -> KVCache:
    """Give back every page a sequence holds (a shared one is free once its last holder lets go)."""
    return replace(cache, full=_give_back(cache.full, seq.full if cache.full.k else ()),
                   swa=_give_back(cache.swa, seq.swa if cache.swa.k else ()))
