"""Helpers to build random transformers MiMoV2Flash reference models for parity tests."""

import torch
from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM


def random_hf_model(seed: int = 0, **overrides) -> MiMoV2FlashForCausalLM:
    """A small random MiMoV2FlashForCausalLM in fp32 whose norms, sinks and router biases are
    also random (transformers initialises them to constants, which would hide mistakes)."""
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=5)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = MiMoV2FlashForCausalLM(MiMoV2FlashConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.1)
    return model
