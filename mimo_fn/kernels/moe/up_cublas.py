"""The FP8 MoE up GEMM as one cuBLASLt block-scaled GEMM per expert: `moe_up_fp8_cublas`.

Legend: T tokens, K experts per token, P = T*K (token, k) pairs, E experts, H hidden (the
reduction), I expert intermediate, M padded slots of align.py's layout (128-row blocks),
L one expert's slots, Hb / Ib = H / 128, I / 128 scale groups, NB = M / 128 blocks.

Same contract as gemm.py's `_moe_up` for FP8: h[s] = silu(x[t] @ Wg[e]^T) * (x[t] @ Wu[e]^T) for
slot s holding pair p = t*K + k of expert e, quantised per slot in 1x128 groups: (h_q_MI, hs_MIb),
hs stored [Ib, M], the layout the down GEMM reads.

Why: at large row counts an expert's up GEMM is an ordinary [L, H] x [H, 2I] block-scaled GEMM,
and cuBLASLt's kernels for it (scaled_mm, as the dense FP8 linears run) reached 960-1,005 TFLOP/s
per expert at 64K tokens on an H200 where our grouped Triton kernel reached ~715-777
(docs/history/benchmarks-notebook.md, "cuBLAS block-scaled FP8 per expert"). The price:
1. one host sync for the experts' slot counts (the loop needs them on the host);
2. x's FP8 rows gathered into slot order (slots.gather_slots: cuBLAS reads contiguous rows) and
   each expert's scales laid out M-major within its own segment (`_expert_scales_kernel`):
   cuBLASLt takes scale_a [L, Hb] with strides exactly (1, L), no slice of a shared buffer;
3. the gate / up product written to memory in bf16 (cuBLAS has no SiLU-and-quantise epilogue)
   and read back by `_silu_quant_kernel`. The rounding of gate and up to bf16 before the SiLU
   (2^-9 relative) is far below the 1x128 FP8 quantisation of h that follows (2^-4).
So it can pay only where the experts get many rows each, and on an H100 it did not pay enough
(the table at `takes`): it is opt-in, options.moe_up_cublas (MIMO_FN_MOE_UP_CUBLAS=1), and even
then never under CUDA-graph capture (the host sync) or in deterministic mode (cuBLAS picks its
kernel by L).
"""

import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.kernels.cast import cast_rne
from mimo_fn.kernels.moe.align import MoeAlignment
from mimo_fn.kernels.moe.slots import gather_slots
from mimo_fn import options
from mimo_fn.quant import BLOCK, FP8_DTYPE, block_recipes, block_scaled_mm_available

BLOCK_M = 128  # the alignment's rows per block: cuBLASLt's block-scaled GEMM wants whole 128-row tiles
# H in whole groups of 4 scale blocks: with H / 128 % 4 != 0 cuBLASLt's block-scaled GEMM gives
# silently wrong results unless the weight scales are padded (layers/linear.py, pytorch#166752);
# an H100 showed it here at H = 256 (errors ~100%). MiMo's H = 4096 is a multiple.
H_MULTIPLE = 4 * BLOCK



@triton.jit
def _expert_scales_kernel(xs_ptr, out_ptr, seg_start_ptr, seg_len_ptr, stride_xsg, stride_xsm,
                          BLOCK_M: tl.constexpr):
    """Grid (used blocks, Hb): block b's 128 slot scales of group g, from the shared [Hb, M] buffer
    to its expert's own [Hb, L] segment at out[start * Hb + g * L + (slot - start)]."""
    b = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.load(seg_start_ptr + b).to(tl.int64)
    length = tl.load(seg_len_ptr + b).to(tl.int64)
    slots = b * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    s = tl.load(xs_ptr + g * stride_xsg + slots * stride_xsm)
    hb = tl.num_programs(1)
    tl.store(out_ptr + start * hb + g * length + (slots - start), s)


@triton.jit
def _silu_quant_kernel(gu_ptr, h_ptr, hs_ptr, I, stride_gm, stride_hm, stride_hsg, stride_hsm,
                       BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr):
    """Grid (slot blocks, Ib): h = silu(gate) * up in fp32 for BLOCK_S slots x one 1x128 group,
    quantised as the Triton up kernel's epilogue does (quantize_fp8_act_ref's arithmetic)."""
    rows = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    gate = tl.load(gu_ptr + rows[:, None] * stride_gm + cols[None, :]).to(tl.float32)
    up = tl.load(gu_ptr + rows[:, None] * stride_gm + (I + cols)[None, :]).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(h), axis=1), 1e-10), 448.0)
    q = tl.clamp(tl.div_rn(h, scale[:, None]), -448.0, 448.0)
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], cast_rne(q, h_ptr.dtype.element_ty, INTERPRET))
    tl.store(hs_ptr + g * stride_hsg + rows * stride_hsm, scale)


