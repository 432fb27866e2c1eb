"""The attention block's projections: QKV with partial RoPE and value scale, and the output.

Legend: T tokens, H hidden, N query heads, G kv heads, D q/k head dim, E v head dim.
The attention itself (dense `attend`, or paged kernels in the engine) sits between these.
"""

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.config import ModelConfig
from mimo_fn.kernels.rope import rope_
from mimo_fn.layers.linear import linear, quantize_once
from mimo_fn.layers.rope import apply_rope, rope_cos_sin
from mimo_fn.params import Attention
from mimo_fn.quant import QActs


@typed
def project_qkv(
    x_TH: Float[Tensor, "T H"] | QActs, attn: Attention, cfg: ModelConfig, layer: int, pos_T: Int[Tensor, " T"]
) -> tuple[Float[Tensor, "T N D"], Float[Tensor, "T G D"], Float[Tensor, "T G E"]]:
    num_tokens, D, E = x_TH.shape[0], cfg.head_dim, cfg.v_head_dim
    x_TH = quantize_once(x_TH, (attn.wq, attn.wk, attn.wv))  # decode: one quantiser launch for the three
    # head counts come from the weights: under attention TP they are this rank's heads
    q_TND = linear(x_TH, attn.wq).view(num_tokens, attn.wq.shape[0] // D, D)
    k_TGD = linear(x_TH, attn.wk).view(num_tokens, attn.wk.shape[0] // D, D)
    v_TGE = linear(x_TH, attn.wv).view(num_tokens, attn.wv.shape[0] // E, E) * cfg.attention_value_scale
    cos_TR, sin_TR = rope_cos_sin(pos_T, cfg.rope_dim, cfg.theta(layer), x_TH.dtype)
    if q_TND.is_cuda:  # one kernel in place (q and k are this function's own): apply_rope's bits
        return rope_(q_TND, cos_TR, sin_TR), rope_(k_TGD, cos_TR, sin_TR), v_TGE
    return apply_rope(q_TND, cos_TR, sin_TR), apply_rope(k_TGD, cos_TR, sin_TR), v_TGE


@typed
def project_out(o_TNE: Float[Tensor, "T N E"], attn: Attention) -> Float[Tensor, "T H"]:
    return linear(o_TNE.reshape(o_TNE.shape[0], o_TNE.shape[1] * o_TNE.shape[2]), attn.wo)
