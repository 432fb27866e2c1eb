"""Start `python -m mimo_fn.serve` as a child process, wait until it answers, stop it.

    with launch_server(["--device", "cpu", "--skip-warmup"]) as server:   # a free port of 127.0.0.1
        EngineClient(server.url).generate(...)

What tests, scripts, examples and benchmarks need of a server they own: a free port, the server's
output in a log file (whose tail an error shows), the same mimo_fn as this process, and a stop
that also ends its children (torchrun's workers). Loads nothing of the server itself: stdlib, and
httpx when it polls.
"""

import os
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time

# the directory holding this mimo_fn package: the child imports the same one
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before the server binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _with_this_mimo_fn(env: dict) -> dict:
    """env with this mimo_fn's directory first on PYTHONPATH, unless the interpreter finds it anyway
    (an installed package: putting site-packages before the stdlib could shadow a stdlib module)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _ROOT in paths or _ROOT in site.getsitepackages():
        return env
    return {**env, "PYTHONPATH": os.pathsep.join([_ROOT, *paths])}


class ServerProcess:
    """A child process (any command: the server, torchrun over it, a router) writing to a log file,
    in its own process group so that stop() ends its children too; `url` is where it listens."""

    def __init__(self, cmd: list[str], *, port: int, log_path: str, host: str = "127.0.0.1",
                 env: dict | None = None, cwd: str | None = None):
        self.cmd, self.port, self.log_path, self.url = cmd, port, log_path, f"http://{host}:{port}"
        with open(log_path, "w") as log:  # the child holds its own copy of the descriptor
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, chars: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - chars))
            return f.read().decode(errors="replace")

    def wait_healthy(self, timeout: float = 300.0, path: str = "/health") -> "ServerProcess":
        """Polls GET url+path until it answers 200. RuntimeError (with the log's tail) if the process
        exits first, or if it is not healthy within `timeout` seconds (then it is stopped)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"the server for {self.url} exited with {self.popen.returncode} before it was "
                                   f"healthy; the end of its log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:  # not listening yet
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server at {self.url} was not healthy ({path}) after {timeout:.0f} s; the end of "
                           f"its log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the process group, SIGKILL if it is still there after `timeout` s; the exit code."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(flags: list[str], *, host: str = "127.0.0.1", port: int | None = None, log_path: str | None = None,
                  env: dict | None = None, cwd: str | None = None, nproc: int = 1, timeout: float = 300.0,
                  health: str = "/health") -> ServerProcess:
    """`python -m mimo_fn.serve --host host --port port *flags` (under `torch.distributed.run
    --standalone` with nproc > 1), once GET `health` answers 200.

    port: None picks a free one. log_path: the server's stdout and stderr (None: a new temporary
    file). env: the child's whole environment (None: this process's); this mimo_fn's directory is
    put first on its PYTHONPATH. Raises RuntimeError, with the log's tail, if the server exits
    before it is healthy or is not healthy within `timeout` seconds."""
    port = free_port(host) if port is None else port
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"mimo_fn_serve_{port}_", suffix=".log")
        os.close(fd)
    serve = ["-m", "mimo_fn.serve", "--host", host, "--port", str(port), *flags]
    if nproc > 1:
        serve = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *serve]
    env = _with_this_mimo_fn(dict(os.environ) if env is None else env)
    server = ServerProcess([sys.executable, *serve], port=port, log_path=log_path, host=host, env=env, cwd=cwd)
    try:
        return server.wait_healthy(timeout, health)
    except BaseException:  # Ctrl-C while it starts: no server left behind
        server.stop()
        raise
