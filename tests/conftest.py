import os

# Shape-check every @typed public function under beartype (see mimo_fn/_types.py).
os.environ.setdefault("MIMO_FN_TYPECHECK", "1")

# The MoE GEMMs launch their default configs, not autotuned ones: on a GPU every new size bucket
# would compile and time each config of the lists (test_moe_kernels' test_every_tuning_config runs
# them all once, test_autotune_cache turns tuning on for itself).
os.environ.setdefault("MIMO_FN_MOE_AUTOTUNE", "0")

# Without a GPU, Triton kernels run in the interpreter. It must be chosen before anything
# imports triton, and importing mimo_fn does.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
