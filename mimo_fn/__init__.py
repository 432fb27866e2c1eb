"""mimo_fn: a functional prefill and rollout engine for MiMo-V2-Flash-class models."""

from mimo_fn import client, parallel, params
from mimo_fn.batch import Batch
from mimo_fn.cache import OutOfPages, capacity
from mimo_fn.checkpoint import load_checkpoint, save_checkpoint
from mimo_fn.config import ModelConfig
from mimo_fn.engine import Engine, EngineConfig, Output, RequestOutput
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.layers.sampling import SamplingParams
from mimo_fn.model import (
    EngineState, StaleStateError, StepOutput, decode, forward, fork, init_state, keep_swa, prefill, release, truncate,
)
from mimo_fn.parallel import init_mesh
from mimo_fn.params import Params, init_params

__all__ = [
    "ModelConfig", "Params", "init_params", "load_checkpoint", "save_checkpoint", "forward",
    "EngineState", "StepOutput", "init_state", "prefill", "decode", "release", "truncate", "fork", "keep_swa",
    "Batch", "OutOfPages", "StaleStateError", "capacity", "Engine", "EngineConfig", "Output", "RequestOutput",
    "SamplingParams", "params", "DecodeGraphs", "parallel", "init_mesh", "client",
]
