"""Dense SwiGLU MLP (layer 0): down(silu(gate(x)) * up(x)).

Legend: T tokens, H hidden.
"""

import torch.nn.functional as F

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.layers.linear import linear
from mimo_fn.params import DenseMLP


@typed
def dense_mlp(x_TH: Float[Tensor, "T H"], mlp: DenseMLP) -> Float[Tensor, "T H"]:
    return linear(F.silu(linear(x_TH, mlp.w_gate)) * linear(x_TH, mlp.w_up), mlp.w_down)
