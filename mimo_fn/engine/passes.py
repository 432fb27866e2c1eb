"""The engine's passes: what one scheduler pass runs and how its outputs reach the requests.

Engine (mimo_fn.engine.engine) inherits these: a prefill pass (chunks, prompt copies, held
prefixes), a speculative verify step, a plain decode step launched ahead of its read-back
(EngineConfig.overlap), and the prefix cache's side of a pass (entries kept, made room for).
They read and write the engine's request records (`_live`: rid -> Live), prompt copies
(`_copies`) and state; flags that shape a step (log-probs, routed experts) are those of the
requests it runs.

Legend: B sequences of a step, V vocabulary, T tokens, L target layers read, H hidden.
"""

import itertools
from dataclasses import dataclass

import torch

from mimo_fn.batch import Batch
from mimo_fn.engine.prefix_cache import entry_outputs, fork_ranges
from mimo_fn.engine.requests import Live
from mimo_fn.layers.sampling import sample_each, token_logprobs
from mimo_fn.model import decode, fork, keep_swa, prefill, release, truncate
from mimo_fn.sched.policy import order_waiting
from mimo_fn.sched.state import reserved_tokens
from mimo_fn.speculative.accept import accept_each
from mimo_fn.speculative.ngram import JoinedTokens
from mimo_fn.upload import upload


@dataclass(frozen=True)
class Launched:
    """A decode step whose tokens are still on their way to the host (EngineConfig.overlap)."""

    rids: tuple[int, ...]
    next_B: torch.Tensor  # the sampled tokens on the model's device: the next step's input
    host: tuple[torch.Tensor, torch.Tensor | None]  # tokens and log-probs, copying to the host
    experts_BLK: torch.Tensor | None  # routed experts of the step (device)
    ready: torch.cuda.Event | None  # recorded after the copies (None off CUDA: nothing in flight)


def _cut(rows: list[list[int]], counted: bool) -> list[list[int]]:
    """Each row's drafts; where counted, a row ends in how many of them to keep (clamped to them)."""
    return [r[:max(0, min(r[-1], len(r) - 1))] for r in rows] if counted else rows


def _ask_key(asks) -> tuple:
    """What a proposal answers: each request, its length and k."""
    return tuple((rid, len(tokens), k) for rid, tokens, k in asks)


