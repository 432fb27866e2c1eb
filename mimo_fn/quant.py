"""Quantised weight formats. A QTensor is data + scale + format; `linear` dispatches on it.

Legend: E experts (any leading batch dims), N output features, K input features,
T tokens, G groups of 128 along K (G = ceil(K / 128)), Nb / Kb blocks of 128 along N / K.

FP8_BLOCK is the released MiMo / DeepSeek-V3 checkpoint format: float8_e4m3fn data and
one fp32 multiplier per 128x128 block of the last two dims, W ~= q * scale, i.e. the
checkpoints' `weight_scale_inv` (despite the name it multiplies). Activations use the
matching 1x128 per-token groups. Both scales are max(amax, 1e-10) / 448: 448 is the
largest finite e4m3fn value, and the floor keeps an all-zero block finite (q = 0).
Partial blocks (N or K not a multiple of 128) are padded with zeros for the amax, which
changes nothing, so quantise-then-pad equals pad-then-quantise.

MXFP4 is the OCP microscaling format of the RL release's routed experts (MiMo-V2.6-Flash-RL
stores `experts.E.{gate,up,down}_proj.weight` as packed bytes with a `weight_scale` beside
it): along K, every group of 32 values shares one E8M0 scale 2^(s - 127) (a uint8 s; 255 is
NaN), and each value is an E2M1 code (sign, 2 exponent bits, 1 mantissa bit: magnitudes 0,
0.5, 1, 1.5, 2, 3, 4, 6). Two codes share a byte, element 2j in the low nibble and 2j + 1 in
the high one (the OCP / PyTorch float4_e2m1fn_x2 order). W = value(code) * 2^(s - 127).
The quantiser takes the smallest power of two that brings a group's amax within 6,
2^ceil(log2(amax / 6)), and rounds to the nearest code (ties to the even code). (The OCP
spec's example rule, 2^(floor(log2(amax)) - 2), clips values above 6 * scale, by up to 25%.)

Everything here is the plain-torch reference; the Triton activation quantiser is in
kernels/fp8_quant.py and must agree with `quantize_fp8_act_ref` bitwise.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from mimo_fn._types import Float, Tensor, typed

FP8_BLOCK = "fp8_block"  # float8_e4m3fn data, fp32 scale per 128x128 block, W = q * scale
MXFP4 = "mxfp4"  # uint8 [.., N, K/2] (two E2M1 codes a byte), uint8 E8M0 scale [.., N, K/32]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-10  # scale of an all-zero block / group: keeps q = x / scale finite
BLOCK = 128  # FP8_BLOCK weight block edge and activation group length
MX_GROUP = 32  # MXFP4 values sharing one scale (along K)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
E8M0_BIAS = 127


@dataclass(frozen=True)
class QTensor:
    data: torch.Tensor  # quantised values: FP8_BLOCK [.., N, K] fp8, MXFP4 [.., N, K/2] uint8
    scale: torch.Tensor  # FP8_BLOCK fp32 [.., ceil(N/128), ceil(K/128)], MXFP4 uint8 [.., N, K/32]
    fmt: str  # one of the format names above

    @property
    def shape(self) -> torch.Size:
        """The logical weight's shape ([.., N, K] for both formats)."""
        if self.fmt == MXFP4:
            return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


@dataclass(frozen=True)
class QActs:
    """Activations already quantised in 1x128 FP8 groups (e.g. gathered as FP8): a GEMM
    against an FP8 weight consumes them as they are, with no second quantisation."""

    q: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, G] fp32, any strides (M-major after a packed gather)
    dtype: torch.dtype  # the activations' own dtype: GEMM outputs come back in it

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


