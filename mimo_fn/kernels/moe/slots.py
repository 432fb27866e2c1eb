"""The MoE input in the up GEMM's slot order, for the warp-specialised up GEMM (up_ws.py) and the
per-expert cuBLAS one (up_cublas.py): both read x as boxes of consecutive slot rows.

Legend: T tokens, K experts per token, P = T*K (token, k) pairs, H hidden, Hb = H / 128 scale
groups, M padded slots of align.py's layout.

Both entry points give (x_MH fp8, xs_MHb fp32 stored [Hb, M]: M-major, so a GEMM loads a K step's
scales of consecutive slots at once): slot s holds token sorted_ids[s] // K's quantised row and its
1x128 scales, padding slots zero codes and scale 0 (finite: h = 0), slots past the used blocks are
not written (no GEMM reads them). No host sync.
- `gather_slots`: from x already quantised token-major (fp8_quant.quant_fp8_act): a row copy.
- `quant_fp8_slots`: from the layer's bf16 / fp16 / fp32 x: each token's row is read once,
  quantised once (fp8_quant's arithmetic: IEEE divisions, clamp, round to nearest even) and
  written to its K slots. Quantising token-major and then gathering moves ~2 x M x H bytes more
  (the gather reads and writes every slot's row: 2.2 GB each way at 64K tokens). After a fill of
  the index with -1, two launches: `_slot_index_kernel` (slot-major) inverts sorted_ids into
  slot_of_pair (pairs with no slot, such as another EP rank's experts, stay -1) and zeroes the
  padding slots; `_quant_slots_kernel` (token-major) quantises and stores each row K times.
The two give the same bits on every used slot (tests/test_moe_slots.py).
"""

import torch
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.fp8_quant import quant_groups
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.quant import BLOCK, FP8_DTYPE, FP8_MAX, SCALE_FLOOR, quantize_fp8_act_ref

_GATHER_S, _GATHER_H = 16, 1024  # gather tile: 16 slots x 1024 bytes of x
_INDEX_S, _INDEX_H = 16, 1024  # slot-index tile: 16 slots x 1024 bytes of a padding row
_QUANT_T = 32  # tokens per quantiser program (x 128 columns: fp8_quant's tile)