class Passes:
    def _wants(self, rids) -> tuple[bool, bool]:
        """(log-probs, routed experts): whether any of rids asked for them."""
        live = self._live
        return any(live[r].want_logprobs for r in rids), any(live[r].want_experts for r in rids)

    def _sample(self, logits_BV, rids) -> None:
        live = self._live
        nxt_B = sample_each(logits_BV, [live[r].sp for r in rids], [live[r].gen for r in rids])
        lp_B = token_logprobs(logits_BV, nxt_B).tolist() if self._wants(rids)[0] else None
        nxt = nxt_B.tolist()  # one copy to the host (an int() per element would sync once per request)
        for b, rid in enumerate(rids):
            live[rid].tokens.append(nxt[b])
            if lp_B is not None:
                live[rid].logprobs.append(lp_B[b])

    def _hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the proposer reads (none unless speculative)."""
        return tuple(self.proposer.target_layers) if self.config.num_draft_tokens else ()

    def _prefill_pass(self, plan) -> None:
        """Run a prefill pass: the model runs the chunks, then the copies (sched.Chunk.source)
        take their source's K/V (model.fork; a held prompt's, if it is held) and outputs, and
        draw their first tokens from its kept logits; then the prompts the plan holds are
        forked into sequences of their own, and those it lets go are released."""
        live, copies, chunks = self._live, self._copies, plan.prefill
        sources = {c.rid: c.source for c in chunks if c.source >= 0}
        run = [c for c in chunks if c.source < 0]
        prefixed = [c for c in run if c.prefix >= 0]
        if prefixed:  # their first c.start tokens' K/V and outputs come from a held prefix
            self._fork({c.rid: c.prefix for c in prefixed}, {c.rid: c.start for c in prefixed})
            for c in prefixed:
                copies.take_prefix(live[c.rid], live[c.prefix], c.start, live[c.rid].want_logprobs)
                if self._caching(c.prefix):
                    self.prefix_stats["hits"] += 1
                    self.prefix_stats["tokens"] += c.start
        if run or self.mesh.world > 1:  # on a mesh the pass's collectives run even with no tokens here
            batch = Batch.from_tokens([c.rid for c in run],
                                      [live[c.rid].prompt[c.start:c.start + c.num_tokens] for c in run])
            logprobs, experts = self._wants([c.rid for c in run])
            self.state, out = prefill(self.state, batch, all_logits=logprobs, capture_experts=experts,
                                      capture_hidden=self._hidden_layers(),
                                      graphs=self.graphs if self._graphs_always else None)
            self._prefill_outputs(run, batch, out)
        if sources:
            self._fork({dst: copies.kv_source(src) for dst, src in sources.items()})
            for dst, src in sources.items():
                copies.take_outputs(live[dst], live[src])
            rids = list(sources)
            self._sample(torch.stack([live[rid].last_logits for rid in rids]), rids)
        if self._caching():
            self._keep_prompt_ends(run, sources)
        for c in run:  # a prefix prefilled: the scheduler holds it (rule 6), its sequence is its own
            if not live[c.rid].max_new and c.start + c.num_tokens == len(live[c.rid].prompt):
                copies.held[c.rid] = c.rid
        for key, src in plan.proposed.hold:  # src has decoded nothing yet: its sequence is the prompt
            copies.held[key] = self._next_id
            self._next_id += 1
            self._fork({copies.held[key]: src})
        self._let_go(plan.proposed.unhold)

    def _fork(self, sources, upto=None) -> None:
        self.state = fork(self.state, sources, upto)
        if self._hidden_layers():  # the proposer's per-request state (prompt sharing checked it can)
            self.proposer.fork(sources, upto)

    def _release(self, seqs) -> None:
        """Free sequences' KV pages and the proposer's state of them (a draft model's context)."""
        if any(s in self.state.seqs for s in seqs):
            self.state = release(self.state, [s for s in seqs if s in self.state.seqs])
        if self.config.num_draft_tokens:
            for s in seqs:
                self.proposer.forget(s)

    def _let_go(self, keys, evict: bool = False) -> None:
        """Release the sequences of held prompts; of prefix cache entries, only with evict (else
        they stay in the cache for later calls)."""
        seqs = [self._copies.held.pop(k) for k in keys if k in self._copies.held]
        if self._caching():
            cached = [s for s in seqs if self._caching(s)]
            for s in cached if evict else ():
                self.prefix_cache.drop(s)
            seqs = [s for s in seqs if s not in cached or evict]
        self._release(seqs)

    def _prefill_outputs(self, run, batch, out) -> None:
        """Hand each run chunk its outputs: hidden states to the proposer, routed experts and
        prompt log-probs to its request, and a first token to each finished prompt."""
        live = self._live
        offsets = batch.cu_seqlens.tolist()
        if out.hidden_TLH is not None:
            self.proposer.observe_many([(c.rid, out.hidden_TLH[offsets[b]:offsets[b + 1]]) for b, c in enumerate(run)])
        for b, c in enumerate(run):
            r = live[c.rid]
            if out.routed_experts_TLK is not None:
                r.experts.append(out.routed_experts_TLK[offsets[b]:offsets[b + 1]])
            if out.logits_TV is not None and r.want_logprobs:  # logits at t score prompt token t+1 ([] for a
                nxt = r.prompt[c.start + 1:c.start + c.num_tokens + 1]  # last 1-token chunk)
                logits = out.logits_TV[offsets[b]:offsets[b] + len(nxt)]
                r.prompt_logprobs += token_logprobs(logits, torch.tensor(nxt, dtype=torch.long,
                                                                         device=logits.device)).tolist()
        done = [(b, c.rid) for b, c in enumerate(run) if c.start + c.num_tokens == len(live[c.rid].prompt)]
        if done:  # a finished prompt's last logits give its first token (a prefix's: none)
            logits_BV = out.logits_BV[[b for b, _ in done]]
            drawn = [i for i, (_, rid) in enumerate(done) if live[rid].max_new]
            if drawn:
                self._sample(logits_BV[drawn], [done[i][1] for i in drawn])
            for (_, rid), keep in zip(done, logits_BV):  # copies of it may fork from it later
                if live[rid].copied:
                    live[rid].last_logits = keep

    def _spec_pass(self, rids) -> dict[int, int]:
        """A decode step that also verifies drafts: each request feeds its last token and up to
        num_draft_tokens proposed ones, and the target's logits after each fed token decide.
        Greedy: the drafts that equal the argmax are kept, then the argmax after the last kept
        one. Sampled: speculative.accept.accept_sampled. Each request decides under its own
        sampling params (speculative.accept.accept_each). The KV of rejected drafts is dropped.
        Returns tokens kept per rid."""
        live = self._live
        asks = self._spec_asks(rids)
        on_device = None
        if len({k for *_, k in asks}) == 1 and asks[0][2] > 0:
            ahead, self._ahead = self._ahead, None
            on_device = ahead[1] if ahead is not None and ahead[0] == _ask_key(asks) else None
            if on_device is None:
                on_device = self.proposer.propose_device(asks)
        if on_device is not None:
            batch, read_drafts = self._device_drafts(rids, on_device, asks[0][2])
        else:
            drafts = {}
            for (rid, _, room), d in zip(asks, self.proposer.propose_many(asks)):
                d = [int(t) for t in d]
                if len(d) > max(room, 0) or any(not 0 <= t < self.cfg.vocab_size for t in d):
                    raise ValueError(f"generate: the proposer returned {d} for at most {max(room, 0)} tokens in "
                                     f"[0, {self.cfg.vocab_size})")
                drafts[rid] = d
            batch = Batch.from_tokens(list(rids), [[live[rid].tokens[-1]] + drafts[rid] for rid in rids])
        lengths = {rid: self.state.seqs[rid].length for rid in rids}
        logprobs, experts = self._wants(rids)
        self.state, out = prefill(self.state, batch, all_logits=True, capture_experts=experts,
                                  capture_hidden=self._hidden_layers(), graphs=self.graphs)
        fed = []  # each request's fed rows' hidden states: the draft model's work on them queues behind the step
        if out.hidden_TLH is not None:
            ends = itertools.accumulate(batch.lens)
            fed = [(rid, out.hidden_TLH[end - n:end]) for rid, n, end in zip(rids, batch.lens, ends)]
            self.proposer.observe_fed(fed)
        if on_device is not None:  # the verify step is queued: the drafts' copy ran before it
            drafts = dict(zip(rids, read_drafts()))
        news = accept_each(out.logits_TV, [drafts[rid] for rid in rids], [live[rid].sp for rid in rids],
                           [live[rid].gen for rid in rids], batch.lens)
        kept, offset, observed, kept_rows = {}, 0, [], []
        for b, rid in enumerate(rids):
            d, new, r = drafts[rid], news[b], live[rid]
            cut = next((i + 1 for i, t in enumerate(new) if t in r.stops), len(new))
            new = new[:cut]  # the drafts kept, then one token of the target's own (or up to a stop)
            r.tokens += new
            r.accept_lengths.append(len(new))
            for tally in (self._spec_last, self._spec_total):
                tally.record(len(d), len(new))
            kept_rows += range(offset, offset + len(new))
            if out.routed_experts_TLK is not None:
                r.experts.append(out.routed_experts_TLK[offset:offset + len(new)])
            kept[rid] = len(new)
            lengths[rid] += len(new)  # the fed tokens whose KV stays: the last one and the accepted drafts
            if fed:  # every fed row, and how many of them stay
                observed.append((rid, fed[b][1], len(new)))
            offset += batch.lens[b]  # its last token, its drafts and any past its cut
        self._spec_last.steps += 1
        self._spec_total.steps += 1
        if logprobs:  # every kept token's log-prob in one gather and one copy to the host
            rows = torch.tensor(kept_rows, device=out.logits_TV.device)
            toks = torch.tensor([t for rid in rids for t in live[rid].tokens[-kept[rid]:]], device=rows.device)
            lp = iter(token_logprobs(out.logits_TV[rows], toks).tolist())
            for rid in rids:
                live[rid].logprobs += [next(lp) for _ in range(kept[rid])]
        if observed:
            self.proposer.observe_verified(observed)
        self._propose_ahead(rids)
        self.state = truncate(self.state, lengths)
        return kept

    def _spec_asks(self, rids) -> list[tuple[int, JoinedTokens, int]]:
        """(rid, its tokens, drafts it has room for: the bonus token needs one) per request."""
        live = self._live
        return [(rid, JoinedTokens(live[rid].prompt, live[rid].tokens),
                 min(self.config.num_draft_tokens, live[rid].max_new - len(live[rid].tokens) - 1)) for rid in rids]

    def _propose_ahead(self, rids) -> None:
        """Queue the next verify step's drafts on the device now, where every request goes on with
        the same k (propose_device), for _spec_pass to take if the next pass verifies the same
        requests at the same lengths. The GPU drafts while the host finishes this pass and plans
        the next (the truncation, the scheduler, the verify step's metadata), work it otherwise
        waited for. Idempotent for the proposer: a taken-over pass just proposes again."""
        live = self._live
        if any(live[rid].tokens[-1] in live[rid].stops for rid in rids):
            return
        asks = self._spec_asks(rids)
        if len({k for *_, k in asks}) != 1 or asks[0][2] <= 0:
            return
        drafts = self.proposer.propose_device(asks)
        if drafts is not None:
            self._ahead = (_ask_key(asks), drafts)

    def _device_drafts(self, rids, proposed, room: int):
        """(the verify batch: each request's last token, then its row of drafts_RJ, the proposer's
        drafts still on the device; a function that returns those rows as lists). Their copy to
        the host is queued before the verify step, so reading them waits for the draft model
        only, while the verify step runs. proposed: drafts_RJ, or (drafts_RJ, n_R) with a
        confidence cut (Proposer.propose_device): the rows past n_R[r] route to no expert
        (Batch.moe_rows_T) and the lists end at the cut."""
        drafts_RJ, n_R = proposed if isinstance(proposed, tuple) else (proposed, None)
        num, width = drafts_RJ.shape if drafts_RJ.dim() == 2 else (-1, -1)
        if num != len(rids) or not 0 < width <= room or drafts_RJ.dtype != torch.long:
            raise ValueError(f"generate: the proposer's propose_device returned {drafts_RJ.dtype} "
                             f"{list(drafts_RJ.shape)}; expected int64 [{len(rids)}, 1 .. {room}]")
        if n_R is not None and (n_R.shape != (num,) or n_R.dtype != torch.long):
            raise ValueError(f"generate: the proposer's propose_device returned counts {n_R.dtype} "
                             f"{list(n_R.shape)}; expected int64 [{num}]")
        dev = drafts_RJ.device
        last_R1 = upload([torch.tensor([[self._live[rid].tokens[-1]] for rid in rids])], dev)[0]
        rows_T = None if n_R is None else \
            (torch.arange(width + 1, device=dev)[None, :] <= n_R[:, None]).view(-1)  # the last token, n drafts
        batch = Batch(tuple(rids), torch.cat([last_R1, drafts_RJ], dim=1).view(-1), (width + 1,) * num,
                      sampled=True, moe_rows_T=rows_T)
        both_RW = drafts_RJ if n_R is None else torch.cat([drafts_RJ, n_R[:, None]], dim=1)  # one copy
        if dev.type != "cuda":
            return batch, lambda: _cut(both_RW.tolist(), n_R is not None)
        host_RW = torch.empty(both_RW.shape, dtype=torch.long, pin_memory=True)
        host_RW.copy_(both_RW, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

        def read() -> list[list[int]]:
            ready.synchronize()
            return _cut(host_RW.tolist(), n_R is not None)
        return batch, read

    @staticmethod
    def _is_done(r: Live) -> bool:
        r.done = r.done or bool(r.tokens) and (len(r.tokens) >= r.max_new or r.tokens[-1] in r.stops)
        return r.done

    def _launch_decode(self, rids, last: Launched | None) -> Launched:
        """Queue a decode step and its sampling without waiting for the GPU. Each request feeds
        its last token: from `last` (the step before, whose tokens are not read yet) on the device
        when given, which then holds every rid, else from the host."""
        live = self._live
        if last is None:
            batch = Batch.from_tokens(list(rids), [[live[r].tokens[-1]] for r in rids])
        else:
            tokens_T = last.next_B
            if tuple(rids) != last.rids:  # requests retired since: pick the rest's rows
                row = {rid: b for b, rid in enumerate(last.rids)}
                index_B = upload([torch.tensor([row[rid] for rid in rids])], tokens_T.device)[0]
                tokens_T = tokens_T[index_B]
            batch = Batch(tuple(rids), tokens_T, (1,) * len(rids), sampled=True)
        logprobs, experts = self._wants(rids)
        self.state, out = decode(self.state, batch, capture_experts=experts, graphs=self.graphs)
        next_B = sample_each(out.logits_BV, [live[r].sp for r in rids], [live[r].gen for r in rids])
        lp_B = token_logprobs(out.logits_BV, next_B) if logprobs else None
        ready = None
        if next_B.is_cuda:  # into pinned host memory, read once `ready` has passed
            host = (next_B.to("cpu", non_blocking=True), None if lp_B is None else lp_B.to("cpu", non_blocking=True))
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = (next_B, lp_B)
        return Launched(tuple(rids), next_B, host, out.routed_experts_TLK, ready)

    def _read_back(self, step: Launched) -> set[int]:
        """Wait for a launched step's tokens and hand them to its requests, except those done
        before it (an overlapped step ran them once more). Returns the rids it finished."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.host[0].tolist()
        lps = step.host[1].tolist() if step.host[1] is not None else None
        finished = set()
        for b, rid in enumerate(step.rids):
            r = self._live.get(rid)
            if r is None or r.done:  # aborted, or done before this step
                continue
            r.tokens.append(tokens[b])
            if lps is not None:
                r.logprobs.append(lps[b])
            if step.experts_BLK is not None:
                r.experts.append(step.experts_BLK[b:b + 1])
            if self._is_done(r):
                finished.add(rid)
        return finished

    # the prefix cache's side (mimo_fn.engine.prefix_cache: what entries hold and where they fork)

    def _keep_finished(self, rids) -> None:
        """Finished requests: keep each as an entry, its sequence cut back to the tokens that have K/V
        (an overlapped decode step may have written one more), or release it."""
        cache, gone, in_use = self.prefix_cache, [], set(self._copies.held.values())
        for rid in rids:
            r = self._live[rid]
            tokens = r.prompt + r.tokens
            n = min(len(tokens) - 1, self.state.seqs[rid].length)
            try:
                if n < self.state.seqs[rid].length:
                    self.state = truncate(self.state, {rid: n})
            except ValueError:  # (its last page is shared: not kept)
                gone.append(rid)
                continue
            gone += cache.add(rid, tokens[:n + 1], *entry_outputs(self.cfg, r, n), in_use,
                              forks=fork_ranges(self.state.cache, self.state.seqs[rid]))
        self._release(gone)

    def _keep_prompt_ends(self, run, sources) -> None:
        """With a bounded sliding-window pool, the requests whose prompts a prefill pass finished
        (its run chunks, and the copies it forked: sources) keep the window at their prompt's end
        (model.keep_swa), where the same prompt again forks their entries."""
        if self.prefix_cache.swa_slack is None:  # every page is kept anyway
            return
        live = self._live
        ends = {c.rid: len(live[c.rid].prompt) - 1 for c in run
                if live[c.rid].max_new and c.start + c.num_tokens == len(live[c.rid].prompt)}
        ends.update((dst, len(live[dst].prompt) - 1) for dst in sources)
        ends = {rid: n for rid, n in ends.items() if n >= self.config.page_size}
        if ends:
            self.state = keep_swa(self.state, ends)

    def _make_room(self, st) -> bool:
        """The KV pool lacks what the first waiting request of scheduler state st needs: let entries
        go, least recently used first, none held for requests in flight, until it fits as the adder
        counts it, or none is left. Returns whether any went."""
        page, cfg, went = self.config.page_size, self.sched_config, False
        first = order_waiting(st.waiting, cfg.policy)[0]
        need = first.footprint_tokens(page)
        if first.prefix_key in dict(st.held) and cfg.copies_share_pages:  # its prefix's pages held in common
            need -= first.prefix_len // page * page
        in_use = set(self._copies.held.values())
        while self._free_pages() * page - reserved_tokens(st, cfg) < need:
            seq = self.prefix_cache.least_recent(in_use)
            if seq is None:
                break
            self.prefix_cache.drop(seq)
            self._release([seq])
            went = True
        return went
