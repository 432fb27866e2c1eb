"""A confidence cut: verify only the drafts the draft model itself believes in.

Legend: R requests, J drafts each, V the draft's vocabulary (or the target's).

On a MoE target a verify step's cost follows its rows: at small batches each fed row reads expert
weights of its own (the 8 rows of one sequence's block reach several times the experts of its one
decode row), so a draft that is rejected costs about what an accepted one does. A block draft is
often wrong from its first token on (an anchor it cannot continue), and its own probabilities
say so. With a cut p, request r verifies its first n_r drafts, n_r the number of leading positions
j whose running product of the draft's top probabilities (positions 1 .. j) is >= p: the draft's
estimate that all of them are right. The rest are still fed (the verify step keeps its one shape
and CUDA graph) but route to no expert (`Batch.moe_rows_T`) and are never kept.

The cut reads only the draft's output, not the target's, so greedy decoding keeps its tokens and
speculative sampling (accept.accept_sampled) its distribution; it only changes how many tokens a
step can keep, and the step's cost. p = 0 verifies every draft. Both drafting models take it
(`DFlashProposer` / `MTPProposer(..., min_confidence=p)`): a DFlash block from its logits, MTP's
chain from each draft's probability under its own step's logits.
"""

import torch

from mimo_fn._types import Float, Int, Tensor, typed


def check_cut(p: float, where: str) -> float:
    """p as a float in [0, 1); ValueError naming `where` otherwise."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"{where}: min_confidence {p!r}, expected a probability in [0, 1) (0: verify every draft)")
    return float(p)


@typed
def confident_drafts(logits_RJV: Float[Tensor, "R J V"], p: float) -> Int[Tensor, " R"]:
    """int64 [R]: how many leading drafts of each request to verify under the cut p (module
    docstring), from the draft's logits at block positions 1 .. J; on their device, unread."""
    top_RJ = torch.softmax(logits_RJV.float(), dim=-1).amax(dim=-1)  # the draft's belief in its argmax
    return confident_prefix(top_RJ, p)


@typed
def confident_prefix(top_RJ: Float[Tensor, "R J"], p: float) -> Int[Tensor, " R"]:
    """int64 [R]: `confident_drafts` from the drafts' own probabilities (each under its position's
    logits), where a proposer keeps those rather than the logits (MTP's chain)."""
    return (torch.cumprod(top_RJ.float(), dim=1) >= p).sum(dim=1)  # the product only falls: a prefix
