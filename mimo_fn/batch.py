"""Batch: the next chunk of each sequence, flattened; StepMeta: what one paged step needs.

Legend: T tokens of the batch, B sequences, L logical pages (longest page table).
"""

from dataclasses import dataclass
from typing import Sequence

import torch

from mimo_fn.cache import KVCache, SeqPages


@dataclass(frozen=True)
class Batch:
    seq_ids: tuple[int, ...]  # one entry per sequence, no repeats
    tokens_T: torch.Tensor  # int64 [T]: the sequences' chunks, concatenated in seq_ids order
    lens: tuple[int, ...]  # chunk length per sequence

    @classmethod
    def from_tokens(cls, seq_ids: Sequence[int], tokens: Sequence[Sequence[int] | torch.Tensor]) -> "Batch":
        seq_ids = tuple(int(s) for s in seq_ids)
        if len(seq_ids) != len(tokens):
            raise ValueError(f"Batch.from_tokens: {len(seq_ids)} seq_ids but {len(tokens)} token lists")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"Batch.from_tokens: seq_ids {list(seq_ids)} repeat an id; one chunk per sequence")
        chunks = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in tokens]
        for sid, c in zip(seq_ids, chunks):
            if c.numel() == 0:
                raise ValueError(f"Batch.from_tokens: sequence {sid} has an empty chunk")
        flat = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.long)
        return cls(seq_ids, flat, tuple(c.numel() for c in chunks))

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [B+1] offsets of each sequence's chunk in tokens_T. Positions and prefix
        lengths depend on the cache, so prefill / decode resolve them (StepMeta)."""
        return torch.tensor([0, *self.lens]).cumsum(0).to(torch.int32)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_T.shape[0])

    def to(self, device: str | torch.device) -> "Batch":
        return Batch(self.seq_ids, self.tokens_T.to(device), self.lens)


@dataclass(frozen=True)
class StepMeta:
    """Attention metadata of one step (after the step's pages are allocated)."""

    pos_T: torch.Tensor  # int64 [T] absolute position of each token
    cu_q_B1: torch.Tensor  # int32 [B+1] query offsets
    kv_lens_B: torch.Tensor  # int32 [B] tokens in cache per sequence, this chunk included
    full_table_BL: torch.Tensor  # int32 [B, L] full-pool page table (-1 padded)
    swa_table_BL: torch.Tensor  # int32 [B, L] SWA-pool page table (-1 where freed / padded)
    full_slot_T: torch.Tensor  # int64 [T] flat slot (page * S + offset) in the full pool
    swa_slot_T: torch.Tensor  # int64 [T] flat slot in the SWA pool
    max_q_len: int


def step_meta(batch: Batch, prior: dict[int, SeqPages], seqs: dict[int, SeqPages], cache: KVCache,
              device: torch.device) -> StepMeta:
    """prior: page records before the step (for prefix lengths); seqs: after allocation."""
    page_size = cache.page_size
    pos, full_slot, swa_slot, kv_lens = [], [], [], []
    num_pages = max((len(seqs[s].full) for s in batch.seq_ids), default=0)
    full_table = torch.full((len(batch.seq_ids), num_pages), -1, dtype=torch.int32)
    swa_table = torch.full((len(batch.seq_ids), num_pages), -1, dtype=torch.int32)
    for b, (sid, n) in enumerate(zip(batch.seq_ids, batch.lens)):
        start = prior[sid].length if sid in prior else 0
        seq = seqs[sid]
        p = torch.arange(start, start + n)
        full_pages = torch.tensor(seq.full, dtype=torch.long)
        swa_pages = torch.tensor(seq.swa, dtype=torch.long)
        pos.append(p)
        full_slot.append(full_pages[p // page_size] * page_size + p % page_size)
        swa_slot.append(swa_pages[p // page_size] * page_size + p % page_size)
        kv_lens.append(start + n)
        full_table[b, :len(seq.full)] = full_pages.to(torch.int32)
        swa_table[b, :len(seq.swa)] = swa_pages.to(torch.int32)
    if not batch.seq_ids:  # a zero-token step of an idle DP group
        pos, full_slot, swa_slot = ([torch.zeros(0, dtype=torch.long)] for _ in range(3))
    return StepMeta(
        pos_T=torch.cat(pos).to(device), cu_q_B1=batch.cu_seqlens.to(device),
        kv_lens_B=torch.tensor(kv_lens, dtype=torch.int32).to(device),
        full_table_BL=full_table.to(device), swa_table_BL=swa_table.to(device),
        full_slot_T=torch.cat(full_slot).to(device), swa_slot_T=torch.cat(swa_slot).to(device),
        max_q_len=max(batch.lens, default=0),
    )
