"""mimo_fn: a functional prefill and rollout engine for MiMo-V2-Flash-class models."""

from mimo_fn import params
from mimo_fn.checkpoint import load_checkpoint, save_checkpoint
from mimo_fn.config import ModelConfig
from mimo_fn.model import forward
from mimo_fn.params import Params, init_params

__all__ = ["ModelConfig", "Params", "init_params", "load_checkpoint", "save_checkpoint", "forward", "params"]
