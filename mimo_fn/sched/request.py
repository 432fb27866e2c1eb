"""A request as the scheduler sees it: lengths and progress counters, no tokens.

Legend: all lengths are in tokens; a page holds `page_size` tokens of KV.

A request goes waiting -> (chunked ->) running -> finished. `prefilled` counts the
input tokens already written to the KV cache, `generated` the decode steps done. The
scheduler reserves the request's whole footprint (input + max_new_tokens, rounded up to
whole pages) when it first admits it, so a request never has to be retracted later.
"""

from dataclasses import dataclass


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens of KV (ceil division)."""
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class Request:
    rid: int  # unique id, chosen by the caller (the engine's sequence id)
    input_len: int  # number of prompt tokens to prefill
    max_new_tokens: int  # decode steps after which the request finishes
    arrival_pass: int = 0  # pass counter when it entered the queue (stamped by submit)
    prefilled: int = 0  # input tokens already in the KV cache
    generated: int = 0  # decode steps done
    # requests with the same key (>= 0) have identical prompts: one prefills, the others copy
    # its KV (the adder's Chunk.source); -1: no copies
    prompt_key: int = -1
    # >= 0: the rid of a prefix request (below) whose tokens are this prompt's first prefix_len
    # (a multiple of page_size): once it is held, this request forks its KV and prefills only the
    # rest (the adder's Chunk.prefix); -1: none
    prefix_key: int = -1
    prefix_len: int = 0
    # a prompt prefix other requests share: prefilled, then held for them, never decoded
    prefix_only: bool = False

    def __post_init__(self):
        if self.input_len < 1:
            raise ValueError(f"Request.input_len must be >= 1, got {self.input_len} (rid {self.rid})")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"Request.max_new_tokens must be >= 1, got {self.max_new_tokens} (rid {self.rid})"
            )
        if self.prefix_key >= 0 and not 0 < self.prefix_len < self.input_len:
            raise ValueError(f"Request.prefix_len must be in (0, input_len = {self.input_len}) with a prefix_key, "
                             f"got {self.prefix_len} (rid {self.rid})")
        assert 0 <= self.prefilled <= self.input_len, self
        assert 0 <= self.generated <= self.max_new_tokens, self

    @property
    def remaining_input(self) -> int:
        return self.input_len - self.prefilled

    @property
    def is_prefilled(self) -> bool:
        return self.prefilled == self.input_len

    @property
    def is_done(self) -> bool:
        return self.generated == self.max_new_tokens

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is in the cache now."""
        return self.prefilled + self.generated

    def footprint_tokens(self, page_size: int) -> int:
        """KV the request holds at its peak, page-rounded: what admission reserves."""
        return pages_for(self.input_len + self.max_new_tokens, page_size) * page_size

    def held_tokens(self, page_size: int) -> int:
        """KV the request holds now, page-rounded (pages are allocated whole)."""
        return pages_for(self.seq_len, page_size) * page_size

    def outstanding_tokens(self, page_size: int) -> int:
        """Reserved KV not allocated yet: what its remaining chunks and decodes will take."""
        return self.footprint_tokens(page_size) - self.held_tokens(page_size)

    # The two transitions construct the next Request directly: dataclasses.replace took ~4 us a
    # call, and a decode pass makes one per running request (at 256 requests, the engine's host
    # time per step went from 1.55 to 1.36 ms: python -m mimo_fn.bench host, docs/benchmarks.md).
    def advance_prefill(self, num_tokens: int) -> "Request":
        assert 0 < num_tokens <= self.remaining_input, (self, num_tokens)
        return Request(self.rid, self.input_len, self.max_new_tokens, self.arrival_pass,
                       self.prefilled + num_tokens, self.generated, self.prompt_key, self.prefix_key,
                       self.prefix_len, self.prefix_only)

    def advance_decode(self, num_tokens: int = 1) -> "Request":
        """num_tokens > 1: a speculative step that kept several tokens."""
        assert self.is_prefilled and 0 < num_tokens <= self.max_new_tokens - self.generated, (self, num_tokens)
        return Request(self.rid, self.input_len, self.max_new_tokens, self.arrival_pass, self.prefilled,
                       self.generated + num_tokens, self.prompt_key, self.prefix_key, self.prefix_len,
                       self.prefix_only)
