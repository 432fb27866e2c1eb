"""EngineConfig: what an Engine is built with (mimo_fn.engine runs it)."""

import numbers
from dataclasses import dataclass, field

from mimo_fn import sched
from mimo_fn.cache import DEFAULT_PAGE_SIZE
from mimo_fn.speculative.build import check_name


# SchedulerConfig fields the Engine sets from its own config (EngineConfig.scheduler may not)
_SCHED_OWNED = {k: f"EngineConfig.{v}" for k, v in (
    ("num_pages", "max_tokens"), ("page_size", "page_size"), ("chunk_size", "chunk_size"),
    ("max_prefill_tokens", "chunk_size"), ("max_running_requests", "max_batch"),
    ("max_delay_passes", "max_delay_passes"), ("dp_size", "chunk_size"),  # dp_size: chunk_size is per DP group
    ("copies_share_pages", "share_prompts"), ("hold_prompts", "share_prompts"))}


@dataclass(frozen=True)
class EngineConfig:
    max_tokens: int  # tokens the full-attention KV pool holds, all sequences together
    page_size: int = DEFAULT_PAGE_SIZE  # tokens per KV page (mimo_fn.cache explains the choice)
    # sliding-window pool size; None = max_tokens. A smaller pool also caps the requests in flight:
    # each holds its last window of it, and a prefill pass a chunk more (mimo_fn.cache.swa_seq_limit)
    max_swa_tokens: int | None = None
    chunk_size: int = 16384  # prefill tokens per pass (the scheduler's chunk budget)
    max_batch: int = 256  # most requests in flight at once
    max_delay_passes: int = 100  # PrefillDelayer bound (matters with DP > 1)
    progress: bool = False  # progress bar over passes
    scheduler: dict = field(default_factory=dict)  # extra SchedulerConfig fields
    # speculative decoding: each decode step verifies up to this many draft tokens per request
    # in one target step (greedy or sampled; see Engine._spec_pass); 0 = off. Drafts come from
    # `proposer`: a name, "ngram" (prompt lookup, as None), "dflash" (a DFlash draft model) or "mtp"
    # (the checkpoint's MTP layers), whose weights are read from `draft_path`
    # (mimo_fn.speculative.build), or any object with propose(rid, tokens, k) -> list[int]
    # (mimo_fn.speculative.proposer describes the protocol), e.g. a DFlashProposer built by hand
    num_draft_tokens: int = 0
    proposer: object = None
    draft_path: str | None = None  # a named proposer's weights: a DFlash draft dir, or a checkpoint dir with MTP layers
    # proposer "dflash" / "mtp": verify each request's drafts only while the draft's own estimate that all
    # of them are right stays >= this (mimo_fn.speculative.draft_cut); 0 verifies every draft
    draft_min_confidence: float = 0.0
    # decode and speculative verify steps replay CUDA graphs, one per batch shape (mimo_fn.graphs),
    # on CUDA (on a mesh too, with its "gather" EP dispatch); False: every step launches its
    # kernels from Python
    cuda_graphs: bool = True
    # overlap the host's work for the next decode step with the GPU's current one: a decode
    # step is launched before the tokens of the step before are read back (they feed it on the
    # device), so scheduling, pages and step metadata run while the GPU computes. A request
    # that draws a stop token then runs one step more, whose token is dropped. Plain decode
    # steps only (prefill passes and speculative steps read their tokens at once)
    overlap: bool = True
    # identical prompts of one generate call (n samples of a prompt, as GRPO draws) are prefilled
    # once: the scheduler admits a copy once one of them holds the whole prompt and has decoded
    # nothing, or while the engine holds the prompt for copies still waiting, and the copy takes
    # its K/V (model.fork: the prompt's pages, held in common) and outputs instead of running
    # (sched.adder, rule 5; mimo_fn.engine.prompt_copies); prompts that begin with the same whole pages
    # fork them from a prefix prefilled once (rule 6: fcfs policy, unbounded SWA pool). False runs
    # every prompt
    share_prompts: bool = True
    # release_memory keeps the addresses of the weights and KV pools (CUDA virtual memory through
    # the torch_memory_saver package; mimo_fn.rl.vmm): the decode CUDA graphs stay valid across a
    # release of "weights" / "kv_cache" instead of being captured again. CUDA only
    memory_saver: bool = False
    # release_memory_occupation (SGLang's name) keeps the weights' bytes in host memory, so the
    # resumed weights are the old ones; without, every weight must be written again after the
    # resume (update_weights_*), as a trainer that pushes new weights each step does anyway.
    # SGLang's --enable-weights-cpu-backup
    weights_cpu_backup: bool = False
    # keep each finished request's K/V across generate calls: a later prompt that begins with some
    # of its tokens forks them (a multi-turn rollout's next turn, a shared system prompt;
    # mimo_fn.engine.prefix_cache). Off by default: a hit changes a prompt's steps, so a repeated call
    # can round differently. With a bounded SWA pool (max_swa_tokens) an entry keeps the SWA pages
    # of its last window and of its prompt's end and forks only there (a turn continuing it, the
    # same prompt again), and the pool is split between requests in flight and entries. A proposer
    # that reads hidden states (DFlashProposer) needs fork(sources, upto) and forget(rid): an entry
    # keeps its state too
    prefix_cache: bool = False
    # every step runs kernels whose tiling and reduction order follow the model's fixed dims, never
    # the tokens in the step, the chunk boundaries or the sequences beside a request: a request's
    # tokens and log-probs are then the same bits alone or in any batch, chunked any way, forked
    # from a shared prompt or a prefix cache entry, with speculative decoding on or off, and
    # forward(..., deterministic=True) gives them too. Costs speed (docs/deterministic.md says
    # where, and what stays outside: another TP / EP layout sums in another order). SGLang's
    # --enable-deterministic-inference
    deterministic: bool = False

    def __post_init__(self) -> None:
        for name, low in (("max_tokens", 1), ("page_size", 1), ("chunk_size", 1), ("max_batch", 1),
                          ("max_delay_passes", 0), ("num_draft_tokens", 0), ("max_swa_tokens", 1)):
            value = getattr(self, name)
            if (value is not None or name != "max_swa_tokens") and (
                    not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low):
                raise ValueError(f"EngineConfig.{name} = {value!r}: expected an int >= {low}"
                                 + (" or None (as large as max_tokens)" if name == "max_swa_tokens" else ""))
        if self.chunk_size < self.page_size:
            raise ValueError(f"EngineConfig.chunk_size = {self.chunk_size} is smaller than page_size = "
                             f"{self.page_size}: a prefill chunk must hold at least one page")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"EngineConfig.deterministic = {self.deterministic!r}: expected True or False")
        sched.check_overrides(self.scheduler, _SCHED_OWNED, "EngineConfig.scheduler")
        if isinstance(self.proposer, str):
            check_name(self.proposer, self.draft_path, "EngineConfig.proposer", self.draft_min_confidence)
        elif self.draft_min_confidence:
            raise ValueError(f"EngineConfig.draft_min_confidence = {self.draft_min_confidence!r} applies to "
                             f"proposer='dflash' or 'mtp', not {type(self.proposer).__name__}; a DFlashProposer or "
                             "MTPProposer object brings its own (min_confidence=...)")
        elif self.proposer is not None and not callable(getattr(self.proposer, "propose", None)):
            raise ValueError(f"EngineConfig.proposer: {type(self.proposer).__name__} has no propose(rid, tokens, k) "
                             "method")
        if self.proposer not in (None, "ngram") and self.num_draft_tokens == 0:  # its weights would load unused
            name = self.proposer if isinstance(self.proposer, str) else type(self.proposer).__name__
            raise ValueError(f"EngineConfig.proposer = {name} with num_draft_tokens = 0 (speculation off): expected "
                             "num_draft_tokens = k > 0, the drafts a verify step checks (a DFlash draft's block_size "
                             "- 1, an MTP proposer's layers)")