_OUT_VARIANT = []  # filled on the first call: True where torch._scaled_mm's out= variant takes block scales


def scaled_mm_into(out_LN: torch.Tensor, a_LH: torch.Tensor, sa_LHb: torch.Tensor, w_NH: torch.Tensor,
                   sw_NbHb: torch.Tensor) -> None:
    """out = (a * sa) @ (w * sw)^T in cuBLASLt's block-scaled FP8 GEMM, written into out (bf16):
    a [L, H] row-major, sa [L, Hb] strides (1, L), w [N, H] row-major, sw [Nb, Hb] contiguous.
    torch._scaled_mm.out writes in place; where a torch build refuses block scales there, the
    first call says so once and F.scaled_mm's result is copied in from then on."""
    if not _OUT_VARIANT or _OUT_VARIANT[0]:
        try:
            torch.ops.aten._scaled_mm.out(a_LH, w_NH.t(), sa_LHb, sw_NbHb.t(), None, None, out_LN.dtype, False,
                                          out=out_LN)
            _OUT_VARIANT[:] = [True]
            return
        except RuntimeError as e:
            if _OUT_VARIANT:
                raise
            _OUT_VARIANT[:] = [False]
            warnings.warn(f"up_cublas: torch._scaled_mm.out refused block scales ({e}); F.scaled_mm plus a copy")
    ra, rb = block_recipes()
    out_LN.copy_(F.scaled_mm(a_LH, w_NH.t(), sa_LHb, ra, sw_NbHb.t(), rb, output_dtype=out_LN.dtype))


def scaled_mm_into_ref(out_LN: torch.Tensor, a_LH: torch.Tensor, sa_LHb: torch.Tensor, w_NH: torch.Tensor,
                       sw_NbHb: torch.Tensor) -> None:
    """`scaled_mm_into` in fp32 on dequantised operands (CPU tests); it checks the scale layout
    cuBLASLt demands, so the tests prove the views this module builds."""
    length = a_LH.shape[0]
    if sa_LHb.stride() != (1, length) or a_LH.stride(1) != 1 or not sw_NbHb.is_contiguous():
        raise ValueError(f"scaled_mm_into_ref: strides a {a_LH.stride()} sa {sa_LHb.stride()} (want (1, {length})), "
                         f"sw contiguous {sw_NbHb.is_contiguous()}")
    a32 = a_LH.float() * sa_LHb.repeat_interleave(BLOCK, dim=1)
    w32 = w_NH.float() * sw_NbHb.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    out_LN.copy_(a32 @ w32.t())


