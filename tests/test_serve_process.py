"""mimo_fn.serve.process: launch_server starts the real tiny server on the CPU and returns once it
is healthy; stop() ends it; a server that exits while starting, or never answers, is an error that
names what happened and shows the end of its log."""

import os
import sys

import httpx
import pytest

from mimo_fn.serve.process import ServerProcess, free_port, launch_server
from serve_util import ROOT, TINY_FLAGS, child_env


def test_launch_answers_then_stop_ends_it(tmp_path):
    log = tmp_path / "server.log"
    with launch_server([*TINY_FLAGS, "--skip-warmup"], log_path=str(log), env=child_env(), cwd=ROOT,
                       timeout=120) as server:
        assert server.url == f"http://127.0.0.1:{server.port}" and server.pid == server.popen.pid
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        out = httpx.post(server.url + "/generate", timeout=60, json={
            "input_ids": [5, 9, 17, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                            "ignore_eos": True}}).json()
        assert len(out["output_ids"]) == 4
        assert server.stop() is not None and server.popen.poll() is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    assert server.stop() == server.popen.returncode  # a second stop (the with block's) is a no-op


def test_a_server_that_exits_while_starting_names_its_exit_code_and_log(tmp_path):
    log = tmp_path / "bad.log"
    with pytest.raises(RuntimeError) as err:
        launch_server(["--no-such-flag"], log_path=str(log), env=child_env(), cwd=ROOT, timeout=60)
    msg = str(err.value)
    assert "exited with 2" in msg and str(log) in msg
    assert "--no-such-flag" in msg and "--no-such-flag" in log.read_text()  # argparse's complaint, from the log


def test_a_process_that_never_answers_is_stopped_after_the_timeout(tmp_path):
    log = tmp_path / "silent.log"
    cmd = [sys.executable, "-c", "print('listening nowhere', flush=True); import time; time.sleep(60)"]
    proc = ServerProcess(cmd, port=free_port(), log_path=str(log), env=dict(os.environ))
    with pytest.raises(RuntimeError, match=r"not healthy \(/ready\) after 1 s(.|\n)*listening nowhere"):
        proc.wait_healthy(timeout=1.0, path="/ready")
    assert proc.popen.poll() is not None  # stopped, not left behind
