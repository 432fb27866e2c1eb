"""What bench_serving sends: prompts with their lengths, and when each one goes out.

Three workloads, as SGLang's bench_serving names them:
- `random`: random token ids decoded to text with the tokenizer (the server tokenises them again,
  so the prompt it runs can be a few tokens off the drawn length; the report counts what the
  server says it ran);
- `random-ids`: random token ids sent as ids, no tokenizer (the reference run's TOKENIZE_PROMPT=0);
- `jsonl`: a file of prompts or conversations, one JSON object a line.
Lengths are drawn uniformly from [max(1, int(len * range_ratio)), len], the ids uniformly from the
vocabulary (special tokens left out when a tokenizer says which they are).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]   # text, or token ids sent as `input_ids` / an id-list prompt
    prompt_len: int                 # tokens the client expects the server to run (0 if unknown)
    output_len: int                 # max_new_tokens asked for


class JsonTokenizer:
    """A bare `tokenizer.json` (the `tokenizers` package; transformers is not imported): what the
    workloads need of a tokenizer, under transformers' names."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)
        self.all_special_ids = sorted(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def __len__(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("--apply-chat-template needs a tokenizer with a chat template: pass a model directory")


def load_tokenizer(path: str) -> Any:
    """A `tokenizer.json` file, or transformers' AutoTokenizer of a model directory or hub id."""
    if path.endswith(".json") and Path(path).is_file():
        return JsonTokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def special_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's special tokens: its named ones and every added token marked special (a bare
    tokenizer.json names none, but marks its added ones)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted(set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)})


def sample_lengths(rng: np.random.Generator, num: int, length: int, range_ratio: float,
                   name: str = "a random length") -> list[int]:
    """`num` lengths uniform in [max(1, int(length * range_ratio)), length]."""
    if length < 1:
        raise ValueError(f"{name} must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [int(n) for n in rng.integers(low, length + 1, size=num)]


def random_ids_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int,
    exclude_ids: Sequence[int] = (),
) -> list[BenchRequest]:
    """`num_prompts` prompts of random ids in [0, vocab_size) minus `exclude_ids`, sent as ids."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    if allowed.size == 0:
        raise ValueError(f"no token ids left to draw from a vocabulary of {vocab_size} without its special tokens")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio, "--random-input-len")
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio, "--random-output-len")
    return [
        BenchRequest(tuple(int(t) for t in rng.choice(allowed, size=n)), n, m)
        for n, m in zip(in_lens, out_lens)
    ]


def random_text_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, tokenizer: Any, seed: int,
) -> list[BenchRequest]:
    """Random ids of the drawn lengths, decoded to text."""
    ids = random_ids_requests(
        num_prompts, input_len, output_len, range_ratio, len(tokenizer), seed, exclude_ids=special_ids(tokenizer),
    )
    return [BenchRequest(tokenizer.decode(list(r.prompt)), r.prompt_len, r.output_len) for r in ids]


def _turn_text(turn: Any, where: str) -> str:
    text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{where}: a conversation turn must be an object with a string 'value' or 'content'")
    return text


def parse_jsonl_line(obj: Any, where: str, default_output_len: int, tokenizer: Any | None,
                     apply_chat_template: bool) -> BenchRequest:
    """One line of a jsonl workload.

    Accepted: {"prompt": text | [ids]}, {"text": text}, {"input_ids": [ids]}, or a conversation
    {"conversations" | "messages": [turn, ...]} with turns {"from"|"role", "value"|"content"}, whose
    first turn is the prompt (as SGLang's ShareGPT loader takes it) and whose second turn, given a
    tokenizer, sets the output length. An "output_len" field overrides the output length.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    output_len = default_output_len
    prompt: Any = None
    for key in ("prompt", "text", "input_ids"):
        if key in obj:
            prompt = obj[key]
            break
    else:
        turns = obj.get("conversations", obj.get("messages"))
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: expected one of 'prompt', 'text', 'input_ids', 'conversations', 'messages'")
        prompt = _turn_text(turns[0], where)
        if len(turns) > 1 and tokenizer is not None:
            output_len = max(1, len(tokenizer.encode(_turn_text(turns[1], where), add_special_tokens=False)))
    if "output_len" in obj:
        output_len = obj["output_len"]
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise ValueError(f"{where}: 'output_len' must be an integer >= 1, got {obj['output_len']!r}")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError(f"{where}: a token-id prompt must be a non-empty list of integers >= 0")
        return BenchRequest(tuple(prompt), len(prompt), output_len)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: the prompt must be a non-empty string or a list of token ids")
    if apply_chat_template:
        if tokenizer is None:
            raise ValueError("--apply-chat-template needs --tokenizer")
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False,
        )
    prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False)) if tokenizer is not None else 0
    return BenchRequest(prompt, prompt_len, output_len)


def jsonl_requests(path: str, num_prompts: int, default_output_len: int, tokenizer: Any | None = None,
                   apply_chat_template: bool = False) -> list[BenchRequest]:
    """The first `num_prompts` non-blank lines of `path` (all of them if it has fewer)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    out: list[BenchRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(out) == num_prompts:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            out.append(parse_jsonl_line(obj, where, default_output_len, tokenizer, apply_chat_template))
    if not out:
        raise ValueError(f"{path}: no prompts (the file has no non-blank lines)")
    return out


def arrival_times(num: int, request_rate: float, seed: int) -> list[float]:
    """Send time of each request in seconds from the start: all at 0 for an infinite rate, else a
    Poisson process (exponential gaps of mean 1 / rate), the first request at 0."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf sends every request at once), got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * num
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / request_rate, size=max(num - 1, 0))
    return [0.0] + [float(t) for t in np.cumsum(gaps)]
