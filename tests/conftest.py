import os

# Shape-check every @typed public function under beartype (see mimo_fn/_types.py).
os.environ.setdefault("MIMO_FN_TYPECHECK", "1")
