"""JSON request bodies, parsed so that every refusal names its problem.

Every JSON route of the server, and every line of a batch input file, is parsed
here rather than by a bare ``json.loads``, which accepts what the API must refuse
(``NaN``, ``Infinity``, ``1e999``; lone UTF-16 surrogates such as ``"\\ud800"``, which
later break the tokenizer or the UTF-8 response encoder) and whose failures FastAPI
reports as "There was an error parsing the body". The common case costs one
``json.loads`` (its number hooks run only on floats and NaN/Infinity) plus a few
scans at C speed; the walks that find *where* a problem is run only when a scan or
a hook says there is one. Parsing runs on the event loop (it holds the GIL either
way), so its cost, ~15-50 ms per MB, is bounded by the body size limit (limits.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from seer_engine.entrypoints.openai.errors import BodyError

# No OpenAI request nests beyond ~6 levels (messages.0.content.0.text); tool schemas
# a few more. The bound keeps every later walk over a body shallow.
MAX_DEPTH = 64

# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 cannot encode one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


class _NonFinite:
    """Stands in for a number that JSON allows but a float cannot hold (NaN, 1e999)."""

    __slots__ = ("literal",)

    def __init__(self, literal: str) -> None:
        self.literal = literal


def parse_json_body(raw: bytes, what: str = "the body") -> Any:
    """``raw`` as JSON, or a ``BodyError`` (400) that says what is wrong and where.

    Refused: bytes that are not UTF-8 (a leading byte-order mark is allowed), text that
    is not JSON, nesting deeper than ``MAX_DEPTH``, lone UTF-16 surrogates in any string
    or key, and numbers that are not finite.
    """
    return parse_json_text(decode_utf8(raw, what), what)


def parse_json_text(text: str, what: str = "the body") -> Any:
    """``parse_json_body`` for text already decoded (a line of a batch input file)."""
    non_finite: list[_NonFinite] = []

    def constant(literal: str) -> _NonFinite:
        non_finite.append(_NonFinite(literal))
        return non_finite[-1]

    def finite_float(literal: str) -> float | _NonFinite:
        value = float(literal)
        return value if math.isfinite(value) else constant(literal)

    try:
        value = json.loads(text, parse_constant=constant, parse_float=finite_float)
    except RecursionError:
        raise BodyError(400, f"{what} nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise BodyError(
            400, f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise BodyError(400, f"{what} is not valid JSON: {e}") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and nesting_depth(text.encode()) > MAX_DEPTH:
        raise BodyError(400, f"{what} nests deeper than {MAX_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text):
        for path, item, is_key in _walk(value):
            if isinstance(item, str) and (bad := _SURROGATE.search(item)):
                where = f"a key in {_name(path, what)}" if is_key else _name(path, what)
                raise BodyError(
                    400,
                    f"{where} is not valid Unicode: a lone UTF-16 surrogate ({bad.group()!r}) "
                    f"at character {bad.start()}",
                    param=_param(path),
                )
    if non_finite:
        for path, item, _ in _walk(value):
            if isinstance(item, _NonFinite):
                raise BodyError(
                    400,
                    f"{_name(path, what)} must be a finite number, got {_shorten(item.literal)}",
                    param=_param(path),
                )
    return value


def decode_utf8(raw: bytes, what: str = "the body") -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            400, f"{what} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start})"
        ) from None
    return text.removeprefix("\ufeff")


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in valid JSON ``raw``, in a few vectorized passes.

    Brackets inside strings do not count: a quote opens or closes a string unless an
    odd run of backslashes precedes it. (Bytes of multi-byte UTF-8 characters are all
    >= 0x80, so they are never mistaken for a quote, a backslash or a bracket.)
    """
    b = np.frombuffer(raw, dtype=np.uint8)
    positions = np.arange(len(b))
    # Index of the last byte that is not a backslash, at or before each position.
    last_plain = np.maximum.accumulate(np.where(b != _BACKSLASH, positions, -1))
    quotes = np.flatnonzero(b == _QUOTE)
    before = quotes - 1
    run = before - last_plain[np.maximum(before, 0)]
    run[before < 0] = 0
    toggles = np.zeros(len(b), dtype=np.int8)
    toggles[quotes[run % 2 == 0]] = 1
    in_string = (np.cumsum(toggles, dtype=np.int64) & 1).astype(bool)
    steps = np.where(in_string, 0, _DEPTH_STEP[b])
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _walk(value: Any) -> Iterator[tuple[tuple, Any, bool]]:
    """(path, item, is_key) for every value and key, depth first, without recursion."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        yield path, item, False
        if isinstance(item, dict):
            for key in item:
                yield path, key, True
            stack.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, i), item[i]) for i in range(len(item) - 1, -1, -1))


def _shorten(literal: str, keep: int = 24) -> str:
    return literal if len(literal) <= 2 * keep else f"{literal[:keep]}...{literal[-keep:]}"


def _param(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


def _name(path: tuple, what: str) -> str:
    return _param(path) or what


# ------------------------------------------------------------------------------ routes


class JSONRequest(Request):
    """A request whose ``json()`` is ``parse_json_body`` (what FastAPI calls for bodies)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json

    @property
    def parsed(self) -> Any:
        """The body as parsed for the route (None when it was not read as JSON)."""
        return getattr(self, "_json", None)


class JSONRoute(APIRoute):
    """The route class of every router of the server: bodies are parsed by ``JSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def with_checked_json(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return with_checked_json
