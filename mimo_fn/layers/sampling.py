"""Token sampling (greedy, temperature, top-k, top-p) and log-probs.

Legend: B sequences, V vocab, T tokens.

Randomness comes only from explicit generators, one per sequence, so a sequence's tokens
depend on its seed and its logits, never on which other sequences share the batch.
Sampling inverts the CDF: one uniform u per row from the row's (host) generator, and the
token is the first whose cumulative probability (fp64, on the logits' device) exceeds u times
the row's total. One host draw per row and step: an exponential race over the vocabulary
(argmax p / q, q ~ Exp(1)) needs V draws per row, ~155 ms a step on the host for 64 rows of
152,576 (docs/benchmarks.md), several times a decode step on an H200.
Each sequence may sample under its own SamplingParams (`sample_each`): rows that share a
distribution are filtered together, so a row's token is the same whatever else shares the batch.
Log-probs are log_softmax of the raw logits (temperature 1), the quantity RL trainers compare.
"""

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mimo_fn._types import Float, Int, Tensor, typed
from mimo_fn.upload import upload


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 = no limit
    top_p: float = 1.0  # nucleus mass kept
    seed: int = 0  # sequence i of a generate call draws from seed + i

    def __post_init__(self) -> None:
        for name, kind, what in (("temperature", numbers.Real, "a number"), ("top_k", numbers.Integral, "an int"),
                                 ("top_p", numbers.Real, "a number"), ("seed", numbers.Integral, "an int")):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):  # else a TypeError mid-generate
                raise ValueError(f"SamplingParams.{name} = {value!r}: expected {what}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature = {self.temperature}: expected >= 0")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k = {self.top_k}: expected >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p = {self.top_p}: expected in (0, 1]")


@typed
def filtered_probs(logits_BV: Float[Tensor, "B V"], sp: SamplingParams) -> Float[Tensor, "B V"]:
    """The distribution `sample` draws from: temperature, then top-k, then top-p (unnormalised
    after top-p: `sample_probs` scales by each row's total)."""
    logits_BV = logits_BV.float() / sp.temperature
    if sp.top_k and sp.top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(sp.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    if sp.top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        mass_before_BV = sorted_BV.cumsum(-1) - sorted_BV  # keep a token if the mass before it < top_p
        sorted_BV = sorted_BV.masked_fill(mass_before_BV >= sp.top_p, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return probs_BV


@typed
def sample(
    logits_BV: Float[Tensor, "B V"], sp: SamplingParams | None, generators: list[torch.Generator] | None = None
) -> Int[Tensor, " B"]:
    """Next tokens; sp None or temperature 0 is greedy. One generator per row when sampling."""
    if sp is None or sp.temperature == 0:
        return logits_BV.argmax(-1)
    if generators is None or len(generators) != logits_BV.shape[0]:
        raise ValueError(f"sample: need one generator per sequence ({logits_BV.shape[0]}), got "
                         f"{None if generators is None else len(generators)}")
    return sample_probs(filtered_probs(logits_BV, sp), generators)


def per_request(sampling, n: int, what: str = "generate") -> list[SamplingParams | None]:
    """`sampling` as one entry per request (None = greedy): None or one SamplingParams for all
    n, or a sequence of n entries, each a SamplingParams or None. A ValueError names a bad one."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling] * n
    if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
        raise ValueError(f"{what}: sampling = {sampling!r}; expected None (greedy), a SamplingParams, or one "
                         "per prompt")
    sps = list(sampling)
    if len(sps) != n:
        raise ValueError(f"{what}: {len(sps)} sampling params for {n} prompts; give one per prompt, or one for all")
    bad = next((i for i, sp in enumerate(sps) if sp is not None and not isinstance(sp, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"{what}: sampling[{bad}] = {sps[bad]!r}; expected a SamplingParams or None (greedy)")
    return sps


def distribution_groups(sps: Sequence[SamplingParams | None]) -> dict[tuple | None, list[int]]:
    """The rows of each distinct distribution, in first-seen order: key None for greedy rows (None
    or temperature 0), else (temperature, top_k, top_p); the seed only picks the generators."""
    groups: dict[tuple | None, list[int]] = {}
    for b, sp in enumerate(sps):
        key = None if sp is None or sp.temperature == 0 else (sp.temperature, sp.top_k, sp.top_p)
        groups.setdefault(key, []).append(b)
    return groups


@typed
def sample_each(
    logits_BV: Float[Tensor, "B V"], sps: Sequence[SamplingParams | None], generators: list[torch.Generator]
) -> Int[Tensor, " B"]:
    """Next tokens, row b under sps[b] (None or temperature 0: greedy) with generators[b]: each
    row's token is the one `sample` gives it alone. No host sync (the row indices are uploaded)."""
    if len(sps) != logits_BV.shape[0]:
        raise ValueError(f"sample_each: {len(sps)} sampling params for {logits_BV.shape[0]} rows")
    sps = list(sps)
    if sps.count(sps[0]) == len(sps):  # one params for all, the usual call: a C loop, no per-row Python
        return sample(logits_BV, sps[0], generators)
    groups = distribution_groups(sps)
    if len(groups) == 1:  # equal but for the seeds
        return sample(logits_BV, sps[0], generators)
    index = upload([torch.tensor(rows) for rows in groups.values()], logits_BV.device)
    next_B = torch.empty(logits_BV.shape[0], dtype=torch.long, device=logits_BV.device)
    for rows, index_R in zip(groups.values(), index):
        next_B[index_R] = sample(logits_BV[index_R], sps[rows[0]], [generators[b] for b in rows])
    return next_B


@typed
def sample_probs(probs_BV: Float[Tensor, "B V"], generators: list[torch.Generator]) -> Int[Tensor, " B"]:
    """One draw from each row's (possibly unnormalised) distribution, by inverting its CDF."""
    # one uniform per row from its own host generator: batch-independent, the same draw on any device
    # (copied without waiting for the GPU: EngineConfig.overlap samples while a step still runs)
    u_B = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    u_B = upload([u_B], probs_BV.device)[0]
    cdf_BV = probs_BV.double().cumsum(-1)  # fp64: over 152K fp32 partial sums, rounding could reach ~1e-2
    target_B1 = (u_B * cdf_BV[:, -1])[:, None]
    # the first token whose cumulative mass exceeds the target: zero-probability tokens never qualify
    return torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1).clamp_max(probs_BV.shape[-1] - 1)


@typed
def token_logprobs(logits_TV: Float[Tensor, "T V"], tokens_T: Int[Tensor, " T"]) -> Float[Tensor, " T"]:
    """log p(tokens[t] | logits[t]) under log_softmax of the raw logits, in fp32."""
    return torch.log_softmax(logits_TV.float(), dim=-1).gather(-1, tokens_T[:, None]).squeeze(-1)
