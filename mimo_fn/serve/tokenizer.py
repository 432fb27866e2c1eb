"""Text in, text out: the server's tokenizer, and the text of an output as its tokens arrive.

`TextTokenizer` wraps either transformers' AutoTokenizer (a model directory: its tokenizer files
and chat template) or, for the embedded tiny model, a character-level tokenizer built here with
the `tokenizers` package (no download). `OutputText` turns an output's tokens into text one token
at a time: it emits only text that is stable (not the U+FFFD of a partial UTF-8 sequence), cuts
the text at the first stop string, and holds back a tail that may still grow into one, so the
pieces a stream sends always join to the final text.
"""

import json
import os
from collections.abc import Callable, Sequence

TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
# multi-character pieces that fill the tiny vocabulary past its characters: the tiny model can
# draw any id, and each must decode to something
TINY_PIECES = (" the", " and", " of", " to", "ing", "ion", " in", "ed", "er", " is", " a", "es", "th", "re",
               " that", " for", "on", "at", "en", "or", " it", "al", "an", " with", " as", "ly", " be")
TINY_CHAT_TEMPLATE = "<|im_start|>{role}\n{content}<|im_end|>\n"


class TextTokenizer:
    """encode / decode / chat_prompt over one of the two backends (see the module docstring)."""

    def __init__(self, backend, eos_token_ids: Sequence[int], path: str | None, hf: bool,
                 dropped: Callable[[int], bool] | None = None):
        self.backend, self.path, self._hf = backend, path, hf
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self._dropped = dropped

    def drops(self, token_id: int) -> bool:
        """Whether decode() leaves this id out wherever it stands (a special token: the tokenizers
        backend filters those before its decoder runs), so that it never changes a text. False
        where that is not known (transformers' tokenizers)."""
        return self._dropped is not None and self._dropped(token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.backend) if self._hf else self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        if self._hf:
            return list(self.backend.encode(text, add_special_tokens=False))
        return self.backend.encode(text).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (OpenAI log-prob `tokens`), special tokens included."""
        return self.decode([token_id], skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text of a chat: the model's chat template, with the assistant's turn opened."""
        if not self._hf:
            return "".join(TINY_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + (
                "<|im_start|>assistant\n")
        if getattr(self.backend, "chat_template", None) is None:
            raise ValueError(f"messages: the tokenizer at {self.path!r} has no chat template; "
                                    "use /v1/completions or /generate with the prompt text")
        try:
            return self.backend.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that rejects these messages (roles, order): the client's input
            raise ValueError(f"messages: the chat template rejected them: {e}") from None


def tiny_tokenizer(vocab_size: int) -> TextTokenizer:
    """A character-level tokenizer (printable ASCII, tab, newline; anything else is <unk>, dropped
    when decoding) with chat specials, every id of [0, vocab_size) decodable; eos: <|endoftext|>
    and <|im_end|>."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pieces = [*TINY_SPECIALS, "\n", "\t", *(chr(c) for c in range(32, 127)), *TINY_PIECES]
    if vocab_size < len(TINY_SPECIALS) + 97:
        raise ValueError(f"tiny_tokenizer: vocab_size = {vocab_size}; the characters need at least "
                         f"{len(TINY_SPECIALS) + 97}")
    first_reserved = len(pieces)  # ids from here on: reserved specials (none if the vocab is no larger)
    pieces += [f"<|reserved_{i}|>" for i in range(vocab_size - len(pieces))]  # a larger vocab: the rest
    vocab = {p: i for i, p in enumerate(pieces[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one character a token
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    specials = [*TINY_SPECIALS, *(p for p in vocab if p.startswith("<|reserved_"))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return TextTokenizer(tok, (vocab["<|endoftext|>"], vocab["<|im_end|>"]), None, hf=False,
                         dropped=lambda t: t < len(TINY_SPECIALS) or t >= first_reserved)


def load_tokenizer(path: str) -> TextTokenizer:
    """transformers' AutoTokenizer from a directory; eos: the tokenizer's and generation_config.json's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    gen = os.path.join(path, "generation_config.json")
    if os.path.exists(gen):
        with open(gen) as f:
            more = json.load(f).get("eos_token_id")
        eos += [more] if isinstance(more, int) else list(more or [])
    return TextTokenizer(tok, eos, path, hf=True)


class OutputText:
    """The text of one output, token by token: `push` each generated token (not a stop token the
    engine keeps as its last), `finish` once no more come. `text` is everything decoded so far (cut
    at a stop string), `visible` what may be sent now: `text` less a tail that could still begin a
    stop string. After a stop string matched, `stopped` holds it and later tokens are ignored."""

    def __init__(self, tok: TextTokenizer, stop: Sequence[str] = ()):
        self.tok, self.stop = tok, tuple(stop)
        self.ids: list[int] = []  # the tokens the text covers (up to the one completing a stop string)
        self.text = ""
        self.stopped: str | None = None
        self.finished = False
        # ids less those decode() drops anyway (tok.drops): a run of them (a random model's
        # reserved ids) would otherwise grow every decode below, and decode the same text
        self._kept: list[int] = []
        self._prefix = self._read = 0  # kept[prefix:read] decode to the text's last emitted piece
        self._before: str | None = None  # decode(kept[prefix:read]), until they move

    def push(self, token: int) -> None:
        if self.stopped is not None or self.finished:
            return
        self.ids.append(token)
        if self.tok.drops(token):  # the decodes below would not change: nothing to emit
            return
        self._kept.append(token)
        before, now = self._decoded()
        if len(now) > len(before) and not now.endswith("\ufffd"):  # stable: no partial UTF-8 sequence at its end
            self._append(now[len(before):])
            self._prefix, self._read, self._before = self._read, len(self._kept), None

    def finish(self) -> None:
        """No more tokens: the text decoded so far but held back (a partial sequence) joins it."""
        if self.stopped is None and not self.finished:
            before, now = self._decoded()
            if len(now) > len(before):
                self._append(now[len(before):])
        self.finished = True

    def _decoded(self) -> tuple[str, str]:
        """The text of the last emitted piece, and of it with the tokens after it."""
        if self._before is None:
            self._before = self.tok.decode(self._kept[self._prefix:self._read])
        return self._before, self.tok.decode(self._kept[self._prefix:])

    @property
    def visible(self) -> str:
        if self.finished or self.stopped is not None or not self.stop:
            return self.text
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self.text[:len(self.text) - hold]

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += piece
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, s = min(hits)
            self.text, self.stopped = self.text[:i], s
