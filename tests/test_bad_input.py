"""Bad input from issue 44's table: each gets a ValueError naming what was wrong, and leaves
every other piece of state as it was."""

import pytest
import torch

import mimo_fn as mf


@pytest.fixture(scope="module")
def tiny():
    cfg = mf.ModelConfig.tiny()
    return cfg, mf.init_params(cfg, seed=0)


def test_release_repeated_id_keeps_state(tiny):
    cfg, params = tiny
    state = mf.init_state(cfg, params, max_tokens=64, page_size=4)
    state, _ = mf.prefill(state, mf.Batch.from_tokens([0, 1], [[1, 2, 3], [4, 5]]))
    free_before = (len(state.cache.full.free), len(state.cache.swa.free))
    with pytest.raises(ValueError, match=r"release: sequence ids \[0\] repeat"):
        mf.release(state, [0, 0])
    # the state was not donated: it still works, and nothing was freed
    assert (len(state.cache.full.free), len(state.cache.swa.free)) == free_before
    state = mf.release(state, [0])
    state, out = mf.decode(state, mf.Batch.from_tokens([1], [[6]]))
    ref = mf.forward(params, cfg, torch.tensor([4, 5, 6]))[-1]
    torch.testing.assert_close(out.logits_BV[0], ref, atol=1e-4, rtol=1e-4)


def test_batch_built_directly_with_repeated_id():
    with pytest.raises(ValueError, match="repeat an id"):
        mf.Batch((0, 0), torch.tensor([1, 2]), (1, 1))
