"""The CUDA default tile configs of the attention kernels fit an H100/H200's shared memory.

A config that asks for more than sm_90's 227 KB only fails when it is launched on the GPU
(fp32 full attention once asked for 320 KB). Here each default config is compiled for sm_90
on any machine, at MiMo-V2-Flash's head dims, in bf16 and fp32, and its shared memory is
read from the compiled kernel. Compiling needs real (not interpreted) Triton kernels, and
other test modules set TRITON_INTERPRET=1 before triton loads, so the compiles run in a
subprocess: this file run as a script.
"""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

SM90_SHARED_BYTES = 227 * 1024  # the most one block may use on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)
HEADS, KV_HEADS, HEAD_D, HEAD_E, PAGE = 64, 4, 192, 128, 128  # MiMo-V2-Flash's full-attention layers
CASES = [(kind, dtype, window) for kind in ("prefill", "decode") for dtype in ("bfloat16", "float32")
         for window in (0, 128)]
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}


def _capture(module, names, launch):
    """Run `launch` with module's kernels `names` replaced by recorders: [(kernel, args, kwargs)]
    of the first one's launches; nothing runs."""
    calls, real = [], {n: getattr(module, n) for n in names}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.kernel, args, kwargs))

    for n in names:
        setattr(module, n, Recorder(real[n]))
    try:
        launch()
    finally:
        for n in names:
            setattr(module, n, real[n])
    return [c for c in calls if c[0] is real[names[0]]]


def _shared_bytes_sm90(kernel, args, kwargs) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if kwargs.get(k) is not None}
    kwargs.pop("maxnreg", None)
    signature = {}
    for name, value in zip(inspect.signature(kernel.fn).parameters, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    signature.update({name: "constexpr" for name in kwargs})
    src = ASTSource(fn=kernel, signature=signature, constexprs=kwargs)
    target = GPUTarget("cuda", 90, 32)
    try:
        return _shared_bytes_at_llir(src, target, options)
    except (AttributeError, TypeError, KeyError):  # triton's stage internals moved: the whole compile
        return triton.compile(src, target=target, options=options).metadata.shared


def _shared_bytes_at_llir(src, target, options) -> int:
    """triton.compile's stages run by hand up to LLVM IR, where the shared-memory allocation is
    final; the PTX and cubin stages (ptxas) after it take most of a big kernel's compile time."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    opts = backend.parse_options(options)
    stages = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata = {}
    for name, stage in stages.items():
        module = stage(module, metadata)
        if name == "llir":
            return metadata["shared"]
    raise KeyError("llir")


def _measure(kind: str, dtype_name: str, window: int) -> int:
    """Shared memory (bytes) of the kernel that `kind` runs on CUDA at the default config."""
    from mimo_fn.kernels.attention import decode as attention_decode
    from mimo_fn.kernels.attention import prefill as attention

    dtype = getattr(torch, dtype_name)
    q = torch.randn(8, HEADS, HEAD_D, dtype=dtype)
    k = torch.randn(4, PAGE, KV_HEADS, HEAD_D, dtype=dtype)
    v = torch.randn(4, PAGE, KV_HEADS, HEAD_E, dtype=dtype)
    sinks = torch.zeros(HEADS)
    if kind == "prefill":
        # the config the CUDA launch picks (launch_prefill on CPU would pick the interpreter's)
        cfg = attention.default_prefill_config(HEADS, KV_HEADS, window, True, PAGE, dtype)
        cu, lens, table = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([100], dtype=torch.int32), \
            torch.zeros(1, 4, dtype=torch.int32)
        calls = _capture(attention, ["_attn_prefill_kernel"], lambda: attention.launch_prefill(
            q, k, v, table, cu, lens, 0.1, window, sinks, config=cfg))
    else:
        cfg = attention_decode.DecodeConfig()  # launch_decode's CUDA default
        cu, lens, table = torch.arange(9, dtype=torch.int32), torch.full((8,), 100, dtype=torch.int32), \
            torch.zeros(8, 4, dtype=torch.int32)
        calls = _capture(attention_decode, ["_attn_decode_split_kernel", "_attn_decode_reduce_kernel"],
                         lambda: attention_decode.launch_decode(q, k, v, table, cu, lens, 0.1, window, sinks,
                                                                config=cfg))
    (kernel, args, kwargs), = calls
    return _shared_bytes_sm90(kernel, args, kwargs)


@pytest.fixture(scope="module")
def shared_bytes():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MIMO_FN_TYPECHECK"] = "0"
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {tuple(c): n for c, n in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("kind,dtype,window", CASES)
def test_default_config_fits_sm90_shared_memory(shared_bytes, kind, dtype, window):
    used = shared_bytes[(kind, dtype, window)]
    assert 0 < used <= SM90_SHARED_BYTES, f"{kind} {dtype} window={window}: {used} bytes of shared memory"


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    print(json.dumps([[list(c), _measure(*c)] for c in CASES]))