@triton.jit
def _gather_kernel(x_ptr, xs_ptr, xo_ptr, xso_ptr, sorted_ids_ptr, num_post_pad_ptr, num_pairs, H,
                   stride_xt, stride_xst, stride_xsg, stride_xom, stride_xsom, stride_xsog,
                   TOP_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    # x as uint8 codes: a byte copy (the interpreter has no fp8 loads)
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    live = slots < tl.load(num_post_pad_ptr)  # ids past the used blocks are unwritten garbage
    pair = tl.load(sorted_ids_ptr + slots, mask=live, other=num_pairs)
    real = pair < num_pairs  # padding slots (sentinel P) read zeros: h = 0, finite
    tok = tl.where(real, pair // TOP_K, 0).to(tl.int64)
    rows = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c_ok = cols < H
    v = tl.load(x_ptr + tok[:, None] * stride_xt + cols[None, :], mask=real[:, None] & c_ok[None, :], other=0)
    tl.store(xo_ptr + rows[:, None] * stride_xom + cols[None, :], v, mask=live[:, None] & c_ok[None, :])
    G: tl.constexpr = BLOCK_H // 128
    grp = tl.program_id(1) * G + tl.arange(0, G)
    g_ok = grp * 128 < H
    s = tl.load(xs_ptr + tok[:, None] * stride_xst + grp[None, :] * stride_xsg,
                mask=real[:, None] & g_ok[None, :], other=0.0)
    tl.store(xso_ptr + rows[:, None] * stride_xsom + grp[None, :] * stride_xsog, s, mask=live[:, None] & g_ok[None, :])


def gather_slots(x_q_TH: torch.Tensor, x_scale_TG: torch.Tensor, al: MoeAlignment, top_k: int):
    """(x_MH fp8, xs_MHb fp32 stored [Hb, M]): slot s holds x row sorted_ids[s] // top_k and its
    scales; padding slots zeros and scale 0; slots past num_tokens_post_pad unwritten. H % 128 == 0."""
    m, hid = al.sorted_ids_M.numel(), x_q_TH.shape[1]
    x_MH = torch.empty(m, hid, dtype=FP8_DTYPE, device=x_q_TH.device)
    xs_MHb = torch.empty(hid // BLOCK, m, dtype=torch.float32, device=x_q_TH.device).t()
    if m == 0:
        return x_MH, xs_MHb
    x_u8, xo_u8 = x_q_TH.view(torch.uint8), x_MH.view(torch.uint8)
    if x_u8.stride(1) != 1:  # the kernel steps along a row by bytes
        x_u8 = x_u8.contiguous()
    block_h = min(_GATHER_H, triton.next_power_of_2(hid))
    _gather_kernel[(triton.cdiv(m, _GATHER_S), triton.cdiv(hid, block_h))](
        x_u8, x_scale_TG, xo_u8, xs_MHb, al.sorted_ids_M, al.num_tokens_post_pad_1, al.num_pairs, hid,
        x_u8.stride(0), *x_scale_TG.stride(), xo_u8.stride(0), *xs_MHb.stride(),
        TOP_K=top_k, BLOCK_S=_GATHER_S, BLOCK_H=block_h, num_warps=4,
    )
    return x_MH, xs_MHb


def gather_slots_ref(x_q_TH: torch.Tensor, x_scale_TG: torch.Tensor, al: MoeAlignment, top_k: int):
    """Plain-torch twin of `gather_slots` (host sync: reference only); rows past the used slots are
    zeros here, where the kernel leaves them unwritten."""
    m, hid = al.sorted_ids_M.numel(), x_q_TH.shape[1]
    pair_M = al.sorted_ids_M.long()
    real_M = (torch.arange(m, device=pair_M.device) < int(al.num_tokens_post_pad_1)) & (pair_M < al.num_pairs)
    tok_R = pair_M[real_M] // top_k
    x_MH = torch.zeros(m, hid, dtype=torch.uint8, device=x_q_TH.device)
    x_MH[real_M] = x_q_TH.view(torch.uint8)[tok_R]
    xs_MHb = torch.zeros(m, hid // BLOCK, dtype=torch.float32, device=x_q_TH.device)
    xs_MHb[real_M] = x_scale_TG[tok_R]
    return x_MH.view(FP8_DTYPE), xs_MHb


@triton.jit
def _slot_index_kernel(sorted_ids_ptr, num_post_pad_ptr, slot_ptr, xo_ptr, xso_ptr, num_pairs, H,
                       stride_xom, stride_xsom, stride_xsog, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    # program (slot tile, column chunk); chunk 0 also writes the index and the padding scales
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    live = slots < tl.load(num_post_pad_ptr)  # ids past the used blocks are unwritten garbage
    pair = tl.load(sorted_ids_ptr + slots, mask=live, other=num_pairs)
    pad = live & (pair >= num_pairs)
    rows = slots.to(tl.int64)
    if tl.program_id(1) == 0:
        tl.store(slot_ptr + pair, slots, mask=live & (pair < num_pairs))
        G: tl.constexpr = 64  # scale groups a step (H / 128 of them)
        for g0 in range(0, tl.cdiv(H, 128), G):
            grp = g0 + tl.arange(0, G)
            tl.store(xso_ptr + rows[:, None] * stride_xsom + grp[None, :] * stride_xsog,
                     tl.zeros([BLOCK_S, G], tl.float32), mask=pad[:, None] & (grp[None, :] * 128 < H))
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(xo_ptr + rows[:, None] * stride_xom + cols[None, :], tl.zeros([BLOCK_S, BLOCK_H], tl.uint8),
             mask=pad[:, None] & (cols[None, :] < H))


@triton.jit
def _quant_slots_kernel(x_ptr, slot_ptr, xo_ptr, xso_ptr, T, H, stride_xt, stride_xom, stride_xsom, stride_xsog,
                        TOP_K: tl.constexpr, FP8_MAX_C: tl.constexpr, FLOOR_C: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr):
    # program (token tile, 128-column group): fp8_quant's quantiser, then one store per slot
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    t_ok = toks < T
    x = tl.load(x_ptr + toks.to(tl.int64)[:, None] * stride_xt + cols[None, :],
                mask=t_ok[:, None] & (cols[None, :] < H), other=0.0)
    q, scale = quant_groups(x.to(tl.float32), FP8_MAX_C, FLOOR_C, INTERPRET)
    for k in tl.static_range(TOP_K):
        slot = tl.load(slot_ptr + toks * TOP_K + k, mask=t_ok, other=-1)
        ok = slot >= 0
        rows = slot.to(tl.int64)
        tl.store(xo_ptr + rows[:, None] * stride_xom + cols[None, :], q, mask=ok[:, None] & (cols[None, :] < H))
        tl.store(xso_ptr + rows * stride_xsom + g * stride_xsog, scale, mask=ok)


def _check(x_TH: torch.Tensor, al: MoeAlignment, top_k: int) -> None:
    if x_TH.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant_fp8_slots: x must be bf16, fp16 or fp32, got {x_TH.dtype}")
    if x_TH.dim() != 2 or x_TH.shape[1] % BLOCK:
        raise ValueError(f"quant_fp8_slots: x must be [T, H] with H a multiple of {BLOCK}, got {tuple(x_TH.shape)}")
    if x_TH.shape[0] * top_k != al.num_pairs:
        raise ValueError(f"quant_fp8_slots: {x_TH.shape[0]} tokens x top_k {top_k} = {x_TH.shape[0] * top_k} "
                         f"pairs, the alignment has {al.num_pairs}")


@typed
def quant_fp8_slots(
    x_TH: Float[Tensor, "T H"], al: MoeAlignment, top_k: int
) -> tuple[Float[Tensor, "M H"], Float[Tensor, "M Hb"]]:
    """(x_MH fp8, xs_MHb fp32 stored [Hb, M]): x quantised per token in 1x128 groups, each token's row
    at its K slots (the module docstring). ValueError for dtypes, shapes or a mismatched alignment."""
    _check(x_TH, al, top_k)
    m, hid, dev = al.sorted_ids_M.numel(), x_TH.shape[1], x_TH.device
    x_MH = torch.empty(m, hid, dtype=FP8_DTYPE, device=dev)
    xs_MHb = torch.empty(hid // BLOCK, m, dtype=torch.float32, device=dev).t()
    if m == 0 or al.num_pairs == 0:
        return x_MH, xs_MHb
    x_TH = x_TH if x_TH.stride(1) == 1 else x_TH.contiguous()
    slot_P = torch.full((al.num_pairs,), -1, dtype=torch.int32, device=dev)
    xo_u8 = x_MH.view(torch.uint8)  # byte stores: the interpreter has no fp8 stores
    block_h = min(_INDEX_H, triton.next_power_of_2(hid))
    _slot_index_kernel[(triton.cdiv(m, _INDEX_S), triton.cdiv(hid, block_h))](
        al.sorted_ids_M, al.num_tokens_post_pad_1, slot_P, xo_u8, xs_MHb, al.num_pairs, hid,
        xo_u8.stride(0), *xs_MHb.stride(), BLOCK_S=_INDEX_S, BLOCK_H=block_h, num_warps=4,
    )
    _quant_slots_kernel[(triton.cdiv(x_TH.shape[0], _QUANT_T), hid // BLOCK)](
        x_TH, slot_P, xo_u8, xs_MHb, x_TH.shape[0], hid, x_TH.stride(0), xo_u8.stride(0), *xs_MHb.stride(),
        TOP_K=top_k, FP8_MAX_C=FP8_MAX, FLOOR_C=SCALE_FLOOR, GROUP=BLOCK, BLOCK_T=_QUANT_T,
        INTERPRET=not x_TH.is_cuda, num_warps=4,
    )
    return x_MH, xs_MHb


def quant_fp8_slots_ref(x_TH: torch.Tensor, al: MoeAlignment, top_k: int):
    """Plain-torch twin of `quant_fp8_slots` (host syncs: reference only): quantise, then gather_slots_ref."""
    _check(x_TH, al, top_k)
    return gather_slots_ref(*quantize_fp8_act_ref(x_TH), al, top_k)
