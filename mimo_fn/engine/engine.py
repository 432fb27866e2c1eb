"""Engine: the thin stateful shell over the pure step functions, for servers, scripts and RL
frameworks.

It owns one EngineState and one scheduler state and runs passes: the scheduler (sched/) decides
each pass's prefill chunks or decodes, the step functions (model.py) run them, and the engine
samples and hands back what each request got. Online: add_request, then step() until the request
reports it finished (abort drops one at once); generate is that loop over a batch of prompts. All
model math lives in model.py, all paging in cache.py, all admission policy in sched/; the passes
are in mimo_fn.engine.passes.
"""

import time
from collections import Counter
from typing import Sequence

import torch
from tqdm.auto import tqdm

from mimo_fn import sched
from mimo_fn.batch import Batch
from mimo_fn.cache import swa_seq_limit
from mimo_fn.config import ModelConfig
from mimo_fn.engine.args import GenerateArgs, agree_on_call, check_args
from mimo_fn.engine.config import EngineConfig
from mimo_fn.engine.passes import Launched, Passes
from mimo_fn.engine.prefix_cache import PrefixCache, entries_for
from mimo_fn.engine.prompt_copies import PromptCopies, prompt_keys, shared_prefixes
from mimo_fn.engine.requests import Cohort, Live, Output, RequestOutput
from mimo_fn.engine.rl_api import RLApi
from mimo_fn.graphs import DecodeGraphs
from mimo_fn.layers.sampling import SamplingParams
from mimo_fn.model import EngineState, init_state, prefill, release
from mimo_fn.parallel.mesh import Mesh
from mimo_fn.params import Params
from mimo_fn.rl.engine_memory import EngineMemory
from mimo_fn.speculative.build import build_proposer
from mimo_fn.speculative.ngram import NgramProposer
from mimo_fn.speculative.proposer import Proposer, as_proposer
from mimo_fn.speculative.stats import SpecTally, mean_accept_length, summary

__all__ = ["Engine", "Output", "RequestOutput"]


