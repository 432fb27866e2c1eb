"""Shape-checked annotations that cost nothing in production.

`typed` wraps a function in `jaxtyping.jaxtyped(typechecker=beartype)` only when the
environment variable MIMO_FN_TYPECHECK=1 is set before mimo_fn is imported (the test
suite's conftest sets it; `mimo_fn.options` reads it). Otherwise it returns the function
unchanged, so serving pays no per-call checking and beartype need not be installed. Either
way it marks the function (`is_typed`), so a test can tell which public functions carry the
checks.

An argument that does not match its annotation, in a call that no other checked function made
(a user's, or the engine's), raises `ArgumentError`: a ValueError, the project's error for bad user
input, that names the function, the argument, what it got and what it expected (a TypeError
too, as any type-check failure is). A failure inside a checked function (an internal call's
arguments) or of a return value stays jaxtyping's TypeCheckError: that is a bug in mimo_fn,
not bad input.
"""

import contextvars
import functools
import inspect
import re
from typing import Any, Callable, TypeVar

from jaxtyping import AbstractArray, Bool, Float, Int, Shaped, TypeCheckError  # noqa: F401  (re-exported for annotations)
from torch import Tensor  # noqa: F401

from mimo_fn.options import OPTIONS

F = TypeVar("F", bound=Callable)

TYPECHECK = OPTIONS.typecheck  # decorations happen at import: the value then is the one that counts

_MARK = "__mimo_fn_typed__"
_DEPTH = contextvars.ContextVar("mimo_fn_typed_depth", default=0)  # checked calls under way in this thread


class ArgumentError(TypeCheckError, ValueError):
    """A @typed function's argument that does not match its annotation."""


def is_typed(fn: Callable) -> bool:
    """Whether fn went through `typed` (checked when MIMO_FN_TYPECHECK=1)."""
    return getattr(fn, _MARK, False)


def _shown(value: Any) -> str:
    """A short description of an argument: tensors by dtype and shape, big records by type."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else f"a {type(value).__name__}"


def _expected(annotation: Any) -> str:
    """'an int', 'a Batch', 'Mapping[int, int]', "Int[Tensor, ' T']", ... for an annotation."""
    if isinstance(annotation, type) and issubclass(annotation, AbstractArray):
        return annotation.__name__
    if isinstance(annotation, type):
        name = annotation.__name__
        return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"
    return re.sub(r"\b(?:typing|collections\.abc|torch|jaxtyping)\.", "", str(annotation))


def _own_argument_error(fn: Callable, e: TypeCheckError, args: tuple, kwargs: dict) -> ArgumentError | None:
    """The ArgumentError for a failure of fn's own arguments, or None for any other failure (one
    raised inside fn, which its frame on the traceback shows, or of the return value)."""
    if not str(e).startswith("Type-check error whilst checking the parameters of"):
        return None
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is getattr(fn, "__code__", None):
            return None
        tb = tb.tb_next
    msg = str(e)
    dims = msg.split("axis annotation are as follows.")[1].split() if "as follows." in msg else []
    dims = f" (dims so far: {', '.join(dims)})" if dims else ""  # what the other tensor arguments fixed
    m = re.search(r"typechecking parameter '(\w+)'", msg)
    if m is None:  # no single argument to blame
        return ArgumentError(f"{fn.__name__}: the arguments do not match their annotations{dims}")
    name = m.group(1)
    sig = inspect.signature(fn)
    value = sig.bind(*args, **kwargs).arguments.get(name, sig.parameters[name].default)
    annotation = sig.parameters[name].annotation
    is_array = isinstance(annotation, type) and issubclass(annotation, AbstractArray)
    return ArgumentError(f"{fn.__name__}: {name} = {_shown(value)}; expected {_expected(annotation)}"
                         + (dims if is_array else ""))


def typed(fn: F) -> F:
    if not TYPECHECK:
        setattr(fn, _MARK, True)
        return fn
    from beartype import beartype
    from jaxtyping import jaxtyped

    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outermost = _DEPTH.get() == 0  # a call from outside mimo_fn's checked functions
        token = _DEPTH.set(_DEPTH.get() + 1)
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as e:
            err = _own_argument_error(fn, e, args, kwargs) if outermost else None
            if err is None:
                raise
            raise err from e
        finally:
            _DEPTH.reset(token)

    setattr(wrapper, _MARK, True)
    return wrapper
