"""prompt_copies.shared_prefixes: which prompts of a call form a prefix group, and its length."""

import torch

from mimo_fn.engine.prompt_copies import shared_prefixes


def test_shared_prefixes_groups_prompts_that_begin_alike():
    """Pages of 4. Prompts 0, 2 and 5 share 10 tokens (8 in whole pages); 3 is a copy of 0
    (prompt_key 0) and joins with it; 1 and 4 share 3 tokens (less than a page: no group); 6
    and 7 share 9 tokens, but 7 has only 8, so their prefix is the 4 whole pages before its last
    token; 8 is alone. The prefix is never a whole prompt of its group."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, 1000, (n,), generator=g).tolist()  # noqa: E731
    s10, s3, s9 = rand(10), rand(3), rand(9)
    prompts = [s10 + [1, 2], s3 + rand(6), s10 + [3], s10 + [1, 2], s3 + rand(2), s10 + rand(7), s9 + [4], s9[:8],
               rand(30)]
    keys = [0, -1, -1, 0, -1, -1, -1, -1, -1]
    assert sorted(shared_prefixes(prompts, keys, 0, 4)) == [(4, [6, 7]), (8, [0, 2, 3, 5])]
    assert sorted(shared_prefixes(prompts, [k + 100 * (k >= 0) for k in keys], 100, 4)) == [(4, [6, 7]),
                                                                                          (8, [0, 2, 3, 5])]
    assert shared_prefixes(prompts, keys, 0, 16) == []
    assert shared_prefixes([[1, 2, 3, 4, 5]] * 2, [0, 0], 0, 4) == []  # copies of one prompt: rule 5's business
