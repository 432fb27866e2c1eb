"""Random sequences of the Engine's calls (issue 44; tests/test_state_machine.py does the same for
the step functions): add_request / step / abort, generate, flush_cache, warmup, update_weights,
release_memory / resume_memory, and a stale EngineState, with valid and invalid arguments, on
the tiny model in fp32 on the CPU. The Engine has no keep_swa of its own: the configuration with
a prefix cache over a bounded sliding-window pool runs it (prefix_cache.py keeps each entry's
window at its prompt's end).

After every call:
- pages: each pool's accounting equals the live sequences' pages (no page leaked or double-owned),
  and once no request is open only prefix-cache entries hold any;
- nothing lost: `has_unfinished()` is true exactly while some request has not reported its end;
- weights: byte-exact the expected ones (the first weights with every accepted update written in,
  loaded through load_checkpoint, not through the engine's update path);
- every finished request: its tokens are what step() streamed, its finish reason agrees with its
  limit and stop tokens, and each token is what the weights it ran on give (teacher-forced
  `mf.forward`): greedy's choice (up to 1e-4 of the top logit), a sampled one among the top_k,
  log-probs those of `forward`;
- an invalid call raised a ValueError naming the problem (or returned False, abort's documented
  answer) and changed nothing: pages, queues and weights as before, and the requests in flight
  still finish with what they would have got.

Bounded for CI by the "ci" settings below; MIMO_FN_STATE_MACHINE=long runs the "long" ones, e.g.
  MIMO_FN_STATE_MACHINE=long python -m pytest tests/test_engine_state_machine.py --hypothesis-show-statistics
"""

import os
import tempfile
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from safetensors.torch import load_file, save_file
from torch.utils._pytree import tree_map

import mimo_fn as mf
from mimo_fn.params import to_flat
from test_state_machine import _check_pool


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Steps of the tiny model are too small for threads: on two shared cores, two threads made
    each call several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CFG = mf.ModelConfig.tiny()
V = CFG.vocab_size
PARAMS = mf.init_params(CFG, seed=0)
PAGE, CAPACITY = 4, 192
TAGS = ("weights", "kv_cache", "graphs")
PROFILES = {"ci": dict(max_examples=8, stateful_step_count=20), "long": dict(max_examples=200, stateful_step_count=40)}
PROFILE = PROFILES[os.environ.get("MIMO_FN_STATE_MACHINE", "ci")]

PROMPT = st.lists(st.integers(0, V - 1), min_size=1, max_size=36)
LIMIT = st.integers(1, 10)
STOPS = st.lists(st.integers(0, V - 1), max_size=8)
SAMPLING = st.one_of(st.none(), st.builds(lambda t, k, s: mf.SamplingParams(temperature=t, top_k=k, seed=s),
                                          st.sampled_from([0.5, 1.0, 2.0]), st.integers(1, 4), st.integers(0, 99)))


def _hub(params) -> dict[str, torch.Tensor]:
    """Every weight by hub name, as save_checkpoint writes it (what update_weights takes)."""
    with tempfile.TemporaryDirectory() as d:
        mf.save_checkpoint(params, CFG, d)
        return {k: v.clone() for k, v in load_file(os.path.join(d, "model.safetensors")).items()}


HUB0 = _hub(PARAMS)
NAMES = sorted(HUB0)
SOME_NAMES = [n for n in NAMES if n.endswith(("norm.weight", "lm_head.weight", "experts.3.up_proj.weight",
                                              "layers.1.self_attn.q_proj.weight", "sink_bias", "gate.weight"))]


def _params_of(hub: dict[str, torch.Tensor]) -> mf.Params:
    """The weights `hub` names, through the checkpoint loader (independent of update_weights)."""
    with tempfile.TemporaryDirectory() as d:
        mf.save_checkpoint(PARAMS, CFG, d)  # config.json
        save_file(hub, os.path.join(d, "model.safetensors"))
        _, params = mf.load_checkpoint(d, dtype=torch.float32, progress=False)
    return tree_map(torch.clone, params)


def _new_weights(names, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: HUB0[n] * (1 + 0.3 * torch.randn(HUB0[n].shape, generator=gen))
            + 0.05 * torch.randn(HUB0[n].shape, generator=gen) for n in names}


