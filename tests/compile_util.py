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
