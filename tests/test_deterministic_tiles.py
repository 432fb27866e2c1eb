"""Deterministic mode's two tile sizes run the same MMA instruction in every warpgroup.

The mode's linears and MoE GEMMs take a small tile below a token count and a large one from it
(fixed_gemm.tiles_for, fp8_linear.det_tiles, moe.gemm.det_block_m); a row's bits may then not
change with the tile only if each warpgroup computes its 64 rows with the same wgmma instruction
in the same K order at both sizes. tests/test_deterministic.py checks the bits on the GPU; this
checks the instructions on any machine, by compiling each kernel for sm_90 (Triton's ahead-of-time
path: no GPU needed) and reading the wgmma shapes out of the PTX. The compiles run in a process
of their own: under TRITON_INTERPRET (the CPU tests' setting) the kernels are not compilable.
"""

import json
import os
import re

import pytest


def wgmma_shapes(fn, types: dict, consts: dict, warps: int, stages: int) -> list[str]:
    """The wgmma instruction shapes (e.g. "m64n128k32") of fn compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    return sorted(set(re.findall(r"wgmma\.mma_async\S*\.(m64n\d+k\d+)", k.asm["ptx"])))


def _desc(dtype: str, *shape: int) -> str:
    return f"tensordesc<{dtype}[{', '.join(map(str, shape))}]>"


def probe() -> dict[str, list[list[str]]]:
    """name -> [the small tile's shapes, the large tile's] for every deterministic GEMM."""
    from mimo_fn.kernels import fixed_gemm as fg
    from mimo_fn.kernels import fp8_linear as fl
    from mimo_fn.kernels.moe import gemm as moe_gemm
    from mimo_fn.kernels.moe.gemm_kernels import _moe_down_kernel, _moe_up_kernel

    out = {}
    types = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16")
    out["fixed_gemm"] = [wgmma_shapes(fg._fixed_gemm_kernel, types,
                                      dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8,
                                           EVEN_K=True, IEEE=False, INTERPRET=False), t.num_warps, t.num_stages)
                         for t in (fg.CUDA_TILES, fg.CUDA_TILES_LARGE_M)]
    types = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16")
    out["fp8_linear"] = [wgmma_shapes(fl._fp8_linear_kernel, types,
                                      dict(BLOCK_M=bm, BLOCK_N=bn, GROUP=128, INTERPRET=False), warps, stages)
                         for bm, bn, warps, stages in (fl.DET_TILES, fl.DET_TILES_LARGE_M)]
    ids = dict(sorted_ids_ptr="*i32", expert_of_block_ptr="*i32", num_post_pad_ptr="*i32")
    common = dict(GROUP_M=8, IEEE=False, INTERPRET=False, EVEN_K=True, SCALAR_WS=True, W_DESC=True,
                  MAX_IMPRECISE=None, PERSISTENT=False, NUM_PROGS=1, HALF_TAILS=False)
    for kind in ("bf16", "fp8"):  # both GEMMs with _det_config's configs, TMA weights (as on CUDA)
        fp8 = kind == "fp8"
        dt, bk = ("fp8e4nv", 128) if fp8 else ("bf16", 64)
        for stage, fn in enumerate((_moe_up_kernel, _moe_down_kernel)):
            shapes = []
            for bm in (moe_gemm.DET_BLOCK_M["cuda"], moe_gemm.DET_BLOCK_M_LARGE["cuda"]):
                cfg = moe_gemm._det_config(kind, stage, bm)
                bn = cfg.kwargs["BLOCK_N"]
                assert cfg.kwargs["BLOCK_K"] == bk, cfg
                if stage == 0:
                    types = dict(x_ptr=f"*{dt}", xs_ptr="*fp32", w_ptr=f"*{dt}", w_desc=_desc(dt, bn, bk),
                                 w3_desc=_desc(dt, 2, bn, bk), ws_ptr="*fp32", h_ptr=f"*{dt}", hs_ptr="*fp32",
                                 **ids)
                    consts = dict(TOP_K=8, FP8=fp8, QUANT_H=fp8, FUSED_GU=cfg.kwargs.get("FUSED_GU", False))
                else:
                    types = dict(h_ptr=f"*{dt}", h_desc=_desc(dt, bm, bk), hs_ptr="*fp32", w_ptr=f"*{dt}",
                                 w_desc=_desc(dt, bn, bk), ws_ptr="*fp32", y_ptr="*bf16", topk_w_ptr="*fp32", **ids)
                    consts = dict(FP8=fp8)
                consts.update(common, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
                shapes.append(wgmma_shapes(fn, types, consts, cfg.num_warps, cfg.num_stages))
            out[f"moe {kind} {('up', 'down')[stage]}"] = shapes
    return out


@pytest.fixture(scope="module")
def shapes():
    from compile_util import run_probe

    return run_probe(os.path.abspath(__file__), timeout=600)


@pytest.mark.parametrize("name", ["fixed_gemm", "fp8_linear", "moe bf16 up", "moe bf16 down", "moe fp8 up",
                                  "moe fp8 down"])
def test_both_tiles_run_one_instruction(shapes, name):
    small, large = shapes[name]
    assert len(small) == 1 and small == large, (name, small, large)


if __name__ == "__main__":
    print(json.dumps(probe()))
