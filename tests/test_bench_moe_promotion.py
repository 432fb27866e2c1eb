"""`bench moe --mode promotion` (mimo_fn.bench.moe_promotion) at tiny dims in the interpreter: every
variant of both FP8 GEMMs runs, and the "chained" up kernel computes silu(g) * u of the FP8 codes
with no scales at all (the speed-only variant leaves out exactly the scaling)."""

import pytest
import torch

from mimo_fn.bench.moe_promotion import BLOCK_M, DOWN_VARIANTS, UP_VARIANTS, _up, promotion_rows
from mimo_fn.kernels.fp8_quant import quant_fp8_act
from mimo_fn.kernels.moe.align import moe_align
from mimo_fn.quant import quantize_fp8_block

E, H, I, T, K = 4, 256, 256, 24, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the chained variants' gate products of raw codes reach ~1e5: exp(-g) in SiLU overflows to inf
# (SiLU is then -0, as torch's), which numpy in the interpreter reports
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture(scope="module")
def operands():
    gen = torch.Generator().manual_seed(0)
    x_TH = torch.randn(T, H, generator=gen).bfloat16().to(DEVICE)
    w13 = quantize_fp8_block((torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(DEVICE))
    w2 = quantize_fp8_block((torch.randn(E, H, I, generator=gen) / I**0.5).to(DEVICE))
    ids_TK = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].to(DEVICE)
    weights_TK = (torch.rand(T, K, generator=gen) + 0.1).to(DEVICE)
    return x_TH, w13, w2, ids_TK, weights_TK


def test_every_variant_runs(operands):
    rows = promotion_rows(*operands)
    labels = [(r["gemm"], r["variant"]) for r in rows]
    want = [("up", v[0]) for v in UP_VARIANTS] + [("down", v[0]) for v in DOWN_VARIANTS]
    assert labels[:len(want)] == want and len(labels) - len(want) in (0, 1)  # + down_ws on Hopper


def test_chained_up_is_the_unscaled_product_of_the_codes(operands):
    x_TH, w13, _, ids_TK, _ = operands
    xq_TH, xs_TG = quant_fp8_act(x_TH)
    al = moe_align(ids_TK, E, BLOCK_M)
    label, scaled, meta, warps, stages = UP_VARIANTS[2]
    assert label == "chained" and not scaled
    h_MI, hs_MIb = _up(xq_TH, xs_TG, w13.data, w13.scale, al, K, False, meta, warps, stages)
    n = int(al.num_tokens_post_pad_1)
    pair_M = al.sorted_ids_M[:n].long()
    expert_M = al.expert_of_block_NB.long().repeat_interleave(BLOCK_M)[:n]
    real = torch.nonzero(pair_M < al.num_pairs).view(-1)
    x_S = xq_TH.float()[pair_M[real] // K]
    gu_S = torch.einsum("sh,snh->sn", x_S, w13.data.float()[expert_M[real]])
    want_SI = torch.nn.functional.silu(gu_S[:, :I]) * gu_S[:, I:]
    got_SI = h_MI[real].float() * hs_MIb[real].repeat_interleave(128, dim=1)
    # h is quantised per 1x128 group (e4m3: 2^-4 relative per element, of the group's largest)
    tol = 2.0**-4 * want_SI.abs().view(len(real), -1, 128).amax(-1).repeat_interleave(128, dim=1) + 1e-3
    assert ((got_SI - want_SI).abs() <= tol).all()
    assert len({tuple(r.tolist()) for r in got_SI}) == len(real)  # each slot its own row
