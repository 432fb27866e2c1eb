"""Random sequences of the public step functions (prefill / decode / fork / truncate / release),
with valid and invalid arguments, on the tiny model (issue 44). After every step: the pools'
accounting equals the live sequences' pages (no page leaked or double-owned); a step that
returns logits returns, for each sequence, those of `forward` on its tokens; an invalid call
raised a ValueError (or StaleStateError) with a message, and changed nothing.

Bounded for CI: MAX_EXAMPLES runs of up to STEPS steps each."""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import mimo_fn as mf

MAX_EXAMPLES, STEPS = 12, 12
CFG = mf.ModelConfig.tiny()
PARAMS = mf.init_params(CFG, seed=0)
IDS = st.integers(0, 5)
TOKENS = st.lists(st.integers(0, CFG.vocab_size - 1), min_size=1, max_size=9)


def _snapshot(state):
    c = state.cache
    return (dict(state.seqs), c.full.free, dict(c.full.holders), c.swa.free, dict(c.swa.holders))


def _check_pool(free, holders, num_pages, held):
    """held: every page some live sequence holds, once per holder."""
    count = Counter(p for p in held if p >= 0)
    assert len(set(free)) == len(free), "a page is free twice"
    assert not set(free) & set(count), "a held page is free"
    assert set(free) | set(count) == set(range(num_pages)), "a page leaked"
    assert holders == {p: n for p, n in count.items() if n > 1}, "shared-page counts disagree with the holders"


