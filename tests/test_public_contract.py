"""The public contract: every function mimo_fn exports carries the shape-checked @typed
annotations (mimo_fn._types), or is named below with the reason it does not; and with the checks
on (tests/conftest.py), a user's argument of the wrong type is a ValueError naming it, while a
failure inside mimo_fn stays a type-check error (a bug, not bad input)."""

import inspect

import pytest
import torch
from jaxtyping import TypeCheckError

import mimo_fn as mf
from mimo_fn import _types
from mimo_fn._types import Float, Tensor, is_typed, typed

# Exported functions that are not @typed themselves, and why.
UNTYPED = {
    # checks its tokens itself first, so that a list or a 2-D tensor gets a ValueError that says
    # what it is (tests/test_bad_input.py), then runs the @typed model._forward
    "forward": "model._forward",
}

STEP_FUNCTIONS = {"init_state", "prefill", "decode", "release", "fork", "truncate", "keep_swa", "load_checkpoint"}

checks_on = pytest.mark.skipif(not _types.TYPECHECK, reason="MIMO_FN_TYPECHECK=0: @typed checks nothing")


def _public_functions() -> dict:
    return {name: getattr(mf, name) for name in mf.__all__ if inspect.isfunction(getattr(mf, name))}


def test_every_public_function_is_typed_or_named_as_not():
    funcs = _public_functions()
    assert STEP_FUNCTIONS <= set(funcs)  # the walk below covers the step functions
    assert set(UNTYPED) <= set(funcs)  # the list names exported functions only
    assert [name for name, fn in funcs.items() if not is_typed(fn) and name not in UNTYPED] == []
    assert [name for name in UNTYPED if is_typed(funcs[name])] == []  # a typed one leaves the list
    from mimo_fn import model
    from mimo_fn.rl.weights import update_weights

    assert all(is_typed(getattr(model, path.split(".")[1])) for path in UNTYPED.values())
    assert is_typed(update_weights)  # the RL entry point, outside mf.__all__ (Engine.update_weights uses it)


@pytest.fixture(scope="module")
def tiny():
    cfg = mf.ModelConfig.tiny()
    return cfg, mf.init_params(cfg, seed=0)


@checks_on
def test_wrong_types_name_the_argument(tiny):
    """A wrong type is a ValueError (and a TypeError) naming function, argument and expectation,
    raised before the call does anything: the state it was given stays live."""
    cfg, params = tiny
    state = mf.init_state(cfg, params, max_tokens=64, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0], [[1, 2, 3]]))
    cases = [
        (lambda: mf.prefill(state, [[4, 5]]), r"^prefill: batch = \[\[4, 5\]\]; expected a Batch$"),
        (lambda: mf.decode(state, mf.Batch.from_tokens([0], [[4]]), capture_hidden=1),
         r"^decode: capture_hidden = 1; expected Sequence\[int\]$"),
        (lambda: mf.prefill(params, mf.Batch.from_tokens([0], [[4]])), r"^prefill: state = a Params; expected an "
                                                                        r"EngineState$"),
        (lambda: mf.release(state, 0), r"^release: seq_ids = 0; expected Sequence\[int\]$"),
        (lambda: mf.fork(state, [(1, 0)]), r"^fork: sources = \[\(1, 0\)\]; expected Mapping\[int, int\]$"),
        (lambda: mf.truncate(state, {0: "2"}), r"^truncate: lengths = \{0: '2'\}; expected Mapping\[int, int\]$"),
        (lambda: mf.init_state(cfg, params, max_tokens=64.0), r"^init_state: max_tokens = 64.0; expected an int$"),
        (lambda: mf.load_checkpoint(7), r"^load_checkpoint: path = 7; expected str \| os.PathLike$"),
        (lambda: mf.capacity(cfg, "1GB"), r"^capacity: nbytes = '1GB'; expected an int$"),
    ]
    from mimo_fn.rl.weights import update_weights

    cases.append((lambda: update_weights(params, cfg, 5), r"^update_weights: named = 5; expected an Iterable$"))
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert isinstance(e.value, TypeError)
    state, out = mf.decode(state, mf.Batch.from_tokens([0], [[4]]))  # not donated by the failed calls
    torch.testing.assert_close(out.logits_BV[0], mf.forward(params, cfg, torch.tensor([1, 2, 3, 4]))[-1],
                               atol=1e-4, rtol=1e-4)


@checks_on
def test_a_failure_inside_mimo_fn_is_no_value_error():
    """Only the arguments of the outermost checked call are the user's: an internal call with a
    bad shape, or a bad return value, is jaxtyping's TypeCheckError, which a server answers as an
    internal error rather than as the client's (HTTP 400)."""

    @typed
    def inner(x_TH: Float[Tensor, "T H"], w_H: Float[Tensor, " H"]) -> Float[Tensor, "T H"]:
        return x_TH * w_H

    @typed
    def outer(x_TH: Float[Tensor, "T H"], n: int) -> Float[Tensor, "T H"]:
        return inner(x_TH, torch.ones(n))

    @typed
    def bad_return(x_TH: Float[Tensor, "T H"]) -> Float[Tensor, "T H"]:
        return x_TH.T

    x = torch.randn(2, 3)
    torch.testing.assert_close(outer(x, 3), x)
    with pytest.raises(ValueError, match=r"^outer: n = '3'; expected an int$"):
        outer(x, "3")
    with pytest.raises(ValueError, match=r"^inner: w_H = a torch.float32 tensor of shape \(4,\); expected "
                                         r"Float\[Tensor, 'H'\] \(dims so far: T=2, H=3\)$"):
        inner(x, torch.ones(4))  # called by a user: their argument
    for call in (lambda: outer(x, 4), lambda: bad_return(x)):
        with pytest.raises(TypeCheckError) as e:
            call()
        assert not isinstance(e.value, ValueError)
