"""The kernel switches (mimo_fn.options): each MIMO_FN_* variable's values and what they mean,
read into one frozen record; override swaps it for a block and puts it back."""

import dataclasses

import pytest

from mimo_fn import options
from mimo_fn.options import Options


def test_defaults_with_nothing_set():
    assert Options.from_env({}) == Options()
    assert Options() == Options(typecheck=False, attention_ref=False, attention_ws=True, attention_band=True,
                                attention_fp8=False, moe_autotune=True, autotune_cache=True, moe_tma=True, moe_half_tails=None,
                                moe_down_ws=True, moe_up_ws=True, mxfp4_fast_cvt=True, mxfp4_dequant=None,
                                layer_ranges=False)


@pytest.mark.parametrize("name,field,values", [
    # =1 turns on; anything else leaves off
    ("MIMO_FN_TYPECHECK", "typecheck", {"1": True, "0": False, "yes": False}),
    ("MIMO_FN_ATTENTION_REF", "attention_ref", {"1": True, "0": False, "true": False}),
    ("MIMO_FN_ATTENTION_FP8", "attention_fp8", {"1": True, "0": False, "yes": False}),
    ("MIMO_FN_LAYER_RANGES", "layer_ranges", {"1": True, "0": False, "yes": False}),
    # =0 turns off; anything else leaves on
    ("MIMO_FN_ATTENTION_WS", "attention_ws", {"0": False, "1": True, "off": True}),
    ("MIMO_FN_ATTENTION_BAND", "attention_band", {"0": False, "1": True}),
    ("MIMO_FN_MOE_AUTOTUNE", "moe_autotune", {"0": False, "1": True}),
    ("MIMO_FN_MOE_UP_WS", "moe_up_ws", {"0": False, "1": True, "on": True}),
    ("MIMO_FN_AUTOTUNE_CACHE", "autotune_cache", {"0": False, "1": True}),
    ("MIMO_FN_MOE_TMA", "moe_tma", {"0": False, "1": True}),
    ("MIMO_FN_MOE_DOWN_WS", "moe_down_ws", {"0": False, "1": True}),
    ("MIMO_FN_MXFP4_FAST_CVT", "mxfp4_fast_cvt", {"0": False, "1": True}),
    # =1 forces on, =0 off, anything else: the code's own size rule (None)
    ("MIMO_FN_MOE_HALF_TAILS", "moe_half_tails", {"1": True, "0": False, "": None, "2": None}),
    ("MIMO_FN_MXFP4_DEQUANT", "mxfp4_dequant", {"1": True, "0": False, "auto": None}),
])
def test_each_variable(name, field, values):
    for value, want in values.items():
        got = Options.from_env({name: value})
        assert getattr(got, field) == want, (name, value)
        assert got == dataclasses.replace(Options(), **{field: want})  # one variable moves one field


def test_the_record_is_read_once_and_frozen(monkeypatch):
    before = options.current()
    monkeypatch.setenv("MIMO_FN_MOE_TMA", "0" if before.moe_tma else "1")
    assert options.current() is before  # no per-call environment reads
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.moe_tma = False


def test_override_swaps_the_record_for_a_block():
    before = options.current()
    with options.override(moe_half_tails=True, attention_ref=not before.attention_ref) as inside:
        assert options.current() is inside
        assert inside.moe_half_tails is True and inside.attention_ref is not before.attention_ref
        assert inside.moe_tma == before.moe_tma
    assert options.current() is before
    with pytest.raises(RuntimeError), options.override(moe_tma=False):
        raise RuntimeError  # put back on the way out of an error too
    assert options.current() is before
    with pytest.raises(TypeError):  # a misspelt field is an error, not a silent no-op
        with options.override(moe_tmaa=False):
            pass
