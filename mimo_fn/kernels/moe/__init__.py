"""The MoE expert GEMMs, by module:

dispatch.py       the one place that picks format, kernel or reference, and the MXFP4 path:
                  `moe_experts` (what layers/moe.py calls), `fused_moe_mxfp4`
align.py          sort (token, k) pairs by expert into block-aligned segments (`moe_align`, `_ref`)
gemm.py           bf16 / fp32 / FP8 grouped GEMMs: launch configs, launchers, `fused_moe`, `fused_moe_fp8`
gemm_kernels.py   their Triton kernels
down_ws.py        the FP8 down GEMM warp-specialised in Gluon for Hopper (fused_moe_fp8's down_ws, on)
up_ws.py          the FP8 up GEMM (+SiLU*up) warp-specialised in Gluon for Hopper (up_ws, on at
                  large token counts)
ws_pair.py        what up_ws and down_ws share: two weight boxes a K step, one partial
slots.py          x in the up GEMMs' slot order: quantised straight into it, or gathered
up_cublas.py      the FP8 up GEMM as cuBLASLt block-scaled GEMMs per expert (opt-in)
mxfp4_codec.py    MXFP4 codes and scales decoded in Triton (portable and PTX)
mxfp4.py          the grouped GEMMs on MXFP4 weights, dequantised in the kernel (W4A16)
mxfp4_dequant.py  MXFP4 weights dequantised in bulk into a dense copy (`dequant_mxfp4`, `_ref`)
ref.py            the plain-torch oracles `fused_moe_ref`, `fused_moe_fp8_ref`, `fused_moe_mxfp4_ref`

The names below are the family's public entry points, re-exported.
"""

from mimo_fn.kernels.moe.align import moe_align, moe_align_ref  # noqa: F401
from mimo_fn.kernels.moe.dispatch import fused_moe_mxfp4, moe_experts  # noqa: F401
from mimo_fn.kernels.moe.gemm import fused_moe, fused_moe_fp8  # noqa: F401
from mimo_fn.kernels.moe.mxfp4_dequant import dequant_mxfp4, dequant_mxfp4_ref  # noqa: F401
from mimo_fn.kernels.moe.ref import fused_moe_fp8_ref, fused_moe_mxfp4_ref, fused_moe_ref  # noqa: F401