pytree.register_pytree_node(
    QTensor,
    lambda q: ((q.data, q.scale), q.fmt),
    lambda children, fmt: QTensor(children[0], children[1], fmt),
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """max(amax, 1e-10) / 448 as an IEEE division on every device.

    The divisor is a full tensor on purpose: torch's CUDA kernels turn division by a
    Python scalar into multiplication by its reciprocal, which differs from the
    quotient in the last bit for some amax, and the Triton quantiser divides exactly.
    """
    return amax.clamp_min(SCALE_FLOOR) / torch.full_like(amax, FP8_MAX)


def _quantize_matrix(w_NK: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w_NK.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    w_pad = F.pad(w_NK.float(), (0, kb * block - k, 0, nb * block - n))
    w_nbkb = w_pad.view(nb, block, kb, block)  # [Nb, 128, Kb, 128]
    scale_NbKb = _scale_from_amax(w_nbkb.abs().amax(dim=(1, 3)))
    q_nbkb = (w_nbkb / scale_NbKb[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_nbkb.view(nb * block, kb * block)[:n, :k].contiguous(), scale_NbKb


@typed
def quantize_fp8_block(w_NK: Float[Tensor, "*E N K"], block: int = BLOCK) -> QTensor:
    """W [..., N, K] -> QTensor(q [..., N, K] fp8, scale [..., Nb, Kb] fp32), W ~= q * scale.

    Blocks tile the last two dims; leading dims (an expert stack [E, N, K]) are
    quantised one matrix at a time so the fp32 temporaries stay one matrix large.
    """
    if block != BLOCK:
        raise ValueError(f"quantize_fp8_block: FP8_BLOCK uses {BLOCK}x{BLOCK} blocks, got block={block}")
    *lead, n, k = w_NK.shape
    w_BNK = w_NK.reshape(-1, n, k)
    parts = [_quantize_matrix(w_BNK[i], block) for i in range(w_BNK.shape[0])]
    q = torch.stack([p[0] for p in parts]).view(*lead, n, k)
    scale = torch.stack([p[1] for p in parts]).view(*lead, _cdiv(n, block), _cdiv(k, block))
    return QTensor(q, scale, FP8_BLOCK)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> E2M1 codes (uint8 0..15): nearest magnitude, ties to the even code, saturating at 6."""
    table = torch.tensor(E2M1_VALUES, device=v.device)
    mids = (table[1:] + table[:-1]) / 2  # 0.25, 0.75, ..., 5: the rounding boundaries
    a = v.abs()
    code = torch.bucketize(a, mids)  # a == mids[j] lands on code j, the smaller neighbour
    tie_odd = (a == mids[code.clamp(max=len(mids) - 1)]) & (code % 2 == 1)
    code = code + tie_odd.to(code.dtype)
    return (code | ((v < 0).to(code.dtype) << 3)).to(torch.uint8)


def check_mxfp4(where: str, q: QTensor) -> None:
    """uint8 data [.., N, K/2] with uint8 scales [.., N, K/32], else a ValueError naming `where`."""
    *lead, n, half = q.data.shape
    if q.data.dtype != torch.uint8 or q.scale.dtype != torch.uint8:
        raise ValueError(f"{where}: MXFP4 data and scale must be uint8, got {q.data.dtype} and {q.scale.dtype}")
    if (2 * half) % MX_GROUP or tuple(q.scale.shape) != (*lead, n, 2 * half // MX_GROUP):
        raise ValueError(f"{where}: MXFP4 data {tuple(q.data.shape)} (K = {2 * half}) needs K a multiple of "
                         f"{MX_GROUP} and scales {(*lead, n, 2 * half // MX_GROUP)}, got {tuple(q.scale.shape)}")


def _quantize_mxfp4_matrix(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w_NK.shape
    w_NGC = w_NK.float().reshape(n, k // MX_GROUP, MX_GROUP)
    amax_NG = w_NGC.abs().amax(dim=-1)
    # frexp: amax / 6 = m * 2^e with m in [0.5, 1), so ceil(log2(amax / 6)) is e, or e - 1 when m = 0.5
    mant_NG, e_NG = torch.frexp(amax_NG / 6)
    exp_NG = (e_NG - (mant_NG == 0.5).to(e_NG.dtype)).float().clamp(-E8M0_BIAS, E8M0_BIAS)
    exp_NG = torch.where(amax_NG > 0, exp_NG, torch.full_like(exp_NG, -E8M0_BIAS))
    code_NK = _round_e2m1(w_NGC / torch.exp2(exp_NG)[..., None]).reshape(n, k)
    return code_NK[:, 0::2] | (code_NK[:, 1::2] << 4), (exp_NG + E8M0_BIAS).to(torch.uint8)


@typed
def quantize_mxfp4(w_NK: Float[Tensor, "*E N K"]) -> QTensor:
    """W [..., N, K] -> QTensor(codes uint8 [..., N, K/2], E8M0 scales uint8 [..., N, K/32], MXFP4).

    K must be a multiple of 32. A group's scale is 2^ceil(log2(amax / 6)), clamped to the
    E8M0 range (an all-zero group gets 2^-127 and codes 0). Leading dims (an expert stack) are
    quantised one matrix at a time, so the temporaries stay one matrix large."""
    *lead, n, k = w_NK.shape
    if k % MX_GROUP:
        raise ValueError(f"quantize_mxfp4: K = {k} is not a multiple of the MXFP4 group ({MX_GROUP})")
    w_BNK = w_NK.reshape(-1, n, k)
    data = torch.empty(w_BNK.shape[0], n, k // 2, dtype=torch.uint8, device=w_NK.device)
    scale = torch.empty(w_BNK.shape[0], n, k // MX_GROUP, dtype=torch.uint8, device=w_NK.device)
    for i in range(w_BNK.shape[0]):
        data[i], scale[i] = _quantize_mxfp4_matrix(w_BNK[i])
    return QTensor(data.view(*lead, n, k // 2), scale.view(*lead, n, k // MX_GROUP), MXFP4)


def _dequantize_mxfp4(q: QTensor, dtype: torch.dtype) -> torch.Tensor:
    check_mxfp4("dequantize", q)
    *lead, n, half = q.data.shape
    table = torch.tensor(E2M1_VALUES, device=q.data.device)
    data_BNH, scale_BNG = q.data.reshape(-1, n, half), q.scale.reshape(-1, n, 2 * half // MX_GROUP)
    out = torch.empty(data_BNH.shape[0], n, 2 * half, dtype=dtype, device=q.data.device)
    for i in range(out.shape[0]):  # one matrix at a time: the int64 codes are 8 bytes a value
        codes = torch.stack((data_BNH[i] & 15, data_BNH[i] >> 4), dim=-1).reshape(n, 2 * half).long()
        values = table[codes & 7] * (1 - 2 * (codes >> 3)).float()
        scale = torch.exp2(scale_BNG[i].float() - E8M0_BIAS)  # s = 255 (NaN in E8M0) would be 2^128 = inf
        scale = torch.where(scale_BNG[i] == 255, torch.full_like(scale, float("nan")), scale)
        out[i] = values * scale.repeat_interleave(MX_GROUP, dim=-1)
    return out.view(*lead, n, 2 * half)


@typed
def dequantize(q: QTensor, dtype: torch.dtype = torch.bfloat16) -> Float[Tensor, "*E N K"]:
    """QTensor -> dense [..., N, K] in `dtype` (products formed in fp32, rounded once)."""
    if q.fmt == MXFP4:
        return _dequantize_mxfp4(q, dtype)
    if q.fmt != FP8_BLOCK:
        raise ValueError(f"dequantize: unsupported QTensor format {q.fmt!r} (expected {FP8_BLOCK!r} or {MXFP4!r})")
    *lead, n, k = q.data.shape
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    if tuple(q.scale.shape) != (*lead, nb, kb):
        raise ValueError(
            f"dequantize: scale shape {tuple(q.scale.shape)} does not match data {tuple(q.data.shape)} "
            f"(expected {(*lead, nb, kb)})"
        )
    # repeat_interleave then crop handles the partial last block without padding the data
    scale_NK = q.scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return (q.data.float() * scale_NK[..., :n, :k]).to(dtype)


@typed
def quantize_fp8_act_ref(
    x_TK: Float[Tensor, "T K"], group: int = BLOCK
) -> tuple[Float[Tensor, "T K"], Float[Tensor, "T G"]]:
    """Per-token 1x128 groups: x -> (q fp8 [T, K], scale fp32 [T, G]), x ~= q * scale.

    The definition the Triton quantiser reproduces bitwise: fp32 amax per group,
    scale = max(amax, 1e-10) / 448 and q = clamp(x / scale, +-448) rounded to nearest
    even, both divisions IEEE. K not a multiple of 128: the last group is partial.
    """
    if group != BLOCK:
        raise ValueError(f"quantize_fp8_act_ref: FP8 activations use 1x{BLOCK} groups, got group={group}")
    t, k = x_TK.shape
    g = _cdiv(k, group)
    x_TGC = F.pad(x_TK.float(), (0, g * group - k)).view(t, g, group)  # C = 128 within a group
    scale_TG = _scale_from_amax(x_TGC.abs().amax(dim=-1))
    q_TGC = (x_TGC / scale_TG[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q_TGC.view(t, g * group)[:, :k].contiguous(), scale_TG


@typed
def dequantize_fp8_act(
    q_TK: Float[Tensor, "T K"], scale_TG: Float[Tensor, "T G"], dtype: torch.dtype = torch.bfloat16
) -> Float[Tensor, "T K"]:
    """(q fp8 [T, K], scale [T, G]) -> q * scale in `dtype`; any scale strides (M-major too)."""
    t, k = q_TK.shape
    if scale_TG.shape[1] != _cdiv(k, BLOCK):
        raise ValueError(f"dequantize_fp8_act: scale has {scale_TG.shape[1]} groups, K={k} needs {_cdiv(k, BLOCK)}")
    scale_TK = scale_TG.float().repeat_interleave(BLOCK, dim=-1)[:, :k]
    return (q_TK.float() * scale_TK).to(dtype)


# Which block-scaled FP8 GEMM this torch and GPU have (layers/linear.py and kernels/moe/up_cublas.py
# run it): torch.nn.functional.scaled_mm ("v2", torch >= 2.10) or torch._scaled_mm ("v1").
def has_scaled_mm_v2() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")


def block_recipes():
    """(1x128, 128x128) ScalingType members of scaled_mm v2; early releases spelled them Blockwise_1x128."""
    st = F.ScalingType
    a = getattr(st, "BlockWise1x128", None) or getattr(st, "Blockwise_1x128")
    b = getattr(st, "BlockWise128x128", None) or getattr(st, "Blockwise_128x128")
    return a, b


@functools.cache
def block_scaled_mm_available(device: torch.device) -> bool:
    """Hopper with a CUDA build whose cuBLASLt has 1x128 / 128x128 block scaling (added in 12.9)."""
    if device.type != "cuda" or torch.version.cuda is None:
        return False
    cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
    return cuda >= (12, 9) and torch.cuda.get_device_capability(device)[0] == 9
