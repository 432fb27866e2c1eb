"""Paged attention for MiMo (causal with a cached prefix, sliding window, sinks, GQA), by module:

common.py    the contract every implementation keeps, the shared Triton helpers and input checks
ref.py       the plain-torch references: `attend` (dense) and `paged_attention_ref` (the oracle)
prefill.py   the Triton flash-attention loop kernel over a ragged batch (`launch_prefill`)
swa.py       the one-pass sliding-window band kernel (`launch_swa_band`)
ws.py        the warp-specialised Gluon kernel for full attention on Hopper (`launch_prefill_ws`)
fp8.py       full attention with Q, K, V in FP8 behind options.attention_fp8 (`attention_fp8`, its twin
             `attention_fp8_ref`)
fp8_inputs.py  its quantisers of Q and the paged K/V (`quantize_q_fp8`, `quantize_paged_kv_fp8`)
decode.py    the split-K kernel for one query per sequence (`paged_decode_attention`)
dispatch.py  the one place that picks among them: `attention`, `paged_attention`

The names below are the family's public entry points, re-exported.
"""

from mimo_fn.kernels.attention.decode import DecodeConfig, launch_decode, paged_decode_attention  # noqa: F401
from mimo_fn.kernels.attention.dispatch import attention, paged_attention  # noqa: F401
from mimo_fn.kernels.attention.fp8 import attention_fp8, attention_fp8_ref  # noqa: F401
from mimo_fn.kernels.attention.prefill import PrefillConfig, default_prefill_config, launch_prefill  # noqa: F401
from mimo_fn.kernels.attention.ref import attend, paged_attention_ref  # noqa: F401
