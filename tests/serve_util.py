"""The tiny server as a real process on 127.0.0.1 (mimo_fn.serve.process with the tests' flags and
environment), and the in-process references its answers must equal."""

import os
import time

import httpx
import pytest
import torch

import mimo_fn as mf
from mimo_fn.serve.process import ServerProcess, launch_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 16
POOL = 2048
# on the CPU in fp32 also on a GPU machine: the tests compare with tiny_engine, an fp32 engine on the CPU
TINY_FLAGS = ["--page-size", str(PAGE), "--max-total-tokens", str(POOL), "--log-level", "warning", "--device", "cpu"]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's mimo_fn
    env.setdefault("OMP_NUM_THREADS", "1")  # the tests share two cores with other processes
    env["MIMO_FN_TYPECHECK"] = "0"  # a server as users run it (the engine's own tests check the shapes)
    return env


def start_server(tmp_dir: str, *flags: str, nproc: int = 1, name: str = "server") -> ServerProcess:
    """The tiny server on a free port (under torchrun with nproc > 1), its log tmp_dir/name.log;
    returns once /health answers."""
    return launch_server([*TINY_FLAGS, *flags], log_path=os.path.join(tmp_dir, f"{name}.log"), env=child_env(),
                         cwd=ROOT, nproc=nproc, timeout=180.0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The in-process references run on one thread while the tests' servers run: two threads on
    two cores shared with a server process (or more) made each step ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_engine(**config) -> mf.Engine:
    """The server's model in this process: the tiny config, seed-0 weights, fp32, the server's pool."""
    cfg = mf.ModelConfig.tiny()
    return mf.Engine(cfg, mf.init_params(cfg, seed=0), mf.EngineConfig(max_tokens=POOL, page_size=PAGE, **config))


def random_prompts(n: int, lengths, seed: int = 0, vocab: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def pages_settle(url: str, want_used: int, timeout: float = 20.0) -> dict:
    """/get_server_info once num_used_pages is want_used and nothing runs (pages come back a pass
    after an abort); the last info if it never gets there."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        done = info["num_used_pages"] == want_used and info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if done or time.monotonic() > deadline:
            return info
        time.sleep(0.1)
