"""Acceptance statistics of speculative decoding: what the engine counts per verify step.

A verify step of one request feeds its last token and d drafts and keeps n tokens: the drafts
the target agreed with and one token of its own (the bonus), so 1 <= n <= d + 1; a stop token
among them cuts n short. n is the request's acceptance length for that step, as SGLang counts
it (`avg_spec_accept_length`: accepted drafts + 1, averaged over verify steps). The engine keeps
one tally for its last generate call (Engine.spec_stats()) and one since it started (the
server's /get_server_info).
"""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecTally:
    """Counts of verify steps, drafts and acceptance lengths (a running total, so mutable)."""

    steps: int = 0  # verify passes (each verifies every request of the batch once)
    verified: int = 0  # (request, verify pass) pairs
    drafted: int = 0  # draft tokens fed
    accepted: int = 0  # drafts kept (each step's kept tokens but the bonus one)
    lengths: Counter = field(default_factory=Counter)  # acceptance length -> (request, pass) pairs

    def record(self, drafted: int, kept: int) -> None:
        """One request's verify step: `drafted` drafts fed, `kept` tokens kept (bonus included)."""
        assert 1 <= kept <= drafted + 1, (drafted, kept)
        self.verified += 1
        self.drafted += drafted
        self.accepted += kept - 1
        self.lengths[kept] += 1


def summary(tally: SpecTally, num_draft_tokens: int) -> dict:
    """The tally as Engine.spec_stats() reports it: steps, verified, drafted, accepted,
    mean_accept_length (None before any verify step) and histogram {acceptance length: count}
    over every length from 1 to num_draft_tokens + 1 (or the longest seen, if longer)."""
    longest = max([num_draft_tokens + 1, *tally.lengths])
    return {
        "steps": tally.steps, "verified": tally.verified, "drafted": tally.drafted, "accepted": tally.accepted,
        "mean_accept_length": mean_accept_length(tally),
        "histogram": {n: tally.lengths.get(n, 0) for n in range(1, longest + 1)},
    }


def mean_accept_length(tally: SpecTally) -> float | None:
    """Tokens a request keeps per verify step, the bonus token included (None: no step yet)."""
    return (tally.accepted + tally.verified) / tally.verified if tally.verified else None
