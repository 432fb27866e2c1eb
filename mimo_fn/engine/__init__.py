"""The stateful shell over the step functions: Engine (online: add_request / step / abort; offline:
generate), its EngineConfig, and what the shell keeps across passes (prompt copies, the prefix cache)."""

from mimo_fn.engine.config import EngineConfig
from mimo_fn.engine.engine import Engine, Output, RequestOutput

__all__ = ["Engine", "EngineConfig", "Output", "RequestOutput"]
