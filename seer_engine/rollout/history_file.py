"""A saved history store's JSON, read a prompt at a time.

``json.loads`` would build every stored token id as a Python int, about 36 bytes where
the store keeps 4: the top-level object is walked field by field and its "prompts"
object record by record, so one prompt's record at a time is Python objects.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def read_text(f: BinaryIO) -> str:
    """The file's text, decoded as ``json.loads`` decodes bytes (UTF-8, -16 or -32)."""
    data = f.read()
    return data.decode(json.detect_encoding(data), "surrogatepass")


def fields(text: str) -> Iterator[tuple[str, Any]]:
    """The store's top-level fields in file order, "prompts" as a ``Prompts`` to walk
    (walked past here if the caller does not); nothing but space may follow the object."""
    top = _Top(text, 0, "the store")
    yield from top
    end = _skip_space(text, top.end)
    if end != len(text):
        raise ValueError(f"extra data after the store at char {end}")


class _Object:
    """The JSON object at ``start`` of ``text``, walked a member at a time; ``end`` is
    just past it once walked through."""

    def __init__(self, text: str, start: int, what: str) -> None:
        self.text, self.start, self.what = text, start, what
        self.end = -1

    def _value(self, key: str, pos: int) -> tuple[Any, int | None]:
        """The member's value and where it ends (None: a nested object walked later)."""
        return _DECODER.raw_decode(self.text, pos)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        text = self.text
        pos = _skip_space(text, self.start)
        if text[pos : pos + 1] != "{":
            raise ValueError(f"{self.what} is not an object")
        pos = _skip_space(text, pos + 1)
        if text[pos : pos + 1] == "}":
            self.end = pos + 1
            return
        while True:
            if text[pos : pos + 1] != '"':
                raise ValueError(f"expected a key in {self.what} at char {pos}")
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if text[pos : pos + 1] != ":":
                raise ValueError(f"expected ':' in {self.what} at char {pos}")
            value, end = self._value(key, _skip_space(text, pos + 1))
            yield key, value
            pos = _skip_space(text, value.walked_past() if end is None else end)
            if text[pos : pos + 1] == "}":
                self.end = pos + 1
                return
            if text[pos : pos + 1] != ",":
                raise ValueError(f"expected ',' or '}}' in {self.what} at char {pos}")
            pos = _skip_space(text, pos + 1)

    def walked_past(self) -> int:
        """Where the object ends, walking through it (values parsed, not kept) if not yet."""
        if self.end < 0:
            for _ in self:
                pass
        return self.end


class Prompts(_Object):
    """The "prompts" object: (key, record) pairs in file order, each record parsed as it
    is reached, afresh on every walk."""


class _Top(_Object):
    """The store's object: its "prompts" left to walk, the other (small) fields parsed."""

    def _value(self, key: str, pos: int) -> tuple[Any, int | None]:
        if key == "prompts":
            return Prompts(self.text, pos, '"prompts"'), None
        return super()._value(key, pos)


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()  # type: ignore[union-attr]  # "*" always matches
