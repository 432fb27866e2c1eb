"""Shape-checked annotations that cost nothing in production.

`typed` wraps a function in `jaxtyping.jaxtyped(typechecker=beartype)` only when the
environment variable MIMO_FN_TYPECHECK=1 is set before mimo_fn is imported (the test
suite's conftest sets it; `mimo_fn.options` reads it). Otherwise it returns the function
unchanged, so serving pays no per-call checking and beartype need not be installed.
"""

from typing import Callable, TypeVar

from jaxtyping import Bool, Float, Int, Shaped  # noqa: F401  (re-exported for annotations)
from torch import Tensor  # noqa: F401

from mimo_fn.options import OPTIONS

F = TypeVar("F", bound=Callable)

TYPECHECK = OPTIONS.typecheck  # decorations happen at import: the value then is the one that counts


def typed(fn: F) -> F:
    if not TYPECHECK:
        return fn
    from beartype import beartype
    from jaxtyping import jaxtyped

    return jaxtyped(typechecker=beartype)(fn)
