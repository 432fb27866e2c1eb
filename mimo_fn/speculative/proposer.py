"""The Proposer protocol: what the engine asks of a draft source for speculative decoding.

The engine calls, per verify step, `propose_many([(rid, tokens, k)])` (each: at most k draft
tokens to follow request rid's `tokens`, a `JoinedTokens` view of its prompt and generated
tokens), or first `propose_device` (the same drafts left on the GPU) where every k is the same;
a proposer that reads the target's hidden states names the layers in `target_layers` and gets
them for every token whose K/V stays (`observe_many` after a prompt chunk,
`observe_verified` after a verify step: every fed row and how many stay, the rows already
handed to `observe_fed` while the verify step still ran). Per-request state
follows the engine's sequences: `fork({dst: src}, upto)` when a request takes another's K/V
(identical prompts, a held prefix, a prefix cache entry: all of src's state, or that of its first
upto[dst] tokens), `forget(rid)` when the engine releases a sequence. A draft model's memory goes
with the engine's release_memory (`weight_tensors`, `kv_cache_tensors`, `clear_graphs`).

Every method has a default: a stateless proposer (prompt lookup, an oracle in a test) writes only
`propose`. The engine verifies every draft against the target, so a proposer changes the speed of
decoding, not greedy decoding's tokens (up to rounding) nor the distribution of sampled ones.
"""

import abc
from collections.abc import Mapping, Sequence

import torch


class Proposer(abc.ABC):
    target_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (none: it reads tokens)
    # fork() gives a copy its source's state: prompt sharing and the prefix cache may fork requests
    # (trivially so for a proposer that keeps nothing per request)
    can_fork: bool = True
    can_forget: bool = True  # forget() drops what it keeps of a request (the prefix cache relies on it)
    has_graphs: bool = False  # clear_graphs() drops CUDA graphs of its own (a draft model's)

    @abc.abstractmethod
    def propose(self, rid: int, tokens: Sequence[int], k: int) -> list[int]:
        """At most k draft tokens to follow request rid's tokens."""

    def propose_many(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """Every request's drafts of one step (a batched draft model overrides it)."""
        return [self.propose(rid, tokens, k) if k > 0 else [] for rid, tokens, k in asks]

    def propose_device(self, asks: Sequence[tuple[int, Sequence[int], int]]
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The drafts of asks that all want the same k > 0, as an int64 tensor [R, J] (J <= k) on
        the model's device, queued and not waited for: the engine queues the verify step behind
        them and reads them on the host while it runs, one wait fewer a step. Ids must lie in
        [0, V): the verify step feeds them unchecked (as it does sampled tokens). Or a pair
        (drafts [R, J], n_R int64 [R] in [0, J]): only row r's first n_R[r] drafts are verified,
        the others fed but routed to no expert (speculative.draft_cut). None (the default): no
        such path, the engine calls propose_many."""
        return None

    def observe(self, rid: int, hidden_TLH: torch.Tensor) -> None:
        """The hidden states [tokens, target_layers, H] of rid's next tokens whose K/V stays."""

    def observe_many(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        for rid, hidden_TLH in items:
            self.observe(rid, hidden_TLH)

    def observe_fed(self, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """A verify step's (rid, hidden states of every token it fed that request), before its
        acceptance is known; observe_verified follows with how many stay. Work queued here (a
        draft model's context rows) runs on the GPU while the host waits for the verify step."""

    def observe_verified(self, items: Sequence[tuple[int, torch.Tensor, int]]) -> None:
        """After a verify step: (rid, hidden states of every fed token, how many of them stay)."""
        self.observe_many([(rid, hidden_QLH[:kept]) for rid, hidden_QLH, kept in items])

    def fork(self, sources: Mapping[int, int], upto: Mapping[int, int] | None = None) -> None:
        """Each dst in sources starts from src's state (that of src's first upto[dst] tokens)."""

    def forget(self, rid: int) -> None:
        """The engine released rid's sequence."""

    def weight_tensors(self) -> list[torch.Tensor]:
        return []

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        return []

    def clear_graphs(self) -> None:
        pass

    @property
    def name(self) -> str:
        return type(self).__name__


class _Adapted(Proposer):
    """An object with `propose` and any of the protocol's other methods, as a Proposer."""

    def __init__(self, obj):
        self.obj = obj
        self.target_layers = tuple(getattr(obj, "target_layers", ()))
        self.can_fork = not self.target_layers or callable(getattr(obj, "fork", None))
        self.can_forget = not self.target_layers or callable(getattr(obj, "forget", None))
        for name in ("propose_many", "propose_device", "observe", "observe_many", "observe_fed", "observe_verified",
                     "fork", "forget", "weight_tensors", "kv_cache_tensors", "clear_graphs"):
            if callable(getattr(obj, name, None)):
                setattr(self, name, getattr(obj, name))
        self.has_graphs = callable(getattr(obj, "clear_graphs", None))

    def propose(self, rid, tokens, k):
        return self.obj.propose(rid, tokens, k)

    @property
    def name(self) -> str:
        return type(self.obj).__name__


def as_proposer(obj) -> Proposer:
    """obj as a Proposer (EngineConfig.proposer may be any object with propose(rid, tokens, k))."""
    if isinstance(obj, Proposer):
        return obj
    if not callable(getattr(obj, "propose", None)):
        raise ValueError(f"EngineConfig.proposer: {type(obj).__name__} has no propose(rid, tokens, k) method")
    return _Adapted(obj)
