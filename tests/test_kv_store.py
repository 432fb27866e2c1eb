"""The one-launch K/V pool write (`kernels.kv_store.store_kv_`) against two index_copy_ calls, bit for bit.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn.kernels import kv_store  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pools(num_pages, page, heads, head_d, head_e, dtype, gen):
    k = torch.randn(num_pages, page, heads, head_d, generator=gen).to(dtype=dtype, device=DEVICE)
    v = torch.randn(num_pages, page, heads, head_e, generator=gen).to(dtype=dtype, device=DEVICE)
    k.view(-1)[::7] = float("nan")  # stale slots: whatever they hold stays, NaN included
    return k, v


@pytest.mark.parametrize("tokens,heads,head_d,head_e", [(13, 8, 192, 128), (3, 4, 192, 128), (9, 2, 16, 8)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_store_kv_matches_index_copy(tokens, heads, head_d, head_e, index_dtype):
    # token counts off the kernel's 8-row blocks, rows wider than one 512-column step (8 x 192) and
    # narrower ones, slots scattered over pages in any order
    gen = torch.Generator().manual_seed(tokens * heads)
    k_pool, v_pool = pools(6, 16, heads, head_d, head_e, torch.bfloat16, gen)
    slot = torch.randperm(6 * 16, generator=gen)[:tokens].to(dtype=index_dtype, device=DEVICE)
    k = torch.randn(tokens, heads, head_d, generator=gen).bfloat16().to(DEVICE)
    v = torch.randn(tokens, heads, head_e, generator=gen).bfloat16().to(DEVICE)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    kv_store.store_kv_ref(want_k, want_v, slot.long(), k, v)  # index_copy_ takes int64 only
    assert kv_store.unsupported_reason(k_pool, v_pool, k, v) is None
    kv_store.store_kv_(k_pool, v_pool, slot, k, v)
    assert torch.equal(k_pool.view(torch.int16), want_k.view(torch.int16))  # NaN slots compared as bits
    assert torch.equal(v_pool, want_v)


def test_store_kv_strided_rows_and_fallbacks():
    gen = torch.Generator().manual_seed(1)
    k_pool, v_pool = pools(4, 8, 2, 16, 8, torch.bfloat16, gen)
    # k and v as views of one projection output [T, G*D + G*E + 5]: rows strided, [G, dim] contiguous
    out = torch.randn(5, 2 * 16 + 2 * 8 + 5, generator=gen).bfloat16().to(DEVICE)
    k, v = out[:, :32].view(5, 2, 16), out[:, 32:48].view(5, 2, 8)
    slot = torch.tensor([30, 0, 7, 8, 17], device=DEVICE)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    kv_store.store_kv_ref(want_k, want_v, slot, k, v)
    kv_store.store_kv_(k_pool, v_pool, slot, k, v)
    assert torch.equal(k_pool.view(torch.int16), want_k.view(torch.int16)) and torch.equal(v_pool, want_v)
    # a cast (fp32 rows into bf16 pools) and heads that are not contiguous take the reference path
    k32 = k.float()
    assert "cast" in kv_store.unsupported_reason(k_pool, v_pool, k32, v)
    kv_store.store_kv_(k_pool, v_pool, slot, k32, v)
    assert torch.equal(k_pool.view(torch.int16), want_k.view(torch.int16))
    assert "not contiguous" in kv_store.unsupported_reason(k_pool, v_pool, k.transpose(0, 1).transpose(0, 1)[:, ::2],
                                                           v)
    # no tokens: nothing written
    kv_store.store_kv_(k_pool, v_pool, slot[:0], k[:0], v[:0])
    assert torch.equal(v_pool, want_v)
