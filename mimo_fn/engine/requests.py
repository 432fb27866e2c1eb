"""What the engine keeps of a request, and what it hands back.

Live is a request's host-side progress while the engine runs it; a Cohort is the requests
admitted together (one generate call, or one add_request), which share prompts between them
(mimo_fn.engine.prompt_copies) and hold what they fork until the last of them finishes.
RequestOutput is what Engine.step reports of a request that advanced; Output the whole result.
"""

from dataclasses import dataclass, field

import torch

from mimo_fn.layers.sampling import SamplingParams


@dataclass(frozen=True)
class Output:
    tokens: list[int]  # generated tokens
    logprobs: list[float] | None = None  # log p of each generated token (raw logits)
    prompt_logprobs: list[float] | None = None  # log p of prompt tokens 1..n-1 given their prefix
    # routing replay: the experts each fed token was routed to, [prompt + generated - 1, MoE layers, K]
    routed_experts: torch.Tensor | None = None
    # "stop": the last token is a stop token; "length": max_new_tokens ran out; "abort": Engine.abort
    finish_reason: str = "length"
    # speculative decoding: the tokens each verify step gave this request (its accepted drafts
    # and the target's bonus token; a stop token may cut the last short), [] without speculation
    accept_lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RequestOutput:
    """What one Engine.step did for one request."""

    rid: int
    tokens: list[int]  # generated in this step ([] for a prefill chunk that did not end the prompt)
    logprobs: list[float] | None  # their log-probs, where the request asked for them
    finish_reason: str | None = None  # None while it runs; else Output.finish_reason
    output: Output | None = None  # once finished: the whole result, as generate returns it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Live:
    """Host-side progress of one request (or of a prefix several prompts share, or of a prefix
    cache entry forked by requests in flight)."""

    prompt: list[int]
    gen: torch.Generator
    max_new: int  # tokens to generate at most; 0: a prefix several prompts share (prompt_copies)
    sp: SamplingParams | None  # None: greedy
    copied: bool  # its cohort holds this prompt more than once (EngineConfig.share_prompts; prompt_copies)
    # the logits after the prompt, kept while copies of it may still fork from this request
    # (EngineConfig.share_prompts): their first tokens are drawn from them
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)  # int32 [tokens, MoE layers, K] per step
    done: bool = False  # drew a stop token or max_new_tokens: later tokens (an overlapped step's) are dropped
    want_logprobs: bool = False  # return_logprobs: the passes that run it compute log-probs
    want_experts: bool = False  # return_routed_experts: the passes that run it capture the routing
    stops: frozenset[int] = frozenset()  # stop token ids
    cohort: "Cohort | None" = None  # None: a prefix cache entry's record
    reported: int = 0  # tokens Engine.step has handed out
    aborted: bool = False
    accept_lengths: list[int] = field(default_factory=list)  # tokens each verify step kept

    def result(self) -> Output:
        reason = "abort" if self.aborted else "stop" if self.tokens and self.tokens[-1] in self.stops else "length"
        return Output(self.tokens, self.logprobs if self.want_logprobs else None,
                      self.prompt_logprobs if self.want_logprobs else None,
                      torch.cat(self.experts).cpu() if self.want_experts and self.experts else None, reason,
                      self.accept_lengths)


@dataclass(eq=False)
class Cohort:
    """Requests admitted together. What they fork (held prompts and prefixes, prefix cache
    entries) stays held until every one of them has finished."""

    rids: list[int]  # its requests, and its prompts' shared prefixes (max_new 0)
    entries: set[int]  # the prefix cache entries (their sequences) its requests fork
    unfinished: int  # requests (not prefixes) still running or waiting
