"""moe_align (Triton) against moe_align_ref, and both against the layout contract written out
here (check_segments): every valid pair once in its expert's block-aligned segment, ascending,
padding after.

Legend: T tokens, K experts per token, P = T*K pairs. Helpers (routings, poisoned buffers,
seeds) and the interpreter switch on CPU come from test_moe_kernels.
"""

import pytest
import torch

from test_moe_kernels import DEV, ROUTINGS, make_routing, poisoned, seed  # first: sets TRITON_INTERPRET
from mimo_fn.kernels.moe.align import max_padded_slots, moe_align, moe_align_ref


def check_segments(al, ids_TK: torch.Tensor, num_experts: int) -> None:
    """The layout contract, independent of the reference."""
    bm, p = al.block_m, ids_TK.numel()
    ids_P = ids_TK.reshape(-1).cpu()
    n = int(al.num_tokens_post_pad_1)
    slots = al.sorted_ids_M.cpu()[:n].long()
    owner_M = al.expert_of_block_NB.cpu().long().repeat_interleave(bm)[:n]
    assert n % bm == 0 and n <= max_padded_slots(p, num_experts, bm) <= al.sorted_ids_M.numel()
    assert bool((al.expert_of_block_NB.cpu()[n // bm :] == -1).all())
    assert bool((owner_M >= 0).all()) and bool((owner_M[1:] >= owner_M[:-1]).all())
    real = slots < p
    assert bool((slots[~real] == p).all())
    assert bool((ids_P[slots[real]] == owner_M[real]).all())  # each pair sits in its expert's blocks
    valid_pairs = torch.nonzero((ids_P >= 0) & (ids_P < num_experts)).view(-1)
    assert torch.equal(torch.sort(slots[real]).values, valid_pairs)  # every valid pair exactly once
    for e in range(num_experts):
        mine = slots[owner_M == e]
        count = int((ids_P == e).sum())
        assert mine.numel() == -(-count // bm) * bm  # empty experts own no block
        assert torch.equal(mine[:count], torch.sort(mine[:count]).values)  # stable: ascending pairs
        assert bool((mine[count:] == p).all())


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_moe_align_matches_ref(kind, block_m, id_dtype):
    gen = torch.Generator().manual_seed(seed(kind, block_m))
    ids_TK, _ = make_routing(kind, 300, 8, 16, gen)  # 2400 pairs: several count/scatter chunks
    ids_TK = ids_TK.to(id_dtype)
    with poisoned():
        al = moe_align(ids_TK, 16, block_m)
    ref = moe_align_ref(ids_TK, 16, block_m)
    check_segments(al, ids_TK, 16)
    check_segments(ref, ids_TK, 16)
    n = int(ref.num_tokens_post_pad_1)
    assert int(al.num_tokens_post_pad_1) == n
    assert torch.equal(al.sorted_ids_M[:n], ref.sorted_ids_M[:n])
    assert torch.equal(al.expert_of_block_NB, ref.expert_of_block_NB)


def test_moe_align_rejects_bad_input():
    ids_TK = torch.zeros(4, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(ids_TK, 8, 48)
    with pytest.raises(ValueError, match="num_experts"):
        moe_align(ids_TK, 0, 64)