@dataclass
class Req:
    prompt: list[int]
    max_new: int
    sampling: mf.SamplingParams | None
    stops: frozenset
    logprobs: bool
    versions: list[int]  # the weights it may have run on (more than one: an update while it waited)
    streamed: list[int] = field(default_factory=list)
    aborted: bool = False  # abort returned True


class EngineCalls(RuleBasedStateMachine):
    CONFIG = dict(max_tokens=CAPACITY, page_size=PAGE, chunk_size=16, max_batch=4)

    def __init__(self):
        super().__init__()
        self.engine = mf.Engine(CFG, tree_map(torch.clone, PARAMS), mf.EngineConfig(**self.CONFIG))
        self.hub = dict(HUB0)  # the weights the engine must hold
        self.version, self.refs = 0, {0: PARAMS}
        self.open: dict[int, Req] = {}  # requests whose end step() has not reported yet
        self.released: dict[str, bool] = {}  # tag -> released with a backup
        self.unsynced: set[str] = set()  # resumed without a backup, not rewritten yet
        self.old_state = self.engine.state

    # -- the model's view --
    def _weights_changed(self) -> None:
        self.version += 1
        if not self.unsynced:  # else nothing runs on these weights before the rest is written
            self.refs[self.version] = _params_of(self.hub)
        for req in self.open.values():  # one still waiting runs on these; one finished (not reported) ran before
            req.versions.append(self.version)

    def _busy(self) -> bool:
        """Sequences other than prefix cache entries hold KV: update_weights refuses."""
        e = self.engine
        return any(not (e.prefix_cache is not None and s in e.prefix_cache) for s in e.state.seqs)

    def _usable(self) -> str | None:
        """The error generate / add_request must give now, or None."""
        if self.released:
            return "memory is released"
        return "not rewritten yet" if self.unsynced else None

    def _snapshot(self):
        e = self.engine
        c = e.state.cache
        return (dict(e.state.seqs), list(c.full.free), dict(c.full.holders), list(c.swa.free), dict(c.swa.holders),
                e.server_info(), e.has_unfinished(), sorted(e.memory.released), sorted(e.memory.unsynced))

    def _refused(self, call, match: str):
        """call() must raise a ValueError matching `match` and change nothing."""
        before = self._snapshot()
        with pytest.raises(ValueError, match=match):
            call()
        event(f"refused: {match}")
        assert self._snapshot() == before, "a refused call changed the engine"

    def _check(self, req: Req, out: mf.Output) -> None:
        """A finished request's Output against forward on the weights it ran on."""
        toks = out.tokens
        assert len(toks) <= req.max_new and all(0 <= t < V for t in toks)
        assert not any(t in req.stops for t in toks[:-1]), "generated past a stop token"
        if req.aborted or out.finish_reason == "abort":
            assert req.aborted and out.finish_reason == "abort", (req.aborted, out.finish_reason)
        elif out.finish_reason == "stop":
            assert toks and toks[-1] in req.stops
        else:
            assert out.finish_reason == "length" and len(toks) == req.max_new, out.finish_reason
        if not toks:
            return
        event(f"checked: {'greedy' if req.sampling is None else 'sampled'}, {out.finish_reason}")
        n = len(req.prompt)
        errors = []
        for version in reversed([v for v in req.versions if v in self.refs]):
            logits_NV = mf.forward(self.refs[version], CFG, torch.tensor(req.prompt + toks))[n - 1:n - 1 + len(toks)]
            err = self._token_error(req, toks, logits_NV, out)
            if err is None:
                return
            errors.append(f"weights v{version}: {err}")
        raise AssertionError(f"request {req} got {toks}: " + "; ".join(errors))

    @staticmethod
    def _token_error(req: Req, toks, logits_NV, out) -> str | None:
        picked = logits_NV[torch.arange(len(toks)), torch.tensor(toks)]
        tol = 1e-4 * logits_NV.abs().amax(-1).clamp_min(1)
        above = (logits_NV > (picked + tol)[:, None]).sum(-1)  # logits clearly above the token's
        k = 1 if req.sampling is None else req.sampling.top_k
        bad = (above >= k).nonzero().flatten().tolist()
        if bad:
            return f"token {bad[0]} is not among the top {k} (rank {int(above[bad[0]])})"
        if req.logprobs and out.finish_reason != "abort":
            want = torch.log_softmax(logits_NV, -1)[torch.arange(len(toks)), torch.tensor(toks)]
            got = torch.tensor(out.logprobs)
            if got.shape != want.shape or not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                return f"log-probs {got.tolist()} != forward's {want.tolist()}"
        return None

    def _take(self, outs) -> None:
        """What step() handed out: new tokens streamed once each, and each finished request checked."""
        for o in outs:
            req = self.open.get(o.rid)
            assert req is not None, f"an output for request {o.rid}, which is not open"
            req.streamed += o.tokens
            if o.finished:
                assert o.output.tokens == req.streamed, "the Output differs from what step() streamed"
                assert o.finish_reason == o.output.finish_reason
                self._check(req, o.output)
                del self.open[o.rid]

    # -- online requests --
    @rule(prompt=PROMPT, limit=LIMIT, sampling=SAMPLING, stops=STOPS, logprobs=st.booleans())
    def add_request(self, prompt, limit, sampling, stops, logprobs):
        call = lambda: self.engine.add_request(prompt, max_new_tokens=limit, sampling=sampling,
                                               return_logprobs=logprobs, stop_token_ids=stops)
        if self._usable() is not None:
            return self._refused(call, self._usable())
        rid = call()
        assert rid not in self.open
        self.open[rid] = Req(list(prompt), limit, sampling, frozenset(stops), logprobs, [self.version])

    @rule(prompt=PROMPT, limit=LIMIT, stops=STOPS)
    def add_greedy_request(self, prompt, limit, stops):
        self.add_request(prompt, limit, None, stops, True)

    @rule(times=st.integers(1, 4))
    def step_more(self, times):
        self.step(times)

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self._take(self.engine.step())

    @rule()
    def drain(self):
        for _ in range(2000):
            if not self.engine.has_unfinished():
                break
            self._take(self.engine.step())
        assert not self.open, f"requests {sorted(self.open)} never finished"

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.open)))
        if self.engine.abort(rid):
            assert not self.open[rid].aborted, "aborted twice"
            self.open[rid].aborted = True
        assert not self.engine.abort(rid), "a request aborted (or finished) accepted another abort"

    @rule(rid=st.integers(-3, 10_000))
    def abort_unknown(self, rid):
        if rid in self.open:
            return
        before = self._snapshot()
        assert self.engine.abort(rid) is False
        assert self._snapshot() == before

    # -- offline --
    @rule(data=st.data(), prompts=st.lists(PROMPT, min_size=1, max_size=4), share=st.sampled_from(["", "copies",
                                                                                                    "prefix"]),
          limits=st.one_of(LIMIT, st.lists(LIMIT, min_size=8, max_size=8)), logprobs=st.booleans())
    def generate(self, data, prompts, share, limits, logprobs):
        if share == "copies":  # n samples of a prompt, as GRPO draws them
            prompts = prompts[:1] * data.draw(st.integers(2, 4)) + prompts[1:]
        elif share == "prefix":  # a system prompt of whole pages
            head = data.draw(st.lists(st.integers(0, V - 1), min_size=2 * PAGE, max_size=2 * PAGE))
            prompts = [head + p[:20] for p in prompts]
        limits = limits if isinstance(limits, int) else limits[:len(prompts)]
        sampling = [data.draw(SAMPLING) for _ in prompts]
        call = lambda: self.engine.generate(prompts, max_new_tokens=limits, sampling=sampling,
                                            return_logprobs=logprobs)
        if self._usable() is not None:
            return self._refused(call, self._usable())
        outs = call()
        assert len(outs) == len(prompts)
        each = [limits] * len(prompts) if isinstance(limits, int) else limits
        for p, m, sp, out in zip(prompts, each, sampling, outs):
            self._check(Req(p, m, sp, frozenset(), logprobs, [self.version]), out)

    @rule()
    def flush_cache(self):
        assert self.engine.flush_cache(timeout=120)
        e = self.engine
        assert not e.state.seqs and len(e.state.cache.full.free) == e.state.cache.full.num_pages, "flush left pages"

    @rule()
    def warmup(self):
        if self.open or self._usable() is not None:
            return self._refused(self.engine.warmup, "requests are in flight" if self.open else self._usable())
        self.engine.warmup()

    # -- RL: weights and memory --
    @rule(names=st.lists(st.sampled_from(SOME_NAMES), min_size=1, max_size=3, unique=True), seed=st.integers(0, 999))
    def update_weights(self, names, seed):
        new = _new_weights(names, seed)
        e = self.engine
        if self._busy():
            return self._refused(lambda: e.update_weights(new), "sequences hold KV pages \\(requests in flight\\)")
        if "weights" in self.released:
            return self._refused(lambda: e.update_weights(new), r"resume_memory\(\['weights'\]\) first")
        assert e.update_weights(new) == len(new)
        self.hub.update(new)
        self.unsynced -= set(new)
        self._weights_changed()
        assert not e.state.seqs, "the prefix cache kept K/V of the old weights"

    @rule(seed=st.integers(0, 999))
    def update_every_weight(self, seed):
        """What a trainer sends after a resume without backup: every weight, a few of them new."""
        full = {**self.hub, **_new_weights(SOME_NAMES[seed % len(SOME_NAMES):][:2], seed)}
        if "weights" in self.released or self._busy():
            return self._refused(lambda: self.engine.update_weights(full), "first|requests in flight")
        assert self.engine.update_weights(full.items()) == len(NAMES)
        self.hub, self.unsynced = full, set()
        self._weights_changed()

    @rule(name=st.sampled_from(SOME_NAMES), bad=st.sampled_from(["unknown", "shape", "expert", "mixed", "not a pair"]))
    def update_weights_invalid(self, name, bad):
        good = _new_weights([name], 1)
        t = good[name]
        cases = {
            "unknown": ({"model.layers.99.mlp.gate.weight": t}, "unknown weight 'model.layers.99"),
            "shape": ({name: torch.cat([t, t[:1]])}, rf"{name}' has shape"),
            "expert": ({"model.layers.1.mlp.experts.99.up_proj.weight": HUB0[
                "model.layers.1.mlp.experts.3.up_proj.weight"]}, "names expert 99"),
            "mixed": ([(name, t), ("model.nope", t)], "unknown weight 'model.nope'"),  # whole or nothing
            "not a pair": ([(name, t.tolist())], "entry 0 is a"),
        }
        named, match = cases[bad]
        if self._busy():  # the state is checked before the arguments
            match = "requests in flight"
        elif "weights" in self.released:
            match = "resume_memory"
        self._refused(lambda: self.engine.update_weights(named), match)

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(TAGS), min_size=1, max_size=3, unique=True)),
          backup=st.booleans(), then=st.sampled_from(["resume", "resume and sync", "stay released"]))
    def release_memory(self, tags, backup, then):
        """Release, and (as a colocated trainer does, so that most runs go on generating) resume
        at once and rewrite the weights."""
        if self._release(tags, backup) and then != "stay released":
            self.nothing_lost()
            self.pages_match_live_sequences()
            self._resume(None)
            if then == "resume and sync" and self.unsynced:
                self.update_every_weight(len(self.refs))

    def _release(self, tags, backup) -> bool:
        tags_ = TAGS if tags is None else tuple(tags)
        again = [t for t in tags_ if t in self.released]
        call = lambda: self.engine.release_memory(tags, backup=backup)
        if again or self.open:
            before = self._snapshot()
            try:
                call()
            except ValueError as e:
                assert ("released already" in str(e) and again) or ("queued or running" in str(e) and self.open), e
                assert self._snapshot() == before, "a refused release changed the engine"
                return False
            assert not again, f"{again} released twice"
        else:
            call()
        self.released.update((t, backup) for t in tags_)
        return True

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(TAGS), min_size=1, max_size=3, unique=True)))
    def resume_memory(self, tags):
        self._resume(tags)

    def _resume(self, tags):
        tags_ = tuple(self.released) if tags is None else tuple(tags)
        missing = [t for t in tags_ if t not in self.released]
        if missing:
            return self._refused(lambda: self.engine.resume_memory(tags), f"{missing[0]!r} is not released")
        self.engine.resume_memory(tags)
        for t in tags_:
            if t == "weights" and not self.released[t]:
                self.unsynced = set(NAMES)
            del self.released[t]

    # -- invalid requests: a ValueError naming what is wrong, nothing changed --
    @rule(prompt=PROMPT, where=st.integers(0, 40),
          bad=st.sampled_from(["vocab", "negative", "float", "empty", "capacity", "positions", "limit", "stop"]),
          offline=st.booleans())
    def invalid_request(self, prompt, where, bad, offline):
        prompt, limit, stops = list(prompt), 4, ()
        i = where % len(prompt)
        if bad == "vocab":
            prompt[i], match = V + where, "outside the vocabulary"
        elif bad == "negative":
            prompt[i], match = -1 - where, "outside the vocabulary"
        elif bad == "float":
            prompt[i], match = 1.5, "expected token ids"
        elif bad == "empty":
            prompt, match = [], "is empty"
        elif bad == "capacity":
            limit, match = CAPACITY - len(prompt) + 1 + where, "exceeds the KV capacity"
        elif bad == "positions":
            limit, match = CFG.max_position_embeddings, "max_position_embeddings"
        elif bad == "limit":
            limit, match = -where, "max_new_tokens"
        else:
            stops, match = [1, V + where], "stop_token_ids"
        match = self._usable() or match  # released memory is named first
        if offline:
            self._refused(lambda: self.engine.generate([[1, 2], prompt], max_new_tokens=limit,
                                                       stop_token_ids=stops), match)
        else:
            self._refused(lambda: self.engine.add_request(prompt, max_new_tokens=limit, stop_token_ids=stops), match)

    @rule(tokens=PROMPT)
    def stale_state(self, tokens):
        """A state the engine has replaced (a pass donated it, a release renewed it) is refused."""
        if self.engine.state is self.old_state:
            return
        before = self._snapshot()
        with pytest.raises(mf.StaleStateError):
            mf.prefill(self.old_state, mf.Batch.from_tokens([10**6], [tokens]))
        assert self._snapshot() == before
        self.old_state = self.engine.state

    # -- after every call --
    @invariant()
    def pages_match_live_sequences(self):
        e = self.engine
        c, seqs = e.state.cache, e.state.seqs
        _check_pool(c.full.free, c.full.holders, c.full.num_pages, [p for r in seqs.values() for p in r.full])
        _check_pool(c.swa.free, c.swa.holders, c.swa.num_pages, [p for r in seqs.values() for p in r.swa])
        info = e.server_info()
        assert info["num_used_pages"] == c.full.num_pages - len(c.full.free)
        if not self.open:  # nothing in flight: only prefix cache entries hold pages
            assert all(e.prefix_cache is not None and s in e.prefix_cache for s in seqs), sorted(seqs)
            assert info["num_running_reqs"] == info["num_waiting_reqs"] == 0

    @invariant()
    def nothing_lost(self):
        assert self.engine.has_unfinished() == bool(self.open), (self.engine.has_unfinished(), sorted(self.open))
        assert set(self.engine.memory.released) == set(self.released)

    @invariant()
    def weights_as_expected(self):
        if "weights" in self.released or self.unsynced:
            return  # released, or resumed without a backup: rewritten before they are read again
        got, want = to_flat(self.engine.state.params), to_flat(self.refs[self.version])
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, f"weights differ from the expected ones: {bad[:4]}"

    def teardown(self):
        self.drain()  # every open request ends (also with memory released: none is in flight then)


class EngineCallsPrefixCache(EngineCalls):
    """The prefix cache over a bounded sliding-window pool: entries keep their prompt end's
    window (model.keep_swa) and are forked by later calls."""

    CONFIG = dict(EngineCalls.CONFIG, prefix_cache=True, max_swa_tokens=96)


class EngineCallsSpeculative(EngineCalls):
    """Prompt-lookup drafts verified in each decode step; no overlap, one prompt at a time."""

    CONFIG = dict(EngineCalls.CONFIG, num_draft_tokens=3, share_prompts=False, overlap=False)


SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), **PROFILE)
test_engine_calls = EngineCalls.TestCase
test_engine_calls.settings = SETTINGS
test_engine_calls_prefix_cache = EngineCallsPrefixCache.TestCase
test_engine_calls_prefix_cache.settings = SETTINGS
test_engine_calls_speculative = EngineCallsSpeculative.TestCase
test_engine_calls_speculative.settings = SETTINGS
