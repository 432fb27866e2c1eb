"""Running a test file's ahead-of-time compile probe (sm_90, no GPU) in a process of its own: under
TRITON_INTERPRET (the CPU tests' setting) Triton's kernels are not compilable."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_probe(script: str, timeout: float, cache_dir: str | None = None):
    """`python script` without TRITON_INTERPRET (and with this checkout first on PYTHONPATH); the
    JSON its last output line prints. cache_dir: a Triton cache of its own (a cached kernel runs no ptxas)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = cache_dir
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def gluon_sm90_facts(fn, sig: dict, consts: dict, attrs: dict, maxnreg: int) -> dict:
    """Compile Gluon kernel fn for sm_90 (no GPU needed, call it without TRITON_INTERPRET); facts of
    its PTX (MMA and TMA instructions, register hand-overs, wgmma waits), its shared memory and
    ptxas's report (registers, spills, serialised wgmmas)."""
    import contextlib
    import io
    import re

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    knobs.nvidia.dump_ptxas_log = True  # Triton prints its own ptxas run's report (cache: see run_probe)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": consts.get("num_warps", 4), "maxnreg": maxnreg})
    ptx = k.asm["ptx"]
    return dict(
        triton=triton.__version__,
        wgmma=sorted(set(re.findall(r"wgmma\.mma_async\S*", ptx))),
        tma=sorted(set(re.findall(r"cp\.async\.bulk\.tensor\S*", ptx))),
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        waits=sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
        shared=k.metadata.shared,
        ptxas=log.getvalue(),
    )
