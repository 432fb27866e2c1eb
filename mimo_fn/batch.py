"""Batch: the next chunk of each sequence, flattened; StepMeta: what one paged step needs.

Legend: T tokens of the batch, B sequences, L logical pages (longest page table).
"""

import array
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from mimo_fn.cache import KVCache, SeqPages
from mimo_fn.upload import upload


@dataclass(frozen=True)
class Batch:
    seq_ids: tuple[int, ...]  # one entry per sequence, no repeats
    tokens_T: torch.Tensor  # int64 [T]: the sequences' chunks, concatenated in seq_ids order
    lens: tuple[int, ...]  # chunk length per sequence
    # tokens the engine sampled itself (argmax or a draw over the vocabulary, so in range):
    # prefill skips checking them, a check that would read them on the host and so wait for
    # the step that samples them (EngineConfig.overlap feeds them to the next step unread)
    sampled: bool = False
    # bool [T] on the model's device, or None (all): the rows the MoE layers route. A verify step
    # feeds every request the same block of rows (one CUDA graph); the drafts past a proposer's
    # confidence cut (speculative.draft_cut) get no expert, so their rows read no expert weights,
    # and nothing reads their logits. Honoured on one rank (elsewhere every row is routed).
    moe_rows_T: torch.Tensor | None = None

    def __post_init__(self):
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"Batch: seq_ids {list(self.seq_ids)} repeat an id; one chunk per sequence")

    @classmethod
    def from_tokens(cls, seq_ids: Sequence[int], tokens: Sequence[Sequence[int] | torch.Tensor]) -> "Batch":
        seq_ids = tuple(int(s) for s in seq_ids)
        if len(seq_ids) != len(tokens):
            raise ValueError(f"Batch.from_tokens: {len(seq_ids)} seq_ids but {len(tokens)} token lists")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"Batch.from_tokens: seq_ids {list(seq_ids)} repeat an id; one chunk per sequence")
        if tokens and all(isinstance(t, (list, tuple)) and set(map(type, t)) <= {int} for t in tokens):
            # lists of plain ints (every step the engine runs; a bool, a float or a nested chunk
            # takes the general path and its checks): one tensor for the batch, through an int64
            # array, 3x faster than torch.tensor of the list (16K tokens: ~2 ms against ~6)
            lens = tuple(len(t) for t in tokens)
            try:
                flat = torch.frombuffer(array.array("q", itertools.chain.from_iterable(tokens)), dtype=torch.long) \
                    if sum(lens) else torch.zeros(0, dtype=torch.long)
            except OverflowError:  # beyond int64: the general path says what is wrong
                flat = None
            if flat is not None:
                empty = next((sid for sid, n in zip(seq_ids, lens) if n == 0), None)
                if empty is not None:
                    raise ValueError(f"Batch.from_tokens: sequence {empty} has an empty chunk")
                return cls(seq_ids, flat, lens)
        chunks = [torch.as_tensor(t).reshape(-1) for t in tokens]
        for sid, c in zip(seq_ids, chunks):
            if c.numel() == 0:
                raise ValueError(f"Batch.from_tokens: sequence {sid} has an empty chunk")
            if c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool:
                raise ValueError(f"Batch.from_tokens: sequence {sid}'s tokens are {c.dtype}; expected int token ids")
        chunks = [c.long() for c in chunks]
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
        rows = None if self.moe_rows_T is None else self.moe_rows_T.to(device)
        return Batch(self.seq_ids, self.tokens_T.to(device), self.lens, self.sampled, rows)


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


DEVICE_SLOTS_MIN = 1024  # tokens from which a CUDA step's positions and slots are computed on the GPU
HOST_LOOP_MAX = 256  # tokens up to which a host step's positions and slots come from a Python loop


def _positions_and_slots_loop(starts: list[int], lens: tuple[int, ...], recs: list[SeqPages],
                              page_size: int) -> torch.Tensor:
    """int64 [3, T]: _positions_and_slots' (pos_T, full_slot_T, swa_slot_T) by a loop over the
    tokens. For a decode or verify step's few tokens it takes microseconds where the dozen whole-
    batch tensor ops take ~0.15-0.3 ms on one CPU core (each op's fixed cost), host time a verify
    step cannot hide."""
    pos, full, swa = array.array("q"), array.array("q"), array.array("q")
    for start, n, r in zip(starts, lens, recs):
        for p in range(start, start + n):
            page, offset = divmod(p, page_size)
            pos.append(p)
            full.append(r.full[page] * page_size + offset)
            swa.append(r.swa[page] * page_size + offset)
    return torch.frombuffer(pos + full + swa, dtype=torch.long).view(3, -1)


