"""Identical prompts of one generate call, prefilled once (EngineConfig.share_prompts): the
engine's side of the scheduler's rule 5 (mimo_fn.sched.adder).

Requests with equal prompts share a sched prompt_key. The scheduler admits a copy once some
request, its source, holds the whole prompt's K/V; the engine forks it (model.fork) and the copy
takes the source's outputs for the prompt. Where copies are left waiting, the scheduler asks the
engine to hold the prompt: a sequence of its own, forked from the source before the source
decodes, which later copies fork instead, and which goes once no copy waits. PromptCopies is the
record of one call: which requests share a prompt, and the held prompts' sequences.
"""

from collections import Counter

import torch


def prompt_keys(args, first: int, enabled: bool) -> list[int]:
    """Each prompt's sched.Request.prompt_key: the rid of the call's first prompt equal to it where
    the call holds it more than once, else -1 (every one -1 unless enabled). args: GenerateArgs."""
    if not enabled:
        return [-1] * len(args.prompts)
    firsts = args.first_copies()
    count = Counter(firsts)
    return [first + j if count[j] > 1 else -1 for j in firsts]


class PromptCopies:
    def __init__(self, keys: list[int], first: int):
        self.key = {first + i: k for i, k in enumerate(keys)}  # rid -> prompt key (-1: no copies)
        self.members: dict[int, list[int]] = {}  # prompt key -> its requests
        for rid, k in self.key.items():
            if k >= 0:
                self.members.setdefault(k, []).append(rid)
        self.held: dict[int, int] = {}  # prompt key -> the sequence that holds its K/V for copies to come

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

    def drop_logits(self, rids, live) -> None:
        """Free the kept logits of the prompts of rids that no copy waits for any more."""
        for k in {self.key[rid] for rid in rids} - {-1}:
            if all(live[rid].tokens for rid in self.members[k]):
                for rid in self.members[k]:
                    live[rid].last_logits = None
