"""The K/V caches of draft models (mimo_fn.speculative.dflash, mtp): cache.py's paged pools with
no pages to start with, grown (at least doubled) whenever a step needs more than are free.

Growing makes new page tensors: whatever captured the old ones' addresses (the drafts' CUDA
graphs) must capture again, which the flag of ensure_free / extend_growing says.
"""

from dataclasses import replace

import torch

from mimo_fn.cache import KVCache, Pool, SeqPages, extend, init_pool, pages_needed


def init_context_cache(num_layers: int, page_size: int, heads: int, head_dim: int, dtype: torch.dtype,
                       device: str | torch.device, v_dim: int | None = None) -> KVCache:
    """An empty cache with no pages yet (grow adds them) for num_layers layers of a draft model
    (mimo_fn.speculative.dflash, mtp), values of v_dim (head_dim by default). Its layers are the
    full pool's; there is no sliding-window pool (an MTP layer's window is its attention call's)."""
    full = init_pool(num_layers, 0, page_size, heads, head_dim, head_dim if v_dim is None else v_dim, dtype, device)
    return KVCache(page_size, 0, full, Pool((), (), ()), tuple(range(num_layers)), (-1,) * num_layers)  # window: unused


def grow(cache: KVCache, num_pages: int) -> KVCache:
    """The cache with num_pages pages in its full pool (more than it has): new page tensors that
    hold its pages under the same ids, the new pages free and taken first. The old tensors (and
    anything holding their addresses: CUDA graphs) are the caller's to drop."""
    pool = cache.full
    old = pool.num_pages
    assert num_pages > old and not cache.swa.k

    def grown(t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(num_pages, *t.shape[1:])
        out[:old] = t
        return out

    return replace(cache, full=replace(pool, k=tuple(map(grown, pool.k)), v=tuple(map(grown, pool.v)),
                                       free=pool.free + tuple(range(num_pages - 1, old - 1, -1))))


def ensure_free(cache: KVCache, pages: int) -> tuple[KVCache, bool]:
    """A context cache (init_context_cache) with at least `pages` free pages: grown, at least
    doubled, where it has fewer. The flag says whether it grew: its tensors are new then, so
    whatever captured their addresses (CUDA graphs) must capture again."""
    free, old = len(cache.full.free), cache.full.num_pages
    if pages <= free:
        return cache, False
    return grow(cache, max(2 * old, old + pages - free)), True


def extend_growing(cache: KVCache, seqs: dict[int, SeqPages],
                   new_tokens: dict[int, int]) -> tuple[KVCache, dict[int, SeqPages], bool]:
    """extend on a context cache that grows (ensure_free) to fit first; the flag as ensure_free's."""
    need = sum(pages_needed(cache, seqs.get(sid, SeqPages(0, (), ())), n)[0] for sid, n in new_tokens.items())
    cache, grown = ensure_free(cache, need)
    cache, seqs = extend(cache, seqs, new_tokens)
    return cache, seqs, grown
