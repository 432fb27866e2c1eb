"""FLOP counts used for TFLOP/s and MFU."""

import mimo_fn as mf
from mimo_fn.flops import attention_pairs, layer_flops, prefill_flops


def test_attention_pairs_brute_force():
    for n in (1, 5, 128, 300):
        for w in (0, 1, 4, 128, 1000):
            assert attention_pairs(n, w) == sum(min(p + 1, w) if w else p + 1 for p in range(n))


def test_layer_flops_by_hand():
    cfg = mf.ModelConfig.tiny()  # H 64, N 4, D 24, E 16; layer 1: SWA (2 KV heads, window 8), MoE
    T = 10
    proj = 2 * T * 64 * (4 * 24 + 2 * 24 + 2 * 16) + 2 * T * 4 * 16 * 64
    attn = 2 * 4 * (24 + 16) * attention_pairs(T, 8)
    moe = 2 * T * 2 * 3 * 64 * 32 + 2 * T * 64 * 8
    assert layer_flops(cfg, 1, [T]) == proj + attn + moe
    assert prefill_flops(cfg, [T, 3]) == sum(layer_flops(cfg, i, [T, 3]) for i in range(4))
