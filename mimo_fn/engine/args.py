"""Engine.generate's arguments, checked and brought to one form before anything runs.

A user's mistake here (a string for a prompt, floats for token ids, one stop id where a list
was meant) is a ValueError that names the argument and what it should be, raised before the
call holds any state; a float token is never truncated to an int in silence. On a mesh the
ranks then agree that every one of them accepted its arguments (agree_on_call).
"""

import array
import itertools
import numbers
import zlib
from collections import abc
from dataclasses import dataclass

import torch

from mimo_fn.layers.sampling import SamplingParams, per_request


@dataclass(frozen=True)
class GenerateArgs:
    prompts: list[list[int]]  # token ids, each in the vocabulary, none empty
    limits: list[int]  # max_new_tokens per prompt, each >= 1
    sampling: list[SamplingParams | None]  # per prompt; None = greedy
    stops: frozenset[int]  # stop token ids

    def first_copies(self) -> list[int]:
        """For each prompt, the index of the first prompt equal to it (its own if none before);
        keyed by hash, so no copy of every prompt is kept."""
        seen: dict[int, list[int]] = {}  # hash -> indices of distinct prompts with it
        firsts = []
        for i, toks in enumerate(self.prompts):
            same = seen.setdefault(hash(tuple(toks)), [])
            j = next((j for j in same if self.prompts[j] == toks), None)
            if j is None:
                same.append(i)
            firsts.append(i if j is None else j)
        return firsts

    def fingerprint(self) -> int:
        """A checksum, to check that ranks which must agree on the arguments do."""
        tokens = array.array("q", itertools.chain.from_iterable(self.prompts)).tobytes()
        rest = repr(([len(p) for p in self.prompts], self.limits, self.sampling, sorted(self.stops))).encode()
        return zlib.crc32(rest, zlib.crc32(tokens))


def check_args(prompts, max_new_tokens, sampling, stop_token_ids, vocab_size: int,
               what: str = "generate", max_positions: int | None = None) -> GenerateArgs:
    """generate's (or `what`'s) arguments as GenerateArgs; a ValueError naming the first thing wrong.
    max_positions: the model's max_position_embeddings, which no prompt + max_new_tokens may pass."""
    try:
        return _check_args(prompts, max_new_tokens, sampling, stop_token_ids, vocab_size, max_positions)
    except ValueError as e:
        if what == "generate":
            raise
        raise ValueError(str(e).replace("generate: ", f"{what}: ", 1).replace("prompt 0", "prompt")) from None


def _check_args(prompts, max_new_tokens, sampling, stop_token_ids, vocab_size: int,
                max_positions: int | None = None) -> GenerateArgs:
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, abc.Iterable):
        raise ValueError(f"generate: prompts is a {type(prompts).__name__}; expected a list of prompts, each a "
                         "list of token ids")
    token_lists = [_token_ids(p, i, vocab_size) for i, p in enumerate(prompts)]
    limits = _limits(max_new_tokens, len(token_lists))
    if max_positions is not None:
        bad = next((i for i, (t, m) in enumerate(zip(token_lists, limits)) if len(t) + m > max_positions), None)
        if bad is not None:
            n, m = len(token_lists[bad]), limits[bad]
            raise ValueError(f"generate: prompt {bad} ({n} tokens) + max_new_tokens ({m}) = {n + m} tokens, past "
                             f"the model's max_position_embeddings = {max_positions}")
    return GenerateArgs(token_lists, limits, per_request(sampling, len(token_lists)),
                        _stop_ids(stop_token_ids, vocab_size))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _limits(max_new_tokens, n: int) -> list[int]:
    if _is_int(max_new_tokens):
        if max_new_tokens <= 0:
            raise ValueError(f"generate: max_new_tokens = {max_new_tokens}, expected a positive int")
        return [int(max_new_tokens)] * n
    if not isinstance(max_new_tokens, abc.Iterable):
        raise ValueError(f"generate: max_new_tokens = {max_new_tokens!r}, expected a positive int or one per prompt")
    limits = list(max_new_tokens)
    if len(limits) != n:
        raise ValueError(f"generate: {len(limits)} max_new_tokens for {n} prompts; give one per prompt, or one "
                         "int for all")
    bad = next((i for i, m in enumerate(limits) if not _is_int(m) or m <= 0), None)
    if bad is not None:
        raise ValueError(f"generate: max_new_tokens[{bad}] = {limits[bad]!r}, expected a positive int")
    return [int(m) for m in limits]


def _token_ids(prompt, i: int, vocab_size: int) -> list[int]:
    """Prompt i as a list of ints in [0, vocab_size)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"generate: prompt {i} is a {prompt.dtype} tensor of shape {tuple(prompt.shape)}; "
                             "expected token ids (ints)")
        toks = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, abc.Iterable):
        raise ValueError(f"generate: prompt {i} = {prompt!r:.40}; expected a list of token ids (one list per "
                         "prompt, tokenised)")
    else:
        toks = list(prompt)
        if set(map(type, toks)) - {int}:  # the type scan runs in C: a 64K-token prompt costs no Python loop
            bad = next((t for t in toks if not _is_int(t)), None)
            if bad is not None:
                raise ValueError(f"generate: prompt {i} holds {bad!r}; expected token ids (ints)")
            toks = list(map(int, toks))  # numpy or other integer types
    if not toks:
        raise ValueError(f"generate: prompt {i} is empty")
    if min(toks) < 0 or max(toks) >= vocab_size:
        bad = next(t for t in toks if not 0 <= t < vocab_size)
        raise ValueError(f"generate: prompt {i} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return toks


def _stop_ids(stop_token_ids, vocab_size: int) -> frozenset[int]:
    """Token ids, one id, or None (no stop tokens)."""
    ids = [stop_token_ids] if isinstance(stop_token_ids, numbers.Integral) else stop_token_ids or ()
    ids = list(ids) if isinstance(ids, abc.Iterable) and not isinstance(ids, (str, bytes)) else [None]
    if not all(map(_is_int, ids)):
        raise ValueError(f"generate: stop_token_ids = {stop_token_ids!r}; expected token ids (ints), or one int")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:  # a stop that can never be sampled is a mistake (another tokenizer's id, say)
        raise ValueError(f"generate: stop_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
    return frozenset(map(int, ids))


def agree_on_call(mesh, device, error: ValueError | None, fingerprint: int | None, flags: tuple[bool, ...]) -> None:
    """Raise `error`; on a mesh (parallel.mesh.Mesh) first agree (one host all-gather) that every
    rank accepted its arguments, that the TP ranks of each DP group passed the same ones (their
    fingerprint, GenerateArgs.fingerprint), and that the flags that shape the steps' graphs are the
    same everywhere, so that every rank raises together rather than some waiting for the others in
    a collective."""
    if mesh.world == 1:
        if error is not None:
            raise error
        return
    rows = mesh.agree_ints([int(error is None), fingerprint or 0, *map(int, flags)], device)
    if error is not None:
        raise error
    tp = mesh.tp
    failed = [r for r, row in enumerate(rows) if not row[0]]
    if failed:
        raise ValueError(f"generate: rank(s) {failed} rejected their arguments (their errors say why); "
                         "nothing ran on any rank")
    split = [d for d in range(mesh.dp) if len({rows[d * tp + t][1] for t in range(tp)}) > 1]
    if split:
        raise ValueError(f"generate: the TP ranks of DP group(s) {split} passed different prompts or arguments; "
                         "every TP rank of a DP group must pass the same")
    if len({tuple(row[2:]) for row in rows}) > 1:
        raise ValueError("generate: return_logprobs and return_routed_experts must be the same on every rank")
