"""The fused in-place RoPE kernel against `mimo_fn.layers.rope.apply_rope`, bit for bit.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from mimo_fn.kernels.rope import rope_  # noqa: E402
from mimo_fn.layers.rope import apply_rope, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_tokens,num_heads,head_d,rope_dim", [(7, 8, 192, 64), (5, 3, 12, 4), (3, 17, 48, 10)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_matches_reference_bitwise(num_tokens, num_heads, head_d, rope_dim, dtype):
    gen = torch.Generator().manual_seed(num_heads * head_d)
    x = (torch.randn(num_tokens, num_heads, head_d, generator=gen) * 3).to(dtype=dtype, device=DEVICE)
    pos = torch.randint(0, 70000, (num_tokens,), generator=gen).to(DEVICE)  # large angles too
    cos, sin = rope_cos_sin(pos, rope_dim, 5e6 if head_d > 100 else 1e4, dtype)
    ref = apply_rope(x, cos, sin)
    out = rope_(x.clone(), cos, sin)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max().item()
    assert torch.equal(out[..., rope_dim:], x[..., rope_dim:])  # the pass-through dims stay


def test_rope_strided_heads_in_place():
    # q as the engine makes it: a view of a projection; heads strided, only the view's dims change
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(4, 6 * 16 + 5, generator=gen).bfloat16().to(DEVICE)
    x = buf[:, :96].view(4, 6, 16)
    cos, sin = rope_cos_sin(torch.arange(4, device=DEVICE) * 1000, 8, 1e4, torch.bfloat16)
    ref, tail = apply_rope(x, cos, sin), buf[:, 96:].clone()
    assert rope_(x, cos, sin).data_ptr() == x.data_ptr()
    assert torch.equal(x, ref) and torch.equal(buf[:, 96:], tail)


def test_rope_bad_inputs():
    x = torch.randn(2, 3, 8, device=DEVICE)
    cos, sin = rope_cos_sin(torch.arange(2, device=DEVICE), 4, 1e4, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        rope_(x, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(ValueError, match="even rope dim"):
        rope_(x, cos[:, :3], sin[:, :3])
