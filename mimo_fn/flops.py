"""Forward FLOPs of a prefill, for achieved TFLOP/s and MFU (2 FLOPs per multiply-add).

Counts the GEMMs and the attention score/value products; norms, RoPE, softmax and the
LM head (last tokens only in prefill) are left out. A query at position p meets min(p+1,
window) keys on a sliding-window layer and p+1 keys on a full layer (causal: T(T+1)/2
pairs, the count FlashAttention's papers use for causal TFLOP/s).
"""

from mimo_fn.config import ModelConfig


def attention_pairs(seq_len: int, window: int) -> int:
    """(query, key) pairs a causal sequence of seq_len tokens scores, with an optional window."""
    if not window or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def layer_flops(cfg: ModelConfig, i: int, seq_lens: list[int]) -> int:
    """Layer i over sequences of these lengths, prefilled from empty."""
    T = sum(seq_lens)
    H, N, D, E, G = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.v_head_dim, cfg.kv_heads(i)
    proj = 2 * T * H * (N * D + G * D + G * E) + 2 * T * N * E * H
    attn = 2 * N * (D + E) * sum(attention_pairs(n, cfg.window(i)) for n in seq_lens)
    if cfg.is_moe(i):
        mlp = 2 * T * cfg.top_k * 3 * H * cfg.moe_intermediate_size + 2 * T * H * cfg.num_experts
    else:
        mlp = 2 * T * 3 * H * cfg.intermediate_size
    return proj + attn + mlp


def prefill_flops(cfg: ModelConfig, seq_lens: list[int]) -> int:
    return sum(layer_flops(cfg, i, seq_lens) for i in range(cfg.num_layers))