class Steps(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = mf.init_state(CFG, PARAMS, max_tokens=96, page_size=4, swa_slack=4)
        self.tokens: dict[int, list[int]] = {}
        self.stale = None

    # -- helpers --
    def _call(self, fn, *, invalid: str | None = None, tolerated: type = mf.OutOfPages):
        """Run fn(state) -> (state, out) or state. invalid: the call is wrong and must raise a
        ValueError matching it; tolerated: an error a valid call may meet (a full pool)."""
        before = _snapshot(self.state)
        try:
            result = fn(self.state)
        except ValueError as e:
            assert str(e)
            if invalid is not None:
                assert invalid in str(e), str(e)
            else:
                assert isinstance(e, tolerated), f"a valid call raised {e!r}"
            assert _snapshot(self.state) == before and self.state.lease.live, "a refused call changed the state"
            return None
        assert invalid is None, f"an invalid call was accepted (expected {invalid!r})"
        self.stale = self.state
        self.state, out = result if isinstance(result, tuple) else (result, None)
        return out

    def _check_logits(self, ids, out):
        for b, sid in enumerate(ids):
            ref = mf.forward(PARAMS, CFG, torch.tensor(self.tokens[sid]))[-1]
            torch.testing.assert_close(out.logits_BV[b], ref, atol=1e-4, rtol=1e-4)

    # -- valid calls --
    @rule(chunks=st.dictionaries(IDS, TOKENS, min_size=1, max_size=3))
    def prefill(self, chunks):
        ids = list(chunks)
        out = self._call(lambda s: mf.prefill(s, mf.Batch.from_tokens(ids, [chunks[i] for i in ids])))
        if out is not None:
            for i in ids:
                self.tokens.setdefault(i, []).extend(chunks[i])
            self._check_logits(ids, out)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        toks = [data.draw(st.integers(0, CFG.vocab_size - 1)) for _ in ids]
        out = self._call(lambda s: mf.decode(s, mf.Batch.from_tokens(ids, [[t] for t in toks])))
        if out is not None:
            for i, t in zip(ids, toks):
                self.tokens[i].append(t)
            self._check_logits(ids, out)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), dst=IDS)
    def fork(self, data, dst):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        if dst == src:
            self._call(lambda s: mf.fork(s, {dst: src}), invalid="the source must be a live sequence")
            return
        if dst in self.tokens:  # a live dst must hold a prefix of src's tokens: not checked here
            return
        before = self.state
        self._call(lambda s: mf.fork(s, {dst: src}))
        if self.state is not before:
            self.tokens[dst] = list(self.tokens[src])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), back=st.integers(0, 4))
    def truncate(self, data, back):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = max(len(self.tokens[sid]) - back, 0)
        # refused (all or nothing) where the shorter sequence's next write lands in a page shared with a fork
        before = self.state
        self._call(lambda s: mf.truncate(s, {sid: n}), tolerated=ValueError)
        if self.state is not before:
            self.tokens[sid] = self.tokens[sid][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        self._call(lambda s: mf.release(s, ids), tolerated=())
        for i in ids:
            del self.tokens[i]

    # -- invalid calls: a clear error, nothing changed --
    @rule(sid=IDS, tokens=TOKENS, where=st.integers(0, 8))
    def prefill_token_outside_vocab(self, sid, tokens, where):
        tokens = list(tokens)
        tokens[where % len(tokens)] = CFG.vocab_size + where
        self._call(lambda s: mf.prefill(s, mf.Batch.from_tokens([sid], [tokens])), invalid="outside the vocabulary")

    @rule(sid=IDS, tokens=TOKENS)
    def batch_repeated_or_empty(self, sid, tokens):
        for make in (lambda: mf.Batch.from_tokens([sid, sid], [tokens, tokens]),
                     lambda: mf.Batch((sid, sid), torch.tensor(tokens + tokens), (len(tokens), len(tokens))),
                     lambda: mf.Batch.from_tokens([sid], [[]])):
            with pytest.raises(ValueError, match="repeat an id|empty chunk"):
                make()

    @rule(sid=IDS)
    def decode_unknown_or_long(self, sid):
        if sid not in self.tokens:
            self._call(lambda s: mf.decode(s, mf.Batch.from_tokens([sid], [[1]])), invalid="have no cache")
        else:
            self._call(lambda s: mf.decode(s, mf.Batch.from_tokens([sid], [[1, 2]])), invalid="one token per")

    @rule(sid=IDS, dst=IDS)
    def fork_unknown_source(self, sid, dst):
        if sid not in self.tokens:
            self._call(lambda s: mf.fork(s, {dst: sid}), invalid="the source must be a live sequence")

    @rule(sid=IDS, extra=st.integers(1, 3))
    def truncate_bad(self, sid, extra):
        if sid not in self.tokens:
            self._call(lambda s: mf.truncate(s, {sid: 0}), invalid="unknown sequence ids")
        else:
            n = len(self.tokens[sid]) + extra
            self._call(lambda s: mf.truncate(s, {sid: n}), invalid="cannot take it to")

    @rule(sid=IDS)
    def release_repeated_or_unknown(self, sid):
        if sid in self.tokens:
            self._call(lambda s: mf.release(s, [sid, sid]), invalid="repeat")
        else:
            self._call(lambda s: mf.release(s, [sid]), invalid="unknown sequence ids")

    @precondition(lambda self: self.stale is not None)
    @rule(tokens=TOKENS)
    def stale_state(self, tokens):
        before = _snapshot(self.state)
        with pytest.raises(mf.StaleStateError, match="donated"):
            mf.prefill(self.stale, mf.Batch.from_tokens([0], [tokens]))
        assert _snapshot(self.state) == before and self.state.lease.live

    @invariant()
    def pages_match_live_sequences(self):
        c, seqs = self.state.cache, self.state.seqs
        assert set(seqs) == set(self.tokens)
        assert all(seqs[s].length == len(t) for s, t in self.tokens.items())
        _check_pool(c.full.free, c.full.holders, c.full.num_pages, [p for r in seqs.values() for p in r.full])
        _check_pool(c.swa.free, c.swa.holders, c.swa.num_pages, [p for r in seqs.values() for p in r.swa])


Steps.TestCase.settings = settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None,
                                   suppress_health_check=list(HealthCheck))
test_step_functions = Steps.TestCase
