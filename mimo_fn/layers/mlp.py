"""Dense SwiGLU MLP (layer 0): down(silu(gate(x)) * up(x)).

Legend: T tokens, H hidden.
"""

import torch.nn.functional as F

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.layers.linear import linear, quantize_once
from mimo_fn.params import DenseMLP


@typed
def dense_mlp(x_TH: Float[Tensor, "T H"], mlp: DenseMLP, deterministic: bool = False) -> Float[Tensor, "T H"]:
    """deterministic: the fixed-tiling linears (mimo_fn.layers.linear)."""
    det = deterministic
    x_TH = quantize_once(x_TH, (mlp.w_gate, mlp.w_up), det)  # one quantiser launch for both
    h_TI = F.silu(linear(x_TH, mlp.w_gate, deterministic=det)) * linear(x_TH, mlp.w_up, deterministic=det)
    return linear(h_TI, mlp.w_down, deterministic=det)
