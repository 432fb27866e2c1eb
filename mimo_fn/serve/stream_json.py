"""JSON of a stream's cumulative answer, a chunk at a time, without re-encoding what it sent before.

SGLang's streamed /generate sends the whole answer so far in every chunk. Its lists only grow
(output ids, their log-probs) or are fixed once they appear (the prompt's log-probs), so each item
is encoded once and kept: a stream of n tokens encodes n items, not n * n / 2, on the event loop's
thread that serves every stream. What comes out is byte for byte `to_json` of the whole list.
"""

from collections.abc import Callable
from typing import Any

from mimo_fn.serve.context import to_json


class GrowingList:
    """to_json of a list that only grows: the JSON of the items encoded before is kept, and only the
    new ones are encoded (by `encode`, to_json by default: a list's JSON is its items' JSON joined
    by ", ", so the pieces join up to exactly what one call on the whole list gives)."""

    def __init__(self, encode: Callable[[Any], str] = to_json):
        self._encode = encode
        self.count, self.body = 0, ""  # items kept; their JSON, brackets off

    def encode(self, n: int, items: Callable[[int, int], list]) -> str:
        """The JSON of a list of n items; items(a, b) gives items a..b-1, asked only for those not
        kept. The items kept are taken to be unchanged (a stream's lists only grow)."""
        if n < self.count:  # the list shrank (never for a stream's): start over, exact anyway
            self.count, self.body = 0, ""
        if n > self.count:
            new = self._encode(items(self.count, n))[1:-1]  # one encoder call a chunk, not one an item
            self.body = f"{self.body}, {new}" if self.count else new
            self.count = n
        return f"[{self.body}]"


def ints_json(xs: list[int]) -> str:
    """to_json of a list of ints (token ids), without the ~1 us of encoder set-up each to_json call
    has (a chunk of one new id is mostly that)."""
    return f"[{', '.join([str(int(t)) for t in xs])}]"  # json's ints and separator


class KeptJson:
    """to_json of a value that stays the same while its `key` does (the prompt's log-probs, fixed
    once scored): encoded once, again only if the key changes."""

    def __init__(self, encode: Callable[[Any], str] = to_json):
        self._encode = encode
        self.key, self.json = None, ""

    def encode(self, key, value: Callable[[], Any]) -> str:
        if self.key is None or key != self.key:
            self.key, self.json = key, self._encode(value())
        return self.json
