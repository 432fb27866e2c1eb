"""Engine: the thin stateful shell over the pure step functions, for scripts and RL frameworks.

It owns one EngineState and one scheduler state, and runs passes: the scheduler (sched/)
decides each pass's prefill chunks or decodes, the step functions (model.py) run them,
and the engine samples and hands back per-prompt outputs. All model math lives in
model.py, all paging in cache.py, all admission policy in sched/.
"""

from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from mimo_fn import sched
from mimo_fn.batch import Batch
from mimo_fn.cache import swa_seq_limit
from mimo_fn.config import ModelConfig
from mimo_fn.engine_config import EngineConfig
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.generate_args import agree_on_call, check_args
from mimo_fn.layers.sampling import SamplingParams, sample_each, token_logprobs
from mimo_fn.model import EngineState, decode, fork, init_state, prefill, release, truncate
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.params import Params
from mimo_fn.prefix_cache import PrefixCache, entries_for, keep_finished, keep_prompt_ends, make_room
from mimo_fn.prompt_copies import PromptCopies, prompt_keys, shared_prefixes
from mimo_fn.rl.engine_memory import EngineMemory
from mimo_fn.rl.weights import named_pairs, plan_update, write_planned
from mimo_fn.spec.accept import accept_each
from mimo_fn.spec.ngram import JoinedTokens, NgramProposer
from mimo_fn.upload import upload


@dataclass(frozen=True)
class Output:
    tokens: list[int]  # generated tokens
    logprobs: list[float] | None = None  # log p of each generated token (raw logits)
    prompt_logprobs: list[float] | None = None  # log p of prompt tokens 1..n-1 given their prefix
    # routing replay: the experts each fed token was routed to, [prompt + generated - 1, MoE layers, K]
    routed_experts: torch.Tensor | None = None
    finish_reason: str = "length"  # "stop": the last token is a stop token; "length": max_new_tokens ran out


@dataclass
class _Live:
    """Host-side progress of one request inside a generate call."""

    prompt: list[int]
    gen: torch.Generator
    max_new: int  # tokens to generate at most; 0: a prefix several prompts share (prompt_copies)
    sp: SamplingParams | None  # None: greedy
    copied: bool  # the call holds this prompt more than once (EngineConfig.share_prompts; prompt_copies)
    # the logits after the prompt, kept while copies of it may still fork from this request
    # (EngineConfig.share_prompts): their first tokens are drawn from them
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)  # int32 [tokens, MoE layers, K] per step
    done: bool = False  # drew a stop token or max_new_tokens: later tokens (an overlapped step's) are dropped


@dataclass(frozen=True)
class _Launched:
    """A decode step whose tokens are still on their way to the host (EngineConfig.overlap)."""

    rids: tuple[int, ...]
    next_B: torch.Tensor  # the sampled tokens on the model's device: the next step's input
    host: tuple[torch.Tensor, torch.Tensor | None]  # tokens and log-probs, copying to the host
    experts_BLK: torch.Tensor | None  # routed experts of the step (device)
    ready: torch.cuda.Event | None  # recorded after the copies (None off CUDA: nothing in flight)


