import os

# Shape-check every @typed public function under beartype (see mimo_fn/_types.py).
os.environ.setdefault("MIMO_FN_TYPECHECK", "1")

# Without a GPU, Triton kernels run in the interpreter. It must be chosen before anything
# imports triton, and importing mimo_fn does.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass
