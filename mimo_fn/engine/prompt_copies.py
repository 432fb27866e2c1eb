"""Identical prompts of one generate call, and prompts that begin alike, prefilled once
(EngineConfig.share_prompts): the engine's side of the scheduler's rules 5 and 6
(mimo_fn.sched.adder).

Requests with equal prompts share a sched prompt_key. The scheduler admits a copy once some
request, its source, holds the whole prompt's K/V; the engine forks it (model.fork) and the copy
takes the source's outputs for the prompt. Where copies are left waiting, the scheduler asks the
engine to hold the prompt: a sequence of its own, forked from the source before the source
decodes, which later copies fork instead, and which goes once no copy waits. PromptCopies is the
engine's record: which requests share a prompt, and the held prompts' sequences.

Distinct prompts that begin with the same whole pages of tokens (a system prompt, a long shared
document) form a prefix group (shared_prefixes): the engine adds a request for the prefix
alone, which the scheduler prefills and then holds, and each prompt of the group forks its K/V
and prefills only the rest. One level: a group's prefix is what all its prompts share.
"""

from collections import Counter

import torch

from mimo_fn.layers.sampling import token_logprobs


def prompt_keys(args, first: int, enabled: bool) -> list[int]:
    """Each prompt's sched.Request.prompt_key: the rid of the call's first prompt equal to it where
    the call holds it more than once, else -1 (every one -1 unless enabled). args: GenerateArgs."""
    if not enabled:
        return [-1] * len(args.prompts)
    firsts = args.first_copies()
    count = Counter(firsts)
    return [first + j if count[j] > 1 else -1 for j in firsts]


def shared_prefixes(prompts: list[list[int]], keys: list[int], first: int, page: int) -> list[tuple[int, list[int]]]:
    """Groups of prompts that begin with the same tokens, at least one page of them: per group, the
    prefix length (whole pages, shorter than each of its prompts) and the indices of its prompts
    (with their copies, which share their source's prompt_key). Adjacent in sorted order, two
    distinct prompts that share a page join one group; its prefix is what they all share."""
    distinct = sorted((i for i, k in enumerate(keys) if k < 0 or k == first + i), key=lambda i: prompts[i])
    runs, run, shared = [], distinct[:1], None
    for a, b in zip(distinct, distinct[1:]):
        n = _common_len(prompts[a], prompts[b], page)
        if n >= page:
            run, shared = run + [b], n if shared is None else min(shared, n)
            continue
        runs.append((run, shared))
        run, shared = [b], None
    runs.append((run, shared))
    group_of = {}  # the index of a distinct prompt -> its group
    groups = []
    for run, shared in runs:
        length = min([shared or 0] + [len(prompts[i]) - 1 for i in run]) // page * page
        if len(run) > 1 and length >= page:
            group_of.update(dict.fromkeys(run, len(groups)))
            groups.append((length, []))
    for i, k in enumerate(keys):
        g = group_of.get(i if k < 0 else k - first)
        if g is not None:
            groups[g][1].append(i)
    return groups


def _common_len(a: list[int], b: list[int], page: int) -> int:
    """How many tokens a and b begin with alike, 0 if not a whole page (a binary search over
    C-level slice compares; most pairs differ within the first page and cost one)."""
    if a[:page] != b[:page]:
        return 0
    lo, hi = page, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo


class PromptCopies:
    """Which requests share a prompt (within the cohort that admitted them), and the held
    prompts' sequences."""

    def __init__(self):
        self.key: dict[int, int] = {}  # rid -> prompt key (-1: no copies)
        self.members: dict[int, list[int]] = {}  # prompt key -> its requests
        self.held: dict[int, int] = {}  # prompt key -> the sequence that holds its K/V for copies to come

    def add(self, keys: list[int], first: int) -> None:
        """Requests first, first + 1, ... with prompt_keys keys."""
        for i, k in enumerate(keys):
            self.key[first + i] = k
            if k >= 0:
                self.members.setdefault(k, []).append(first + i)

    def remove(self, rid: int) -> None:
        """A request of a cohort that has ended."""
        k = self.key.pop(rid, -1)
        if k >= 0 and k in self.members:
            self.members[k].remove(rid)
            if not self.members[k]:
                del self.members[k]

    def kv_source(self, src: int) -> int:
        """The sequence a copy of request src's prompt forks: the held prompt's, else src's own."""
        return self.held.get(self.key[src], src)

    @staticmethod
    def take_outputs(dst, src) -> None:
        """Copy dst takes its source src's outputs for the prompt (both engine._Live): the prompt's
        log-probs, its tokens' routed experts (those of src's decode steps cut off) and the
        logits after it, which dst's first token is drawn from."""
        dst.prompt_logprobs, dst.last_logits = list(src.prompt_logprobs), src.last_logits
        decoded = len(src.tokens) > 1 and src.experts
        dst.experts = [torch.cat(src.experts)[:len(src.prompt)]] if decoded else list(src.experts)

    @staticmethod
    def take_prefix(dst, prefix, n: int, return_logprobs: bool) -> None:
        """dst, whose prompt begins with the first n tokens of the held prefix's (both engine._Live),
        takes its outputs for them: their routed experts and log-probs, and the log-prob of dst's
        token n from the logits after the prefix, where n is all of it. A prefix cache entry keeps
        no logits, and the log-probs it brings reach one token past its K/V (mimo_fn.engine.prefix_cache)."""
        dst.experts = [torch.cat(prefix.experts)[:n]] if prefix.experts else []
        if return_logprobs and prefix.last_logits is None:
            dst.prompt_logprobs = prefix.prompt_logprobs[:n]
        elif return_logprobs:
            nxt = torch.tensor([dst.prompt[n]], device=prefix.last_logits.device)
            dst.prompt_logprobs = prefix.prompt_logprobs + token_logprobs(prefix.last_logits[None], nxt).tolist()

    def drop_logits(self, rids, live) -> None:
        """Free the kept logits of the prompts of rids that no copy waits for any more."""
        for k in {self.key.get(rid, -1) for rid in rids} - {-1}:  # a prefix's rid has no key
            if all(live[rid].tokens for rid in self.members[k]):
                for rid in self.members[k]:
                    live[rid].last_logits = None
