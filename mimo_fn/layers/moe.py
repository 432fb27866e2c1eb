"""The MoE block: route, then the expert GEMMs (Triton on CUDA, the plain-torch twin elsewhere).

Legend: T tokens, H hidden, K experts per token.
"""

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.moe_gemm import fused_moe_ref
from mimo_fn.layers.router import route
from mimo_fn.params import MoE


@typed
def moe(x_TH: Float[Tensor, "T H"], mlp: MoE, cfg: ModelConfig) -> tuple[Float[Tensor, "T H"], Int[Tensor, "T K"]]:
    """Returns the block's output and the routed expert ids (for routing capture / replay)."""
    weights_TK, ids_TK = route(x_TH, mlp.router, mlp.router_bias, cfg)
    return fused_moe_ref(x_TH, mlp.w13, mlp.w2, ids_TK, weights_TK), ids_TK
