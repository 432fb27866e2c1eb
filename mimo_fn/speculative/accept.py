"""Speculative sampling for drafts that come without probabilities (prompt lookup, a DFlash
block draft's argmax): which drafts a verify step keeps, and the token after them.

Legend: T fed tokens of a verify step (every request's last token and its drafts), V vocab.
"""

from collections.abc import Sequence

import torch

from mimo_fn._types import Float, Tensor, typed
from mimo_fn.layers.sampling import SamplingParams, distribution_groups, filtered_probs, sample_probs
from mimo_fn.upload import upload


@typed
def accept_each(
    logits_TV: Float[Tensor, "T V"], drafts: list[list[int]], sps: Sequence[SamplingParams | None],
    gens: list[torch.Generator], fed: Sequence[int] | None = None,
) -> list[list[int]]:
    """What each request of a verify step keeps: its accepted drafts, then one token more.
    Request b fed its last token and drafts[b] as the next rows of logits_TV and decides under
    sps[b]; fed[b] rows in all where it fed more (drafts past a confidence cut, draft_cut: their
    rows are skipped; None: 1 + len(drafts[b])). Greedy (None or temperature 0): the drafts that
    equal the argmax after the token before them, then the argmax after the last one kept.
    Sampled: `accept_sampled`, called once for all requests that share a distribution."""
    fed = [len(d) + 1 for d in drafts] if fed is None else list(fed)
    if len(fed) != len(drafts) or any(n < len(d) + 1 for n, d in zip(fed, drafts)):
        raise ValueError(f"accept_each: fed rows {fed} for drafts of lengths {[len(d) for d in drafts]}; "
                         "each request feeds its last token and its drafts at least")
    starts = [0]
    for n in fed:
        starts.append(starts[-1] + n)
    groups = distribution_groups(sps)
    kept: list[list[int]] = [[] for _ in drafts]
    if None in groups:
        greedy_T = logits_TV.argmax(dim=-1).tolist()  # greedy's token after each fed token
        for b in groups[None]:
            choice = greedy_T[starts[b]:starts[b] + len(drafts[b]) + 1]
            n = next((i for i, t in enumerate(drafts[b]) if t != choice[i]), len(drafts[b]))
            kept[b] = choice[:n + 1]
    for key, reqs in groups.items():
        if key is None:
            continue
        rows_TV = logits_TV
        if len(reqs) < len(drafts) or any(n > len(d) + 1 for n, d in zip(fed, drafts)):  # these rows only
            rows = torch.tensor([t for b in reqs for t in range(starts[b], starts[b] + len(drafts[b]) + 1)])
            rows_TV = logits_TV[upload([rows], logits_TV.device)[0]]
        news = accept_sampled(rows_TV, [drafts[b] for b in reqs], sps[reqs[0]], [gens[b] for b in reqs])
        for b, new in zip(reqs, news):
            kept[b] = new
    return kept


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