class Engine(Passes, RLApi):
    """One rank's engine. On a mesh (DP attention / TP / EP, `init_mesh`) every rank builds one
    over its own weights (`shard_params` or `load_checkpoint(..., mesh=mesh)`) and calls each
    method together: every TP rank of a DP group `generate`s the same prompts with the same
    arguments, and DP groups their own prompts. Passes are collective: a DP group with nothing
    to run joins each pass with a zero-token step until every group is done, and the groups
    negotiate prefill passes (sched.delayer) over the mesh's host group."""

    def __init__(self, cfg: ModelConfig, params: Params, config: EngineConfig, mesh: Mesh | None = None):
        self.cfg, self.config = cfg, config
        self.mesh = mesh or Mesh.single()
        proposer = config.proposer
        if isinstance(proposer, str):
            proposer = build_proposer(proposer, cfg, params, config.draft_path, cuda_graphs=config.cuda_graphs,
                                      min_confidence=config.draft_min_confidence)
        self.proposer = proposer or NgramProposer()  # a Proposer (the property below)
        self.prefix_cache = PrefixCache.for_engine(cfg, config, self.proposer, self._hidden_layers())
        # a speculative step may hand back num_draft_tokens tokens: keep that much SWA history; the
        # prefix cache keeps all of it where the SWA pool is as large as the full one (an entry
        # forks at any point), else a token more (mimo_fn.engine.prefix_cache)
        slack = config.num_draft_tokens
        if self.prefix_cache is not None:
            slack = config.max_tokens if self.prefix_cache.swa_slack is None else self.prefix_cache.swa_slack
        self.state: EngineState = init_state(cfg, params, config.max_tokens, config.page_size,
                                             config.max_swa_tokens, swa_slack=slack, mesh=self.mesh,
                                             deterministic=config.deterministic)
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
        # the requests in flight: the scheduler's state, each request's progress (and that of the
        # prefixes and prefix cache entries they fork), prompt copies, how many cohorts fork each entry
        self._st = sched.init_state()
        self._live: dict[int, Live] = {}
        self._copies = PromptCopies()
        self._entry_users: Counter[int] = Counter()
        self._launched: Launched | None = None  # a decode step whose tokens are not read yet (overlap)
        self._stopped: set[int] = set()  # requests found done since the last finish_pass
        self._pending: list[RequestOutput] = []  # outputs of passes run by flush_cache, for the next step
        self._ahead: tuple | None = None  # drafts queued for the next verify step (Passes._propose_ahead)
        self.idle = True  # the last pass found nothing to run on any rank
        self._spec_last = SpecTally()  # verify steps since the last generate began (spec_stats)
        self._spec_total = SpecTally()  # since the engine started (server_info)
        self.prefix_stats = {"hits": 0, "tokens": 0}  # prompts of the last generate that forked an entry, their tokens
        self.graphs = DecodeGraphs() if config.cuda_graphs else None
        self.memory = EngineMemory(self, config.memory_saver)  # release_memory's records (memory_saver: the move)
        # ranks that agree on each step's graph shape must send every forward through the graphs
        self._graphs_always = self.graphs is not None and DecodeGraphs.agree_on(self.mesh)
        self._init_rl()  # weight version, weight-update groups, paused generation

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

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, value) -> None:
        self._proposer = as_proposer(value)

    # online: one request at a time, one pass a step

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 16, sampling: SamplingParams | None = None,
                    return_logprobs: bool = False, return_routed_experts: bool = False,
                    stop_token_ids: Sequence[int] | int | None = ()) -> int:
        """Queue a request; it joins the next pass the scheduler admits it to. Returns its id.
        A ValueError naming the argument (nothing queued) for bad input or a request the KV pool
        cannot hold. sampling: None = greedy; a request samples from its own generator, seeded
        with sampling.seed. On a mesh the TP ranks of a DP group add the same requests."""
        self.memory.check("add_request")
        args = check_args([prompt], max_new_tokens, sampling, stop_token_ids, self.cfg.vocab_size, "add_request",
                          self.cfg.max_position_embeddings)
        try:
            return self._admit(args, bool(return_logprobs), bool(return_routed_experts))[0]
        except ValueError as e:
            msg = str(e).replace("prompt 0: ", "prompt: ", 1)
            raise ValueError(f"add_request: {msg} (EngineConfig.max_tokens = {self.config.max_tokens})") from None

    def step(self) -> list[RequestOutput]:
        """Run one pass (on a mesh every rank calls it together; a rank with nothing to run joins
        the pass) and return what it did for each request: new tokens, and for those that finished
        (or were aborted since the last step) their whole Output. If the pass raises, every request
        in flight is dropped (its pages freed) and the engine stays usable."""
        outs, self._pending = self._pending, []
        return outs if self._paused else outs + self._run_pass()  # paused: requests wait (pause_generation)

    def has_unfinished(self) -> bool:
        """Requests queued or running on this rank, or outputs step() has not handed out yet."""
        return bool(self._pending) or any(r.cohort is not None and not r.done for r in self._live.values())

    def abort(self, rid: int) -> bool:
        """Drop request rid now: its pages go back to the pool, and the next step() reports it
        with finish_reason "abort" and what it had. False if no request rid is queued or running."""
        r = self._live.get(rid)
        if r is None or r.cohort is None or not r.max_new or r.done:
            return False
        self._st = sched.remove(self._st, rid)
        r.done = r.aborted = True
        self._release([rid])
        self._pending += self._report([rid])
        self._finish(r.cohort)
        return True

    def flush_cache(self, timeout: float = 30.0) -> bool:
        """Empty the prefix cache once no request is in flight: run the requests in flight to the
        end first (their outputs wait for the next step()), for at most timeout seconds. False, and
        nothing emptied, if they did not finish in time."""
        deadline = time.monotonic() + timeout
        while any(r.cohort is not None and not r.done for r in self._live.values()):
            if time.monotonic() > deadline:
                return False
            self._pending += self._run_pass()
        self._drop_cache()
        return True

    def warmup(self) -> None:
        """Compile, autotune and capture the CUDA graphs of the configured shapes before the first
        request: a chunk-sized prefill and decode steps of batches of 1 to 8 requests (as the
        graphs bucket them). Leaves nothing cached."""
        if self.has_unfinished():
            raise ValueError("warmup: requests are in flight; call it before adding any")
        page, vocab = self.config.page_size, self.cfg.vocab_size
        n = max(min(self.config.chunk_size, self.sched_config.capacity_tokens - 4 * page,
                    self.cfg.max_position_embeddings - 4), 1)
        self.generate([[(7 * i + 3) % vocab for i in range(n)]], max_new_tokens=2)
        b = 1
        while b <= min(self.config.max_batch, 8):
            self.generate([[(b * 31 + 5 * i + j) % vocab for i in range(page)] for j in range(b)], max_new_tokens=3)
            b *= 2
        self._drop_cache()
        self._spec_total = SpecTally()

    def server_info(self) -> dict:
        """What a server reports of this rank's engine (SGLang's /get_server_info names where it has one)."""
        total, free = self.sched_config.num_pages, self._free_pages()
        return {
            "num_running_reqs": self._st.num_in_flight, "num_waiting_reqs": len(self._st.waiting),
            "num_total_pages": total, "num_free_pages": free, "num_used_pages": total - free,
            "page_size": self.config.page_size, "max_total_num_tokens": self.sched_config.capacity_tokens,
            "prefix_cache_entries": len(self.prefix_cache) if self._caching() else 0,
            # mean tokens a request keeps per verify step, the bonus token included (spec_stats' too)
            "avg_spec_accept_length": mean_accept_length(self._spec_total),
            "cuda_graph_captures": self.graphs.stats["captures"] if self.graphs is not None else 0,
        }

    def spec_stats(self) -> dict:
        """Speculative decoding since the last generate call began (its verify steps and those of
        requests stepped alongside): steps, verified (request-steps), drafted, accepted,
        mean_accept_length (tokens kept per request and verify step, the bonus token included;
        None without one) and histogram {acceptance length: request-steps}
        (mimo_fn.speculative.stats)."""
        return summary(self._spec_last, self.config.num_draft_tokens)

    def _admit(self, args: GenerateArgs, logprobs: bool, experts: bool) -> tuple[int, ...]:
        """Queue args' prompts as one cohort: identical prompts among them prefill once, prompts
        that begin alike fork a shared prefix, and prefix cache entries are forked (prompt_copies,
        prefix_cache). Returns their rids; a ValueError (nothing queued) where the scheduler
        refuses one."""
        first, n = self._next_id, len(args.prompts)
        page, capacity = self.config.page_size, self.sched_config.capacity_tokens
        for i, (t, m) in enumerate(zip(args.prompts, args.limits)):  # sched.submit would name a rid
            need = len(t) + m
            if -(-need // page) * page > capacity:
                raise ValueError(f"prompt {i}: {len(t)} prompt tokens + max_new_tokens {m} = {need} tokens "
                                 f"exceeds the KV capacity of {capacity} tokens (pages of {page} tokens)")
        share = self.config.share_prompts and (not self._hidden_layers() or self.proposer.can_fork)
        keys = prompt_keys(args, first, share)
        groups = shared_prefixes(args.prompts, keys, first, self.config.page_size) if share and (
            self.sched_config.hold_prompts and self.sched_config.policy == "fcfs") else []  # fcfs: prefix first
        hits = {}  # rid -> (the prefix cache entry it forks, how many tokens); a prompt or a group prefix
        if self._caching():
            hits, groups = entries_for(self.prefix_cache, args.prompts, groups, keys, first, logprobs, experts)
        prefix = {first + i: (first + n + g, length) for g, (length, members) in enumerate(groups) for i in members}
        prefix.update((rid, (e.seq, m)) for rid, (e, m) in hits.items())
        none = (-1, 0)
        reqs = [sched.Request(first + n + g, length, 1, prefix_only=True, prefix_key=prefix.get(first + n + g, none)[0],
                              prefix_len=prefix.get(first + n + g, none)[1]) for g, (length, _) in enumerate(groups)]
        reqs += [sched.Request(first + i, len(t), m, prompt_key=k, prefix_key=prefix.get(first + i, none)[0],
                               prefix_len=prefix.get(first + i, none)[1])
                 for i, (t, m, k) in enumerate(zip(args.prompts, args.limits, keys))]
        entries = {e.seq: e for e, _ in hits.values()}
        st = sched.submit(self._st, self.sched_config, reqs)  # a ValueError here leaves everything as it was
        self._st = sched.hold(st, sorted(s for s in entries if s not in self._copies.held))
        cohort = Cohort(list(range(first, first + n + len(groups))), set(entries), n)
        flags = dict(want_logprobs=logprobs, want_experts=experts, stops=args.stops, cohort=cohort)
        for i, (toks, m, sp, k) in enumerate(zip(args.prompts, args.limits, args.sampling, keys)):
            seed = (sp.seed if sp is not None else 0) + i
            self._live[first + i] = Live(toks, torch.Generator().manual_seed(seed), m, sp, k >= 0, **flags)
        for g, (length, members) in enumerate(groups):  # max_new 0: a prefix decodes nothing
            self._live[first + n + g] = Live(args.prompts[members[0]][:length], torch.Generator(), 0, None, True,
                                             **flags)
        device = self.state.params.embed.device
        for e in entries.values():  # held as prefixes for these requests (one record however many cohorts)
            self._copies.held[e.seq] = e.seq
            if e.seq not in self._live:
                self._live[e.seq] = Live(e.tokens[:e.length], torch.Generator(), 0, None, False,  # as take_prefix
                                         **e.outputs(device, e.logprobs is not None, e.experts is not None))
            self._entry_users[e.seq] += 1
        self._copies.add(keys, first)
        self._next_id += n + len(groups)
        return tuple(range(first, first + n))

    def _run_pass(self) -> list[RequestOutput]:
        """One pass of the scheduler's, and what it did for each request."""
        try:
            return self._pass()
        except BaseException:
            self._drop_in_flight()
            raise

    def _pass(self) -> list[RequestOutput]:
        step = self._schedule(self._st)
        self.idle = step is None
        if step is None or step[1].prefill:  # (so not the verify step _propose_ahead drafted for)
            self._ahead = None
        if step is None:
            if self._launched is not None:  # the last step's tokens (its requests are retired already)
                self._read_back(self._launched)
                self._launched = None
            return []
        st, plan = step
        kept, launched = None, self._launched
        if (st.held and not plan.prefill and not st.running and st.chunked is None
                and plan.proposed.stop == "kv"  # held prompts keep the pages the next request needs
                and not (self._caching() and self._make_room(st))):  # entries first
            st, keys = sched.let_go(st)
            self._let_go(keys, evict=True)
        overlap = (self.config.overlap and plan.decode and not self.config.num_draft_tokens
                   and launched is not None and set(plan.decode) <= set(launched.rids))
        if launched is not None and not overlap:  # this pass needs the last step's tokens first
            self._stopped |= self._read_back(launched)
            launched = None
        if plan.prefill:
            self._prefill_pass(plan)
            self._copies.drop_logits([c.rid for c in plan.prefill], self._live)
        elif plan.decode and self.config.num_draft_tokens:
            kept = self._spec_pass(plan.decode)
        elif plan.decode:
            step = self._launch_decode(plan.decode, launched)
            if launched is not None:  # read the step before while this one runs
                self._stopped |= self._read_back(launched)
            launched = step
            if not self.config.overlap:
                self._stopped |= self._read_back(launched)
                launched = None
        elif self.mesh.world > 1:
            self._idle_pass()
        self._launched = launched
        if plan.prefill or kept is not None:  # tokens known now: a prompt's first, or a verify step's
            self._stopped |= {rid for rid in plan.decode + tuple(c.rid for c in plan.prefill)
                              if self._is_done(self._live[rid])}
        st, done = sched.finish_pass(st, plan, self._stopped, kept)
        self._st, self._stopped = st, set()
        rids = [r.rid for r in done]
        for rid in rids:
            self._live[rid].done = True
        if rids and self._caching():  # kept for later calls
            self._keep_finished(rids)
        elif rids:
            self.state = release(self.state, rids)
        outs = self._report(list(self._live), rids)  # a read-back step's requests need not be in this plan
        for cohort in [self._live[rid].cohort for rid in rids]:
            self._finish(cohort)
        if self._caching() and plan.proposed.stop == "kv" and st.waiting:
            self._make_room(st)
        return outs

    def _report(self, rids, finished=None) -> list[RequestOutput]:
        """The new tokens of requests rids (once each), with the whole result of those done."""
        outs, finished = [], set(rids if finished is None else finished)
        for rid in rids:
            r = self._live[rid]
            if r.cohort is None or not r.max_new or (r.reported == len(r.tokens) and rid not in finished):
                continue
            new = r.tokens[r.reported:]
            lps = r.logprobs[r.reported:] if r.want_logprobs else None
            r.reported = len(r.tokens)
            res = r.result() if rid in finished else None
            outs.append(RequestOutput(rid, new, lps, res and res.finish_reason, res))
        return outs

    def _finish(self, cohort: Cohort) -> None:
        """Count a cohort's request done; once all are, let go of what it held and forget it."""
        cohort.unfinished -= 1
        if cohort.unfinished:
            return
        for seq in cohort.entries:
            self._entry_users[seq] -= 1
        entries = [s for s in cohort.entries if not self._entry_users[s]]
        keys = [k for k in cohort.rids + entries if k in self._copies.held]
        if self._caching():  # the entries its requests forked, where their own entries hold all of them
            self.prefix_cache.drop_covered([self._copies.held[k] for k in keys])
        self._st = sched.unhold(self._st, keys)
        self._let_go(keys)
        self._release([rid for rid in cohort.rids if not self._caching(rid)])  # the proposer forgets them too
        for rid in cohort.rids:
            del self._live[rid]
            self._copies.remove(rid)
        for seq in entries:
            del self._entry_users[seq]
            self._live.pop(seq, None)

    def _drop_in_flight(self) -> None:
        """After a pass failed: free every request in flight, hold nothing (prefix cache entries stay)."""
        self._release([s for s in self.state.seqs if not self._caching(s)])
        self._st, self._live, self._copies = sched.init_state(), {}, PromptCopies()
        self._entry_users.clear()
        self._launched, self._stopped, self._pending, self._ahead = None, set(), [], None

    # offline: a batch of prompts to the end

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
        differ where they must agree, raise a ValueError on every rank before anything runs.
        It runs the engine's step() loop: requests added before (add_request) run alongside, and
        their outputs wait for the next step()."""
        error, args, rids = None, None, ()
        try:
            self.memory.check("generate")
            if self._paused:
                raise ValueError("generate: generation is paused (pause_generation); call continue_generation first")
            args = check_args(prompts, max_new_tokens, sampling, stop_token_ids, self.cfg.vocab_size,
                              max_positions=self.cfg.max_position_embeddings)
        except ValueError as e:
            error = e
        fingerprint = args.fingerprint() if error is None and self.mesh.world > 1 else None
        if error is None:
            try:
                rids = self._admit(args, bool(return_logprobs), bool(return_routed_experts))
            except ValueError as e:
                error = ValueError(f"generate: {e} (EngineConfig.max_tokens = {self.config.max_tokens})")
        try:
            agree_on_call(self.mesh, self.state.params.embed.device, error, fingerprint,
                          (bool(return_logprobs), bool(return_routed_experts)))
        except ValueError:
            for rid in rids:  # another rank refused: this one's requests go too
                self.abort(rid)
            self._pending = [o for o in self._pending if o.rid not in rids]
            raise
        self.prefix_stats = {"hits": 0, "tokens": 0}
        self._spec_last = SpecTally()
        results: dict[int, Output] = {}
        mine, others = set(rids), []
        with tqdm(total=len(rids), desc="generate", disable=not self.config.progress or self.mesh.rank != 0) as bar:
            while True:  # on a mesh until no rank has work: a DP group with no prompts joins every pass
                outs = self._run_pass()
                for o in outs:
                    if o.rid in mine and o.finished:
                        results[o.rid] = o.output
                        bar.update(1)
                    elif o.rid not in mine:
                        others.append(o)
                if len(results) == len(rids) and (self.mesh.world == 1 or self.idle):
                    break
                assert not (self.idle and self.mesh.world == 1), "generate: requests lost"
        self._pending += others  # requests added with add_request: their outputs wait for step()
        if self._launched is not None and not self.has_unfinished():
            self._read_back(self._launched)
            self._launched = None
        return [results[rid] for rid in rids]
