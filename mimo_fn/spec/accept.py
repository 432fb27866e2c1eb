"""Speculative sampling for drafts that come without probabilities (prompt lookup, a DFlash
block draft's argmax): which drafts a verify step keeps, and the token after them.

Legend: T fed tokens of a verify step (every request's last token and its drafts), V vocab.
"""

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.layers.sampling import SamplingParams, filtered_probs, sample_probs


@typed
def accept_sampled(
    logits_TV: Float[Tensor, "T V"], drafts: list[list[int]], sampling: SamplingParams, gens: list[torch.Generator]
) -> list[list[int]]:
    """Speculative sampling with drafts that come without probabilities (a draft is sure of
    its token: q = one-hot), for every request of a verify step; request b fed its last
    token and drafts[b] as the next rows of logits_TV. Draft d at position i is kept with
    probability p_i(d), p_i the distribution `sample` draws from; the first rejected one is
    replaced by a draw from p_i with d taken out (renormalised), and when all are kept a
    draw from the next position's p follows. Each token is then distributed exactly as plain
    sampling's: P(d) = p(d), and P(x != d) = (1 - p(d)) p(x) / (1 - p(d)). Draws come from
    each request's generator (its acceptance draws, then one for the last token). The
    probabilities stay on the logits' device: the drafts' p_i(d) come to the host in one copy
    and the last tokens in another, for the whole step."""
    probs_TV = filtered_probs(logits_TV, sampling)
    probs_TV = probs_TV / probs_TV.sum(dim=-1, keepdim=True)  # top-p leaves them unnormalised
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    dev = probs_TV.device
    draft_rows = torch.tensor([s + i for s, d in zip(starts, drafts) for i in range(len(d))], dtype=torch.long)
    draft_toks = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
    p_draft = iter(probs_TV[draft_rows.to(dev), draft_toks.to(dev)].tolist())
    kept, last_rows, removed = [], [], []  # per request: kept drafts, the row its last token comes from
    for s, d, gen in zip(starts, drafts, gens):
        p_d = [next(p_draft) for _ in d]
        n = next((i for i, t in enumerate(d) if not torch.rand((), generator=gen).item() < p_d[i]), len(d))
        kept.append(d[:n])
        last_rows.append(s + n)
        removed.append(d[n] if n < len(d) else -1)  # a rejected draft is taken out of its row's p
    rest_BV = probs_TV[torch.tensor(last_rows, device=dev)]
    out_rows = [b for b, t in enumerate(removed) if t >= 0]
    if out_rows:
        rest_BV[torch.tensor(out_rows, device=dev), torch.tensor([removed[b] for b in out_rows], device=dev)] = 0.0
    return [k + [x] for k, x in zip(kept, sample_probs(rest_BV, gens).tolist())]
