"""SchedulerConfig: the budgets and knobs of the prefill scheduler, validated once.

Legend: lengths in tokens; "rank" is a DP rank (one scheduler per DP rank, all in
lockstep); "pass" is one scheduling iteration = one forward step of the engine.

Every rank must use an identical config: the delayer's decision is computed on every
rank from the gathered records and must come out the same everywhere.
"""

from dataclasses import dataclass, fields

POLICIES = ("fcfs", "lof")


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # KV pool size of one rank, in pages (the full-attention pool binds)
    page_size: int = 128  # tokens per KV page (= mimo_fn.cache.DEFAULT_PAGE_SIZE); chunk boundaries are multiples of it
    dp_size: int = 1  # DP attention ranks; the global chunk is split across them
    # Global chunk budget per pass, split evenly: rank chunk = chunk_size // dp_size, so
    # a DP group's prefill pass stays as long as one rank's pass at DP1.
    chunk_size: int = 32768
    max_prefill_tokens: int = 65536  # input tokens one rank prefills in one pass
    max_running_requests: int = 256  # slots per rank: running + chunked + admitted
    policy: str = "fcfs"  # waiting-queue order; only fcfs guarantees no starvation
    # Delayer: a pass may be delayed at most this many times in a row (0 disables it).
    max_delay_passes: int = 100
    # Force prefill when a prefillable rank's KV usage (used / total pages) is below
    # this: its GPU is mostly empty, so holding prefill back wastes it. None = off.
    token_usage_low_watermark: float | None = None
    # When every rank could prefill but each would admit a small batch while busy
    # decoding, wait (same max_delay_passes bound) for more arrivals to batch together.
    wait_for_fuller_batch: bool = True
    recent_window: int = 8  # prefill passes remembered for "recent max prefill batch size"
    # a copy of a prompt (adder rule 5) holds the prompt's filled pages in common with its
    # source, so admitting it reserves only the rest of its footprint (the engine's KV pools
    # share them: cache.fork); False charges a copy its whole footprint
    copies_share_pages: bool = True
    # once a prompt's copies are left waiting by the pass that finishes it, the engine holds its
    # K/V (a sequence of its own) so that they copy it later too, after the source has decoded
    # (adder rule 5); False: a copy that finds no undecoded source runs the prompt again. (Prefix
    # requests, rule 6, are held whatever this says: whoever submits them asks for it.)
    hold_prompts: bool = True

    def __post_init__(self):
        _at_least("num_pages", self.num_pages, 1)
        _at_least("page_size", self.page_size, 1)
        _at_least("dp_size", self.dp_size, 1)
        _at_least("max_prefill_tokens", self.max_prefill_tokens, self.page_size)
        _at_least("max_running_requests", self.max_running_requests, 1)
        _at_least("max_delay_passes", self.max_delay_passes, 0)
        _at_least("recent_window", self.recent_window, 1)
        if self.chunk_size // self.dp_size < self.page_size:
            raise ValueError(
                f"SchedulerConfig.chunk_size // dp_size must be >= page_size={self.page_size} "
                f"(a chunk must hold at least one page), got chunk_size={self.chunk_size}, "
                f"dp_size={self.dp_size}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        w = self.token_usage_low_watermark
        if w is not None and not 0.0 < w <= 1.0:
            raise ValueError(f"SchedulerConfig.token_usage_low_watermark must be in (0, 1], got {w}")

    @property
    def rank_chunk_size(self) -> int:
        return self.chunk_size // self.dp_size

    @property
    def pass_token_limit(self) -> int:
        """Input tokens one rank may prefill in one pass: both budgets at once."""
        return min(self.rank_chunk_size, self.max_prefill_tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"SchedulerConfig.{name} must be >= {low}, got {value}")


def check_overrides(overrides: dict, owned: dict[str, str], where: str) -> None:
    """A ValueError for a key of `overrides` (extra SchedulerConfig fields from `where`) that is
    no field, or that `owned` maps to the setting that sets it instead."""
    names = {f.name for f in fields(SchedulerConfig)}
    for key in overrides:
        if key in owned:
            raise ValueError(f"{where}[{key!r}]: set by {owned[key]}; set it there")
        if key not in names:
            raise ValueError(f"{where}[{key!r}]: not a SchedulerConfig field; expected one of "
                             f"{sorted(names - set(owned))}")