def _positions_and_slots(start_B, len_B, cu_B1, full_BL, swa_BL, num_tokens: int, page_size: int):
    """(pos_T, full_slot_T, swa_slot_T) from the per-sequence starts, lengths and page tables, by
    whole-batch tensor ops on whichever device they live on (no step waits for the GPU: the
    repeat's output size is given)."""
    seq_T = torch.repeat_interleave(torch.arange(len_B.shape[0], device=len_B.device), len_B,
                                    output_size=num_tokens)  # which sequence each token is of
    pos_T = start_B[seq_T] + torch.arange(num_tokens, device=len_B.device) - cu_B1[:-1].long()[seq_T]
    page_T, offset_T = pos_T // page_size, pos_T % page_size
    full_slot_T = full_BL[seq_T, page_T].long() * page_size + offset_T
    swa_slot_T = swa_BL[seq_T, page_T].long() * page_size + offset_T
    return pos_T, full_slot_T, swa_slot_T


def step_meta(batch: Batch, prior: dict[int, SeqPages], seqs: dict[int, SeqPages], cache: KVCache,
              device: torch.device, slots_on_device: bool | None = None) -> StepMeta:
    """prior: page records before the step (for prefix lengths); seqs: after allocation.
    Built with a few whole-batch tensor ops (no per-sequence ones): at decode this runs on the
    host every step, for every sequence. The page tables come packed by the cache's
    `page_tables`, which reuses the rows of page tuples the step before also had.
    slots_on_device (None: on CUDA from DEVICE_SLOTS_MIN tokens): per-token positions and slots
    computed on the device from the uploaded tables, not on the host and uploaded. A prefill
    chunk's host ops over its tokens otherwise run between two passes while the GPU idles
    (a 16K-token chunk: ~12 ms of host time a pass on the H200's host, py-spy)."""
    page_size, ids = cache.page_size, batch.seq_ids
    device = torch.device(device)
    if not ids:  # a zero-token step of an idle DP group
        empty = torch.zeros(0, dtype=torch.long, device=device)
        table = torch.zeros(0, 0, dtype=torch.int32, device=device)
        return StepMeta(empty, batch.cu_seqlens.to(device), torch.zeros(0, dtype=torch.int32, device=device),
                        table, table, empty, empty, 0)
    if slots_on_device is None:
        slots_on_device = device.type == "cuda" and batch.num_tokens >= DEVICE_SLOTS_MIN
    recs = [seqs[s] for s in ids]
    width = max(len(r.full) for r in recs)
    full_BL, swa_BL = cache.page_tables([[r.full for r in recs], [r.swa for r in recs]], width)
    starts = [prior[s].length if s in prior else 0 for s in ids]
    if not slots_on_device and batch.num_tokens <= HOST_LOOP_MAX:
        cu, kv = array.array("i", [0]), array.array("i")
        for start, n in zip(starts, batch.lens):
            cu.append(cu[-1] + n)
            kv.append(start + n)
        pos_T, full_slot_T, swa_slot_T = upload([_positions_and_slots_loop(starts, batch.lens, recs, page_size)],
                                                device)[0]
        cu_B1, kv_lens_B, full_BL, swa_BL = upload([torch.frombuffer(cu, dtype=torch.int32),
                                                    torch.frombuffer(kv, dtype=torch.int32), full_BL, swa_BL], device)
        return StepMeta(pos_T=pos_T, cu_q_B1=cu_B1, kv_lens_B=kv_lens_B, full_table_BL=full_BL, swa_table_BL=swa_BL,
                        full_slot_T=full_slot_T, swa_slot_T=swa_slot_T, max_q_len=max(batch.lens))
    start_B = torch.tensor(starts, dtype=torch.long)
    len_B = torch.tensor(batch.lens, dtype=torch.long)
    cu_B1 = batch.cu_seqlens
    kv_lens_B = (start_B + len_B).to(torch.int32)
    if slots_on_device:
        start_B, len_B = upload([start_B, len_B], device)
        cu_B1, kv_lens_B, full_BL, swa_BL = upload([cu_B1, kv_lens_B, full_BL, swa_BL], device)
        pos_T, full_slot_T, swa_slot_T = _positions_and_slots(start_B, len_B, cu_B1, full_BL, swa_BL,
                                                              batch.num_tokens, page_size)
    else:
        pos_T, full_slot_T, swa_slot_T = _positions_and_slots(start_B, len_B, cu_B1, full_BL, swa_BL,
                                                              batch.num_tokens, page_size)
        # two copies to the device (one per dtype) that do not wait for the GPU (mimo_fn.upload)
        pos_T, full_slot_T, swa_slot_T = upload([pos_T, full_slot_T, swa_slot_T], device)
        cu_B1, kv_lens_B, full_BL, swa_BL = upload([cu_B1, kv_lens_B, full_BL, swa_BL], device)
    return StepMeta(pos_T=pos_T, cu_q_B1=cu_B1, kv_lens_B=kv_lens_B, full_table_BL=full_BL, swa_table_BL=swa_BL,
                    full_slot_T=full_slot_T, swa_slot_T=swa_slot_T, max_q_len=max(batch.lens))
