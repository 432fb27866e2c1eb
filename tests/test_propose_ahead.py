"""The next verify step's drafts queued before a verify pass ends (Passes._propose_ahead), for the
draft models that leave their drafts on the device (DFlash, MTP)."""

import sys

import pytest
import torch

import mimo_fn as mf
from mimo_fn.speculative.dflash import DFlashConfig, DFlashProposer, init_dflash
from mimo_fn.speculative.mtp import MTPProposer, init_mtp

CFG = mf.ModelConfig.tiny()
DCFG = DFlashConfig(target_layers=(1, 3), mask_token_id=CFG.vocab_size - 1, block_size=4, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=48)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def params():
    return mf.init_params(CFG, seed=3, device=DEVICE)


def _recording(kind, params, callers):
    """A DFlash or MTP proposer that notes which engine method asked it for device drafts."""
    base = DFlashProposer if kind == "dflash" else MTPProposer

    class Recording(base):
        def propose_device(self, asks):
            callers.append(sys._getframe(1).f_code.co_name)
            return super().propose_device(asks)

    if kind == "dflash":
        return Recording(init_dflash(CFG, DCFG, seed=1, device=DEVICE), DCFG, params, CFG)
    return Recording(init_mtp(CFG, 2, seed=5, device=DEVICE), params, CFG)


def _engine(params, proposer=None):
    return mf.Engine(CFG, params, mf.EngineConfig(max_tokens=512, page_size=4, num_draft_tokens=3 if proposer else 0,
                                                  proposer=proposer))


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_each_verify_step_takes_the_drafts_queued_by_the_one_before(params, kind):
    """Alone, a request's first verify step proposes; every later one takes the drafts its
    predecessor queued (one proposal a step, none wasted); the tokens are greedy's."""
    callers = []
    engine = _engine(params, _recording(kind, params, callers))
    out = engine.generate(PROMPTS[:1], 13)[0]
    assert out.tokens == _engine(params).generate(PROMPTS[:1], 13)[0].tokens
    steps = engine.spec_stats()["steps"]
    # the steps with room for drafts (the last may have none): each proposed once
    assert steps - 1 <= len(callers) <= steps
    assert callers == ["_spec_pass"] + ["_propose_ahead"] * (len(callers) - 1)


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_queued_drafts_are_dropped_when_a_request_arrives(params, kind):
    """A request that arrives between two verify steps makes the next pass a prefill pass: the
    queued drafts are dropped and the verify step after it proposes for both. Both get greedy's
    tokens."""
    callers = []
    engine = _engine(params, _recording(kind, params, callers))
    first = engine.add_request(PROMPTS[0], max_new_tokens=12)
    tokens = {first: []}
    while len(tokens[first]) < 4:
        for o in engine.step():
            tokens[o.rid] += o.tokens
    assert callers[-1] == "_propose_ahead" and engine._ahead is not None
    second = engine.add_request(PROMPTS[1], max_new_tokens=12)
    tokens[second] = []
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.rid] += o.tokens
    plain = _engine(params).generate(PROMPTS, 12)
    assert [tokens[first], tokens[second]] == [o.tokens for o in plain]
    assert callers.count("_spec_pass") >= 2 and engine._ahead is None
