"""Sort (token, k) pairs by expert into block_m-aligned segments for the grouped expert GEMM.

Legend: T tokens, K experts per token, E experts, P = T*K (token, k) pairs,
C chunks of CHUNK pairs, M = padded slot count (upper bound P + min(E, P)*(block_m-1)),
NB = M / block_m blocks of the GEMM's M axis.

Layout (identical for the Triton kernels and the reference, so tests compare exactly):
expert e owns slots [start_e, start_e + pad_e) with pad_e = ceil(count_e / block_m) *
block_m and start_e = sum of pad_ over experts before e. Its pairs fill the segment in
ascending pair index (pair p = t*K + k), then the sentinel P fills the rest. Block b's
expert is expert_of_block[b]; experts with no pairs own no block; blocks at or past
num_tokens_post_pad are -1 (the GEMM grid is sized by the upper bound M and those
programs exit after reading num_tokens_post_pad on device: no host sync).
Ids outside [0, E) (-1 padding, or experts that live on another EP rank) are dropped.

Four launches on GPU (plus a memset), all O(P + E*C): counts per chunk with the rank of each
pair among its chunk's pairs of the same expert (a CHUNK x CHUNK compare), an exclusive
scan of the counts over chunks per expert, expert offsets + block table, and the scatter.
Integer-only and atomics-free, hence deterministic.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mimo_fn._types import Int, Tensor, typed

CHUNK = 128  # pairs per program in the count / scatter kernels: the rank compare is CHUNK^2


@dataclass(frozen=True)
class MoeAlignment:
    sorted_ids_M: torch.Tensor  # int32 [M]: pair index t*K + k per slot; P marks padding
    expert_of_block_NB: torch.Tensor  # int32 [NB]: expert of each block_m block; -1 past the end
    num_tokens_post_pad_1: torch.Tensor  # int32 [1]: used slots, sum_e pad_e (on device)
    block_m: int
    num_pairs: int  # P, also the padding sentinel in sorted_ids_M


def max_padded_slots(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of num_tokens_post_pad: each non-empty expert pads fewer than block_m slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def _moe_align_count_kernel(ids_ptr, rank_ptr, counts_CE_ptr, num_pairs, num_experts, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    valid = (e >= 0) & (e < num_experts)
    e = tl.where(valid, e, -1)
    i = tl.arange(0, CHUNK)
    same = (e[:, None] == e[None, :]) & valid[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)  # earlier pairs, same expert
    is_last = tl.sum((same & (i[None, :] > i[:, None])).to(tl.int32), axis=1) == 0
    tl.store(rank_ptr + offs, rank, mask=offs < num_pairs)
    # the last pair of each expert in the chunk carries the chunk's count: a plain store
    tl.store(counts_CE_ptr + c * num_experts + e, rank + 1, mask=valid & is_last)


@triton.jit
def _moe_align_scan_kernel(
    counts_CE_ptr, chunk_off_CE_ptr, total_E_ptr, num_chunks, num_experts,
    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # program j scans experts [j*BLOCK_E, (j+1)*BLOCK_E) over all chunks, BLOCK_C chunks a step
    ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ex < num_experts
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cs = c0 + tl.arange(0, BLOCK_C)
        m = (cs[:, None] < num_chunks) & emask[None, :]
        ptrs = cs[:, None] * num_experts + ex[None, :]
        tile = tl.load(counts_CE_ptr + ptrs, mask=m, other=0)
        tl.store(chunk_off_CE_ptr + ptrs, tl.cumsum(tile, axis=0) - tile + total[None, :], mask=m)
        total += tl.sum(tile, axis=0)
    tl.store(total_E_ptr + ex, total, mask=emask)


@triton.jit
def _moe_align_blocks_kernel(
    total_E_ptr, start_E_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_pad_ptr,
    num_pairs, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # every program re-derives the (tiny) expert offsets instead of waiting on a scan launch
    ex = tl.arange(0, BLOCK_E)
    total = tl.load(total_E_ptr + ex, mask=ex < num_experts, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    num_post_pad = tl.sum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(start_E_ptr + ex, start, mask=ex < num_experts)
        tl.store(num_post_pad_ptr, num_post_pad)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    pos = b * BLOCK_M
    # ends are non-decreasing, so the owner of slot pos is the number of experts ending at or before it
    owner = tl.sum(((end[None, :] <= pos[:, None]) & (ex[None, :] < num_experts)).to(tl.int32), axis=1)
    live = pos < num_post_pad
    tl.store(expert_of_block_ptr + b, tl.where(live, owner, -1), mask=b < num_blocks)
    # slots of a live block past its expert's pairs get the sentinel; the scatter writes the rest
    is_owner = ex[None, :] == owner[:, None]
    real_end = tl.sum(tl.where(is_owner, start + total, 0), axis=1)
    slot = pos[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad_slot = live[:, None] & (slot >= real_end[:, None])
    tl.store(sorted_ids_ptr + slot, tl.full([BLOCK_B, BLOCK_M], 0, tl.int32) + num_pairs, mask=pad_slot)


@triton.jit
def _moe_align_scatter_kernel(
    ids_ptr, rank_ptr, chunk_off_CE_ptr, start_E_ptr, sorted_ids_ptr, num_pairs, num_experts,
    CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    valid = (offs < num_pairs) & (e >= 0) & (e < num_experts)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    base = tl.load(start_E_ptr + e, mask=valid, other=0) + tl.load(
        chunk_off_CE_ptr + c * num_experts + e, mask=valid, other=0
    )
    tl.store(sorted_ids_ptr + base + rank, offs, mask=valid)


def _check(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"moe_align: num_experts must be >= 1, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: block_m must be a power of two, got {block_m}")


@typed
def moe_align(topk_ids_TK: Int[Tensor, "T K"], num_experts: int, block_m: int) -> MoeAlignment:
    """Triton alignment (see the module docstring); no host sync."""
    _check(topk_ids_TK, num_experts, block_m)
    dev = topk_ids_TK.device
    ids_P = topk_ids_TK.contiguous().view(-1)
    num_pairs = ids_P.numel()
    num_slots = max_padded_slots(num_pairs, num_experts, block_m)
    num_blocks = triton.cdiv(num_slots, block_m)
    sorted_ids_M = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_of_block_NB = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post_pad_1 = torch.zeros(1, dtype=torch.int32, device=dev)
    if num_pairs == 0:
        expert_of_block_NB.fill_(-1)
        return MoeAlignment(sorted_ids_M, expert_of_block_NB, num_post_pad_1, block_m, 0)
    num_chunks = triton.cdiv(num_pairs, CHUNK)
    counts_CE = torch.zeros(num_chunks, num_experts, dtype=torch.int32, device=dev)
    chunk_off_CE = torch.empty_like(counts_CE)
    rank_P = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    total_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    start_E = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)

    # launch shapes timed on an H200 (E=256, 64K tokens): the count kernel is fastest at 2 warps
    # (of 8 / 4 / 2); the scan, a serial loop over chunks per program, at 512 chunks x 4 experts
    # a step rather than 64 x 32 (more programs, fewer steps)
    _moe_align_count_kernel[(num_chunks,)](ids_P, rank_P, counts_CE, num_pairs, num_experts, CHUNK=CHUNK, num_warps=2)
    scan_e = min(block_e, 4)
    _moe_align_scan_kernel[(triton.cdiv(num_experts, scan_e),)](
        counts_CE, chunk_off_CE, total_E, num_chunks, num_experts, BLOCK_C=512, BLOCK_E=scan_e, num_warps=4
    )
    block_b = max(1, min(32, 4096 // block_e))  # keeps the [BLOCK_B, BLOCK_E] owner compare small
    _moe_align_blocks_kernel[(triton.cdiv(num_blocks, block_b),)](
        total_E, start_E, sorted_ids_M, expert_of_block_NB, num_post_pad_1,
        num_pairs, num_experts, num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=block_b, num_warps=4,
    )
    _moe_align_scatter_kernel[(num_chunks,)](
        ids_P, rank_P, chunk_off_CE, start_E, sorted_ids_M, num_pairs, num_experts, CHUNK=CHUNK, num_warps=4
    )
    return MoeAlignment(sorted_ids_M, expert_of_block_NB, num_post_pad_1, block_m, num_pairs)


@typed
def moe_align_ref(topk_ids_TK: Int[Tensor, "T K"], num_experts: int, block_m: int) -> MoeAlignment:
    """Plain-torch twin of `moe_align`, same buffer sizes and same layout (host syncs: reference only)."""
    _check(topk_ids_TK, num_experts, block_m)
    dev = topk_ids_TK.device
    ids_P = topk_ids_TK.reshape(-1).long()
    num_pairs = ids_P.numel()
    num_blocks = triton.cdiv(max_padded_slots(num_pairs, num_experts, block_m), block_m)
    sorted_ids_M = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    expert_of_block_NB = torch.full((num_blocks,), -1, dtype=torch.int32, device=dev)
    pos = 0
    for e in range(num_experts):
        pairs_R = torch.nonzero(ids_P == e).view(-1)  # ascending pair index
        n = pairs_R.numel()
        if n == 0:
            continue
        sorted_ids_M[pos : pos + n] = pairs_R.to(torch.int32)
        nb = triton.cdiv(n, block_m)
        expert_of_block_NB[pos // block_m : pos // block_m + nb] = e
        pos += nb * block_m
    num_post_pad_1 = torch.tensor([pos], dtype=torch.int32, device=dev)
    return MoeAlignment(sorted_ids_M, expert_of_block_NB, num_post_pad_1, block_m, num_pairs)