class Engine:
    """One rank's engine. On a mesh (DP attention / TP / EP, `init_mesh`) every rank builds one
    over its own weights (`shard_params` or `load_checkpoint(..., mesh=mesh)`) and calls each
    method together: every TP rank of a DP group `generate`s the same prompts with the same
    arguments, and DP groups their own prompts. Passes are collective: a DP group with nothing
    to run joins each pass with a zero-token step until every group is done, and the groups
    negotiate prefill passes (sched.delayer) over the mesh's host group."""

    def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig, mesh: Mesh | None = None):
        self.cfg, self.config = cfg, config
        self.mesh = mesh or Mesh.single()
        self.proposer = config.proposer or NgramProposer()
        self.prefix_cache = PrefixCache.for_engine(cfg, config, self.proposer, self._hidden_layers())
        # a speculative step may hand back num_draft_tokens tokens: keep that much SWA history; the
        # prefix cache keeps all of it where the SWA pool is as large as the full one (an entry
        # forks at any point), else a token more (mimo_fn.prefix_cache)
        slack = config.num_draft_tokens
        if self.prefix_cache is not None:
            slack = config.max_tokens if self.prefix_cache.swa_slack is None else self.prefix_cache.swa_slack
        self.state: EngineState = init_state(cfg, params, config.max_tokens, config.page_size,
                                             config.max_swa_tokens, swa_slack=slack, mesh=self.mesh)
        swa_limit = swa_seq_limit(cfg, self.state.cache, config.chunk_size,  # a bounded SWA pool caps the batch too
                                  step_tokens=config.num_draft_tokens + 1)
        if self.prefix_cache is not None and self.prefix_cache.max_running is not None:  # beside the entries
            swa_limit = min(swa_limit or config.max_batch, self.prefix_cache.max_running)
        self.sched_config = sched.SchedulerConfig(
            num_pages=self.state.cache.full.num_pages or -(-config.max_tokens // config.page_size),
            page_size=config.page_size, chunk_size=config.chunk_size, max_prefill_tokens=config.chunk_size,
            max_running_requests=min(config.max_batch, swa_limit or config.max_batch),
            max_delay_passes=config.max_delay_passes,
            copies_share_pages=bool(self.state.cache.full.k),  # the pool _free_pages counts shares them
            hold_prompts=swa_limit is None,  # a held prompt's SWA pages would not count against that cap
            **{"wait_for_fuller_batch": False, **config.scheduler},  # offline batches: no arrivals to wait for
        )
        self._next_id = 0
        self.spec_stats = {"steps": 0, "drafted": 0, "accepted": 0}  # speculative steps of the last generate
        self.prefix_stats = {"hits": 0, "tokens": 0}  # prompts of the last generate that forked an entry, their tokens
        self.graphs = DecodeGraphs() if config.cuda_graphs else None
        self.memory = EngineMemory(self, config.memory_saver)  # release_memory's records (memory_saver: the move)
        # ranks that agree on each step's graph shape must send every forward through the graphs
        self._graphs_always = self.graphs is not None and DecodeGraphs.agree_on(self.mesh)

    def update_weights(self, named_tensors) -> int:
        """RL weight sync: write (hub name, full tensor) pairs, or a dict of them (a state_dict), into
        the weights in place (same storage; FP8 and MXFP4 weights re-quantised in their own format).
        Call between generate calls. Returns the count. The prefix cache empties (its K/V is the old
        weights'; EngineConfig.prefix_cache)."""
        live = [s for s in self.state.seqs if not self._caching(s)]
        if live:
            raise ValueError(f"update_weights: {len(live)} sequences hold KV computed with the "
                             "old weights; call it between generate calls")
        if "weights" in self.memory.released:
            raise ValueError("update_weights: the weights' memory is released; call resume_memory(['weights']) first")
        named = named_pairs(named_tensors)
        plan = plan_update(self.state.params, self.cfg, named, self.state.mesh)  # bad input: the cache stays
        self._drop_cache()  # its K/V was computed with the old weights
        count = write_planned(plan)
        self.memory.unsynced.difference_update(name for name, _ in named)
        return count

    def release_memory(self, tags=None, backup: bool = False) -> int:
        """Free the GPU memory behind tags ("weights", "kv_cache", "graphs"; None: all) for a
        colocated trainer; returns the bytes freed. backup=True keeps the weights' bytes in host
        memory (pinned on CUDA; the buffers stay with the engine for the next backup) so
        resume_memory restores them; without it, update_weights must rewrite every weight after
        resume_memory before the next generate. A draft model's (DFlashProposer's) context pages
        go with "kv_cache", and its weights with "weights", always through a host backup, since
        update_weights does not write them. A release drops the decode CUDA graphs (they hold the
        old addresses; captured again on first use), except with EngineConfig.memory_saver, which
        keeps every address and drops them only under "graphs"; a draft model's graphs go at any
        release. mimo_fn.rl.memory and mimo_fn.rl.vmm explain the two methods. The prefix cache's
        entries go (EngineConfig.prefix_cache)."""
        self._drop_cache()
        return self.memory.release(tags, backup)

    def resume_memory(self, tags=None) -> None:
        """Bring back the memory of released tags (None: every released tag)."""
        self.memory.resume(tags)

    def _schedule(self, st):
        """(state, plan) of the next pass, or None when no DP group has work left. On DP > 1 one
        host all-gather per pass carries both what the scheduler negotiates (sched.delayer: one
        record per DP group, its first TP rank's) and whether each rank is busy, so the loop's
        test and the negotiation cost one round trip between the ranks, not two."""
        busy = not sched.is_idle(st)
        if self.mesh.dp == 1:  # every rank runs the same requests: the same answer without asking
            return sched.schedule_pass(st, self.sched_config, self._free_pages(), sched.local_gather) if busy else None
        any_busy = False

        def gather(record_F: torch.Tensor) -> torch.Tensor:
            nonlocal any_busy
            rows = self.mesh.agree_ints([int(busy), *record_F.tolist()], self.state.params.embed.device)
            any_busy = any(row[0] for row in rows)
            return torch.tensor([row[1:] for row in rows[::self.mesh.tp]], dtype=record_F.dtype)

        nxt, plan = sched.schedule_pass(st, self.sched_config, self._free_pages(), gather)
        return (nxt, plan) if any_busy else None  # all idle: the pass is dropped, st stays as it was

    def _idle_pass(self) -> None:
        """This DP group has nothing to run while another has: join the pass's collectives."""
        self.state, _ = prefill(self.state, Batch.from_tokens([], []),
                                graphs=self.graphs if self._graphs_always else None)

    def _caching(self, seq: int | None = None) -> bool:
        """Whether the prefix cache is on (seq given: whether seq is one of its entries)."""
        return self.prefix_cache is not None and (seq is None or seq in self.prefix_cache)

    def _drop_cache(self) -> None:
        if self._caching() and len(self.prefix_cache):
            self._release(self.prefix_cache.clear())

    def _free_pages(self) -> int:
        pool = self.state.cache.full if self.state.cache.full.k else self.state.cache.swa
        return len(pool.free)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int] = 16,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None, return_logprobs: bool = False,
        stop_token_ids: Sequence[int] | int | None = (), return_routed_experts: bool = False,
    ) -> list[Output]:
        """Generate for each prompt with continuous batching; outputs in prompt order.
        max_new_tokens: one limit for every prompt, or one per prompt.
        sampling: None = greedy; one SamplingParams for all, or one per prompt (None = greedy): prompt i
        samples from its own generator seeded with its params' seed + i.
        On a mesh every rank calls it (the class docstring); arguments one rank rejects, or that
        differ where they must agree, raise a ValueError on every rank before anything runs."""
        first, error = self._next_id, None
        try:
            self.memory.check("generate")
            args = check_args(prompts, max_new_tokens, sampling, stop_token_ids, self.cfg.vocab_size)
        except ValueError as e:
            error = e
        if error is None:
            try:
                share = self.config.share_prompts and (  # a proposer with per-request state must fork it too
                    not self._hidden_layers() or hasattr(self.proposer, "fork"))
                keys = prompt_keys(args, first, share)
                groups = shared_prefixes(args.prompts, keys, first, self.config.page_size) if share and (
                    self.sched_config.hold_prompts and self.sched_config.policy == "fcfs") else []  # fcfs: prefix first
                n = len(args.prompts)
                hits = {}  # rid -> (the prefix cache entry it forks, how many tokens); a prompt or a group prefix
                if self._caching():
                    hits, groups = entries_for(self.prefix_cache, args.prompts, groups, keys, first,
                                               return_logprobs, return_routed_experts)
                prefix = {first + i: (first + n + g, length) for g, (length, members) in enumerate(groups)
                          for i in members}
                prefix.update((rid, (e.seq, n)) for rid, (e, n) in hits.items())
                reqs = [sched.Request(first + n + g, length, 1, prefix_only=True,
                                      prefix_key=prefix.get(first + n + g, (-1, 0))[0],
                                      prefix_len=prefix.get(first + n + g, (-1, 0))[1])
                        for g, (length, _) in enumerate(groups)]
                reqs += [sched.Request(first + i, len(t), m, prompt_key=k, prefix_key=prefix.get(first + i, (-1, 0))[0],
                                       prefix_len=prefix.get(first + i, (-1, 0))[1])
                         for i, (t, m, k) in enumerate(zip(args.prompts, args.limits, keys))]
                st = sched.hold(sched.submit(sched.init_state(), self.sched_config, reqs),
                                sorted({e.seq for e, _ in hits.values()}))
            except ValueError as e:
                error = ValueError(f"generate: {e} (EngineConfig.max_tokens = {self.config.max_tokens})")
        fingerprint = args.fingerprint() if error is None and self.mesh.world > 1 else None
        agree_on_call(self.mesh, self.state.params.embed.device, error, fingerprint,
                      (bool(return_logprobs), bool(return_routed_experts)))
        n = len(args.prompts)
        live = {first + i: _Live(toks, torch.Generator().manual_seed((sp.seed if sp is not None else 0) + i), m, sp,
                                 k >= 0)
                for i, (toks, m, sp, k) in enumerate(zip(args.prompts, args.limits, args.sampling, keys))}
        for g, (length, members) in enumerate(groups):  # max_new 0: a prefix decodes nothing
            live[first + n + g] = _Live(args.prompts[members[0]][:length], torch.Generator(), 0, None, True)
        self._next_id += len(live)
        copies = PromptCopies(keys, first)
        for e in {e.seq: e for e, _ in hits.values()}.values():  # held as prefixes for this call's requests
            copies.held[e.seq] = e.seq
            live[e.seq] = _Live(e.tokens[:e.length], torch.Generator(), 0, None, False,  # as take_prefix reads it
                                **e.outputs(self.state.params.embed.device, return_logprobs, return_routed_experts))
        self.prefix_stats = {"hits": 0, "tokens": 0}
        stops = args.stops
        self.spec_stats = {"steps": 0, "drafted": 0, "accepted": 0}
        bar = tqdm(total=n, desc="generate", disable=not self.config.progress or self.mesh.rank != 0)
        # With overlap, the decode step launched last (its tokens not read yet), and the requests
        # found done since the last finish_pass: the scheduler still runs them until told.
        launched: _Launched | None = None
        stopped: set[int] = set()
        try:
            while (step := self._schedule(st)) is not None:
                st, plan = step
                kept = None
                if (st.held and not plan.prefill and not st.running and st.chunked is None
                        and plan.proposed.stop == "kv"  # held prompts keep the pages the next request needs
                        and not (self._caching() and make_room(self, st, copies.held.values()))):  # entries first
                    st, keys = sched.let_go(st)
                    self._let_go(copies, keys, evict=True)
                overlap = (self.config.overlap and plan.decode and not self.config.num_draft_tokens
                           and launched is not None and set(plan.decode) <= set(launched.rids))
                if launched is not None and not overlap:  # this pass needs the last step's tokens first
                    stopped |= self._read_back(launched, live, stops)
                    launched = None
                if plan.prefill:
                    self._prefill_pass(plan, live, copies, return_logprobs, return_routed_experts)
                    copies.drop_logits([c.rid for c in plan.prefill], live)
                elif plan.decode and self.config.num_draft_tokens:
                    kept = self._spec_pass(plan.decode, live, return_logprobs, return_routed_experts, stops)
                elif plan.decode:
                    step = self._launch_decode(plan.decode, live, return_logprobs, return_routed_experts, launched)
                    if launched is not None:  # read the step before while this one runs
                        stopped |= self._read_back(launched, live, stops)
                    launched = step
                    if not self.config.overlap:
                        stopped |= self._read_back(launched, live, stops)
                        launched = None
                elif self.mesh.world > 1:
                    self._idle_pass()
                if plan.prefill or kept is not None:  # tokens known now: a prompt's first, or a verify step's
                    stopped |= {rid for rid in plan.decode + tuple(c.rid for c in plan.prefill)
                                if self._is_done(live[rid], stops)}
                st, done = sched.finish_pass(st, plan, stopped, kept)
                stopped = set()
                if done and self._caching():  # kept for later calls
                    keep_finished(self, [r.rid for r in done], live, copies.held.values(), return_logprobs,
                                  return_routed_experts)
                elif done:
                    self.state = release(self.state, [r.rid for r in done])
                bar.update(len(done))
                if self._caching() and plan.proposed.stop == "kv" and st.waiting:
                    make_room(self, st, copies.held.values())
            if launched is not None:  # the last step's tokens (its requests are retired already)
                self._read_back(launched, live, stops)
        finally:  # on an error (or interrupt) mid-call, free what this call holds: the engine stays usable
            if self._caching():  # the entries its requests forked, where their own entries hold all of them
                self.prefix_cache.drop_covered(copies.held.values())
            self._let_go(copies, list(copies.held))
            self._release([rid for rid in live if not self._caching(rid)])
            bar.close()
        return [Output(r.tokens, r.logprobs if return_logprobs else None,
                       r.prompt_logprobs if return_logprobs else None,
                       torch.cat(r.experts).cpu() if return_routed_experts and r.experts else None,
                       "stop" if r.tokens[-1] in stops else "length")
                for r in (live[first + i] for i in range(n))]

    def _sample(self, logits_BV, rids, live, return_logprobs) -> None:
        nxt_B = sample_each(logits_BV, [live[r].sp for r in rids], [live[r].gen for r in rids])
        lp_B = token_logprobs(logits_BV, nxt_B).tolist() if return_logprobs else None
        nxt = nxt_B.tolist()  # one copy to the host (an int() per element would sync once per request)
        for b, rid in enumerate(rids):
            live[rid].tokens.append(nxt[b])
            if lp_B is not None:
                live[rid].logprobs.append(lp_B[b])

    def _hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the proposer reads (none unless speculative)."""
        return tuple(getattr(self.proposer, "target_layers", ())) if self.config.num_draft_tokens else ()

    def _observe(self, items) -> None:
        """Hand the proposer the hidden states [(rid, hidden_TLH)] of the tokens whose KV stays."""
        if hasattr(self.proposer, "observe_many"):
            self.proposer.observe_many(items)
        else:
            for rid, hidden_TLH in items:
                self.proposer.observe(rid, hidden_TLH)

    def _prefill_pass(self, plan, live, copies: PromptCopies, return_logprobs, capture) -> None:
        """Run a prefill pass: the model runs the chunks, then the copies (sched.Chunk.source)
        take their source's K/V (model.fork; a held prompt's, if it is held) and outputs, and
        draw their first tokens from its kept logits; then the prompts the plan holds are
        forked into sequences of their own, and those it lets go are released."""
        chunks = plan.prefill
        sources = {c.rid: c.source for c in chunks if c.source >= 0}
        run = [c for c in chunks if c.source < 0]
        prefixed = [c for c in run if c.prefix >= 0]
        if prefixed:  # their first c.start tokens' K/V and outputs come from a held prefix
            self._fork({c.rid: c.prefix for c in prefixed}, {c.rid: c.start for c in prefixed})
            for c in prefixed:
                copies.take_prefix(live[c.rid], live[c.prefix], c.start, return_logprobs)
                if self._caching(c.prefix):
                    self.prefix_stats["hits"] += 1
                    self.prefix_stats["tokens"] += c.start
        if run or self.mesh.world > 1:  # on a mesh the pass's collectives run even with no tokens here
            batch = Batch.from_tokens([c.rid for c in run],
                                      [live[c.rid].prompt[c.start:c.start + c.num_tokens] for c in run])
            self.state, out = prefill(self.state, batch, all_logits=return_logprobs, capture_experts=capture,
                                      capture_hidden=self._hidden_layers(),
                                      graphs=self.graphs if self._graphs_always else None)
            self._prefill_outputs(run, batch, out, live, return_logprobs)
        if sources:
            self._fork({dst: copies.kv_source(src) for dst, src in sources.items()})
            for dst, src in sources.items():
                copies.take_outputs(live[dst], live[src])
            rids = list(sources)
            self._sample(torch.stack([live[rid].last_logits for rid in rids]), rids, live, return_logprobs)
        if self._caching():
            keep_prompt_ends(self, run, sources, live)
        for c in run:  # a prefix prefilled: the scheduler holds it (rule 6), its sequence is its own
            if not live[c.rid].max_new and c.start + c.num_tokens == len(live[c.rid].prompt):
                copies.held[c.rid] = c.rid
        for key, src in plan.proposed.hold:  # src has decoded nothing yet: its sequence is the prompt
            copies.held[key] = self._next_id
            self._next_id += 1
            self._fork({copies.held[key]: src})
        self._let_go(copies, plan.proposed.unhold)

    def _fork(self, sources, upto=None) -> None:
        self.state = fork(self.state, sources, upto)
        if self._hidden_layers():  # the proposer's per-request state (prompt_keys checked it can)
            if upto is None:  # copies take all of it
                self.proposer.fork(sources)
            else:
                self.proposer.fork(sources, upto)

    def _release(self, seqs) -> None:
        """Free sequences' KV pages and the proposer's state of them (a draft model's context)."""
        if any(s in self.state.seqs for s in seqs):
            self.state = release(self.state, [s for s in seqs if s in self.state.seqs])
        if self.config.num_draft_tokens and hasattr(self.proposer, "forget"):
            for s in seqs:
                self.proposer.forget(s)

    def _let_go(self, copies: PromptCopies, keys, evict: bool = False) -> None:
        """Release the sequences of held prompts; of prefix cache entries, only with evict (else
        they stay in the cache for later calls)."""
        seqs = [copies.held.pop(k) for k in keys]
        if self._caching():
            cached = [s for s in seqs if self._caching(s)]
            for s in cached if evict else ():
                self.prefix_cache.drop(s)
            seqs = [s for s in seqs if s not in cached or evict]
        self._release(seqs)

    def _prefill_outputs(self, run, batch, out, live, return_logprobs) -> None:
        """Hand each run chunk its outputs: hidden states to the proposer, routed experts and
        prompt log-probs to its request, and a first token to each finished prompt."""
        offsets = batch.cu_seqlens.tolist()
        if out.hidden_TLH is not None:
            self._observe([(c.rid, out.hidden_TLH[offsets[b]:offsets[b + 1]]) for b, c in enumerate(run)])
        for b, c in enumerate(run):
            r = live[c.rid]
            if out.routed_experts_TLK is not None:
                r.experts.append(out.routed_experts_TLK[offsets[b]:offsets[b + 1]])
            if return_logprobs:  # logits at position t score prompt token t+1 ([] for a last 1-token chunk)
                nxt = r.prompt[c.start + 1:c.start + c.num_tokens + 1]
                logits = out.logits_TV[offsets[b]:offsets[b] + len(nxt)]
                r.prompt_logprobs += token_logprobs(logits, torch.tensor(nxt, dtype=torch.long,
                                                                         device=logits.device)).tolist()
        done = [(b, c.rid) for b, c in enumerate(run) if c.start + c.num_tokens == len(live[c.rid].prompt)]
        if done:  # a finished prompt's last logits give its first token (a prefix's: none)
            logits_BV = out.logits_BV[[b for b, _ in done]]
            drawn = [i for i, (_, rid) in enumerate(done) if live[rid].max_new]
            if drawn:
                self._sample(logits_BV[drawn], [done[i][1] for i in drawn], live, return_logprobs)
            for (_, rid), keep in zip(done, logits_BV):  # copies of it may fork from it later
                if live[rid].copied:
                    live[rid].last_logits = keep

    def _spec_pass(self, rids, live, return_logprobs, capture, stops) -> dict[int, int]:
        """A decode step that also verifies drafts: each request feeds its last token and up to
        num_draft_tokens proposed ones, and the target's logits after each fed token decide.
        Greedy: the drafts that equal the argmax are kept, then the argmax after the last kept
        one. Sampled: spec.accept.accept_sampled. Each request decides under its own sampling
        params (spec.accept.accept_each). The KV of rejected drafts is dropped. Returns tokens kept
        per rid."""
        asks = [(rid, JoinedTokens(live[rid].prompt, live[rid].tokens),  # room: the bonus token needs one
                 min(self.config.num_draft_tokens, live[rid].max_new - len(live[rid].tokens) - 1)) for rid in rids]
        if hasattr(self.proposer, "propose_many"):  # all requests' drafts at once (a batched draft model)
            proposed = self.proposer.propose_many(asks)
        else:
            proposed = [self.proposer.propose(*ask) if ask[2] > 0 else [] for ask in asks]
        drafts = {}
        for (rid, _, room), d in zip(asks, proposed):
            d = [int(t) for t in d]
            if len(d) > max(room, 0) or any(not 0 <= t < self.cfg.vocab_size for t in d):
                raise ValueError(f"generate: the proposer returned {d} for at most {max(room, 0)} tokens in "
                                 f"[0, {self.cfg.vocab_size})")
            drafts[rid] = d
        lengths = {rid: self.state.seqs[rid].length for rid in rids}
        batch = Batch.from_tokens(list(rids), [[live[rid].tokens[-1]] + drafts[rid] for rid in rids])
        self.state, out = prefill(self.state, batch, all_logits=True, capture_experts=capture,
                                  capture_hidden=self._hidden_layers(), graphs=self.graphs)
        news = accept_each(out.logits_TV, [drafts[rid] for rid in rids], [live[rid].sp for rid in rids],
                           [live[rid].gen for rid in rids])
        kept, offset, observed, kept_rows = {}, 0, [], []
        for b, rid in enumerate(rids):
            d, new = drafts[rid], news[b]
            accepted = len(new) - 1  # the drafts kept; then one token of the target's own
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            new = new[:cut]
            r = live[rid]
            r.tokens += new
            kept_rows += range(offset, offset + len(new))
            if out.routed_experts_TLK is not None:
                r.experts.append(out.routed_experts_TLK[offset:offset + len(new)])
            kept[rid] = len(new)
            lengths[rid] += len(new)  # the fed tokens whose KV stays: the last one and the accepted drafts
            if out.hidden_TLH is not None:  # every fed row, and how many of them stay
                observed.append((rid, out.hidden_TLH[offset:offset + len(d) + 1], len(new)))
            self.spec_stats["drafted"] += len(d)
            self.spec_stats["accepted"] += accepted
            offset += len(d) + 1
        self.spec_stats["steps"] += 1
        if return_logprobs:  # every kept token's log-prob in one gather and one copy to the host
            rows = torch.tensor(kept_rows, device=out.logits_TV.device)
            toks = torch.tensor([t for rid in rids for t in live[rid].tokens[-kept[rid]:]], device=rows.device)
            lp = iter(token_logprobs(out.logits_TV[rows], toks).tolist())
            for rid in rids:
                live[rid].logprobs += [next(lp) for _ in range(kept[rid])]
        if observed and hasattr(self.proposer, "observe_verified"):  # it takes every fed row (DFlashProposer)
            self.proposer.observe_verified(observed)
        elif observed:
            self._observe([(rid, hidden_QLH[:n]) for rid, hidden_QLH, n in observed])
        self.state = truncate(self.state, lengths)
        return kept

    @staticmethod
    def _is_done(r: _Live, stops) -> bool:
        r.done = r.done or bool(r.tokens) and (len(r.tokens) >= r.max_new or r.tokens[-1] in stops)
        return r.done

    def _launch_decode(self, rids, live, return_logprobs, capture, last: _Launched | None) -> _Launched:
        """Queue a decode step and its sampling without waiting for the GPU. Each request feeds
        its last token: from `last` (the step before, whose tokens are not read yet) on the device
        when given, which then holds every rid, else from the host."""
        if last is None:
            batch = Batch.from_tokens(list(rids), [[live[r].tokens[-1]] for r in rids])
        else:
            tokens_T = last.next_B
            if tuple(rids) != last.rids:  # requests retired since: pick the rest's rows
                row = {rid: b for b, rid in enumerate(last.rids)}
                index_B = upload([torch.tensor([row[rid] for rid in rids])], tokens_T.device)[0]
                tokens_T = tokens_T[index_B]
            batch = Batch(tuple(rids), tokens_T, (1,) * len(rids), sampled=True)
        self.state, out = decode(self.state, batch, capture_experts=capture, graphs=self.graphs)
        next_B = sample_each(out.logits_BV, [live[r].sp for r in rids], [live[r].gen for r in rids])
        lp_B = token_logprobs(out.logits_BV, next_B) if return_logprobs else None
        ready = None
        if next_B.is_cuda:  # into pinned host memory, read once `ready` has passed
            host = (next_B.to("cpu", non_blocking=True), None if lp_B is None else lp_B.to("cpu", non_blocking=True))
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = (next_B, lp_B)
        return _Launched(tuple(rids), next_B, host, out.routed_experts_TLK, ready)

    def _read_back(self, step: _Launched, live, stops) -> set[int]:
        """Wait for a launched step's tokens and hand them to its requests, except those done
        before it (an overlapped step ran them once more). Returns the rids it finished."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host[0].tolist()
        lps = step.host[1].tolist() if step.host[1] is not None else None
        finished = set()
        for b, rid in enumerate(step.rids):
            r = live[rid]
            if r.done:
                continue
            r.tokens.append(tokens[b])
            if lps is not None:
                r.logprobs.append(lps[b])
            if step.experts_BLK is not None:
                r.experts.append(step.experts_BLK[b:b + 1])
            if self._is_done(r, stops):
                finished.add(rid)
        return finished