def _segments(al: MoeAlignment, num_experts: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(blocks per expert on the host, each used block's segment start and length in slots, on the
    device). One host sync: the per-expert GEMM loop needs the counts."""
    eob_NB = al.expert_of_block_NB.long()
    live_NB = eob_NB >= 0
    blocks_E = torch.zeros(num_experts, dtype=torch.long, device=eob_NB.device)
    blocks_E.scatter_add_(0, eob_NB.clamp(min=0), live_NB.long())
    start_E = (torch.cumsum(blocks_E, 0) - blocks_E) * BLOCK_M
    used = eob_NB.clamp(min=0)
    return blocks_E.tolist(), start_E[used].int(), (blocks_E[used] * BLOCK_M).int()


@typed
def moe_up_fp8_cublas(
    x_q_TH: Float[Tensor, "T H"], x_scale_TG: Float[Tensor, "T Hb"], w13_E2IH: Float[Tensor, "E I2 H"],
    w13_scale: Float[Tensor, "E I2b Hb"], al: MoeAlignment, top_k: int, gemm=None,
) -> tuple[Float[Tensor, "M I"], Float[Tensor, "M Ib"]]:
    """(h_q_MI fp8, hs_MIb fp32 stored [Ib, M]) of silu(gate) * up per slot (the module docstring).
    gemm: the per-expert GEMM (None: scaled_mm_into; tests pass scaled_mm_into_ref). Rows past the used blocks are not
    written, padding slots' rows are finite (x's padding rows are zeros)."""
    if al.block_m != BLOCK_M:
        raise ValueError(f"moe_up_fp8_cublas: the alignment's block_m is {al.block_m}, expected {BLOCK_M}")
    num_experts, two_i, hid = w13_E2IH.shape
    if hid % H_MULTIPLE or two_i % (2 * BLOCK) or x_q_TH.shape[1] != hid:
        raise ValueError(f"moe_up_fp8_cublas: x {tuple(x_q_TH.shape)} and w13 {tuple(w13_E2IH.shape)}: expected the "
                         f"same H, a multiple of {H_MULTIPLE}, and I a multiple of {BLOCK}")
    inter, hb = two_i // 2, hid // BLOCK
    gemm = gemm or scaled_mm_into
    m, dev = al.sorted_ids_M.numel(), x_q_TH.device
    h_q_MI = torch.empty(m, inter, dtype=FP8_DTYPE, device=dev)
    hs_MIb = torch.empty(inter // BLOCK, m, dtype=torch.float32, device=dev).t()
    blocks_E, seg_start_NB, seg_len_NB = _segments(al, num_experts)
    used = sum(blocks_E) * BLOCK_M
    if used == 0:
        return h_q_MI, hs_MIb
    x_MH, xs_MHb = gather_slots(x_q_TH, x_scale_TG, al, top_k)
    xs_flat = torch.empty(used * hb, dtype=torch.float32, device=dev)
    _expert_scales_kernel[(used // BLOCK_M, hb)](xs_MHb, xs_flat, seg_start_NB, seg_len_NB, *xs_MHb.stride()[::-1],
                                                 BLOCK_M=BLOCK_M, num_warps=4)
    gu_M2I = torch.empty(used, two_i, dtype=torch.bfloat16, device=dev)
    start = 0
    for e, nb in enumerate(blocks_E):
        if nb == 0:
            continue
        end = start + nb * BLOCK_M
        sa_LHb = xs_flat[start * hb: end * hb].view(hb, end - start).t()
        gemm(gu_M2I[start:end], x_MH[start:end], sa_LHb, w13_E2IH[e], w13_scale[e])
        start = end
    block_s = 32
    _silu_quant_kernel[(used // block_s, inter // BLOCK)](
        gu_M2I, h_q_MI, hs_MIb, inter, gu_M2I.stride(0), h_q_MI.stride(0), *hs_MIb.stride()[::-1],
        BLOCK_S=block_s, INTERPRET=not x_q_TH.is_cuda, num_warps=4,
    )
    return h_q_MI, hs_MIb


def serves(x_q_TH: torch.Tensor, w13_E2IH: torch.Tensor, block_m: int) -> bool:
    """Whether `moe_up_fp8_cublas` can take this launch: FP8 x, 128-row blocks, H a multiple of
    512 and I of 128, a GPU with cuBLASLt's block-scaled FP8 GEMM, not under CUDA-graph capture."""
    hid, two_i = w13_E2IH.shape[2], w13_E2IH.shape[1]
    return (x_q_TH.dtype == FP8_DTYPE and block_m == BLOCK_M and hid % H_MULTIPLE == 0 and two_i % (2 * BLOCK) == 0
            and x_q_TH.is_cuda and block_scaled_mm_available(x_q_TH.device)
            and not torch.cuda.is_current_stream_capturing())


def takes(x_q_TH: torch.Tensor, w13_E2IH: torch.Tensor, block_m: int) -> bool:
    """gemm._moe_up's choice: where options.moe_up_cublas is on (MIMO_FN_MOE_UP_CUBLAS=1) and `serves`.

    Off by default. The whole FP8 MoE layer on an H100 (python -m mimo_fn.bench moe --cublas-up,
    TFLOP/s, balanced / skewed, against the Triton up GEMM with the WS down GEMM, 2026-12-07):
    16K tokens (512 pairs an expert) 346 / 353 against 627 / 607, 32K 562 / 516 against 687 / 681,
    64K 742 / 735 against 732 / 687: the gather, the bf16 gate / up round trip and the host's 256
    launches after a sync eat what cuBLAS gains below 64K. In a 64K prefill with 64K-token chunks
    it measured level with the Triton path (docs/history/benchmarks-notebook.md)."""
    return options.current().moe_up_cublas and serves(x_q_TH, w13_E2IH, block_m)
