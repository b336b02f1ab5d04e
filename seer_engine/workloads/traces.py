"""Real response traces: gzip JSON-lines groups, tokenized lazily with the trace tokenizer.

Format and figures: ``../shared/traces/README.md``. A trace's token counts
(``response_tokens``) are checked against the tokenizer, warned about, not raised,
so a benchmark can still run on a trace whose counts drifted.
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from seer_engine.core.numbers import is_int
from seer_engine.workloads.paths import default_tokenizer_path, resolve_trace_path
from seer_engine.workloads.tokenizer import TraceTokenizer, get_tokenizer


class TraceTokenMismatchWarning(UserWarning):
    """A response tokenized to a different count than the trace's ``response_tokens``."""


@dataclass(frozen=True, eq=False)
class TraceGroup:
    """One prompt of a trace with its responses; token ids are computed on first use.

    ``head(n)`` views share the token-id slots with the group they come from, so
    tokenization happens at most once per response per process. The token-id lists
    handed out are shared: do not mutate them.
    """

    group_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    responses: tuple[str, ...]
    expected_tokens: tuple[int | None, ...]
    tokenizer: TraceTokenizer = field(repr=False)
    _slots: list[list[int] | None] = field(repr=False, default_factory=list)
    _mismatches: dict[int, tuple[int, int]] = field(repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self._slots:
            self._slots.extend([None] * len(self.responses))
        if len(self.expected_tokens) != len(self.responses):
            raise ValueError(
                f"group {self.group_id!r}: {len(self.responses)} responses but "
                f"{len(self.expected_tokens)} response_tokens"
            )

    @property
    def num_samples(self) -> int:
        return len(self.responses)

    @property
    def prompt_text(self) -> str:
        """The prompt, or the placeholder that ``prompt_token_ids`` encodes when it is null."""
        return self.prompt if self.prompt is not None else _placeholder_prompt(self.group_id)

    @property
    def response_token_ids(self) -> list[list[int]]:
        """Token ids of every response (tokenized once, then cached)."""
        missing = [i for i in range(self.num_samples) if self._slots[i] is None]
        if missing:
            self._tokenize(missing)
        return list(self._slots[: self.num_samples])  # type: ignore[arg-type]

    @property
    def lengths(self) -> list[int]:
        """Response lengths in tokens without tokenizing when the trace gives them.

        The replay emits exactly ``response_token_ids``, so once a response has been
        tokenized its real count wins over a disagreeing ``response_tokens``.
        """
        out = []
        for i in range(self.num_samples):
            ids = self._slots[i]
            expected = self.expected_tokens[i]
            if ids is not None:
                out.append(len(ids))
            elif expected is not None:
                out.append(expected)
            else:
                out.append(len(self.response_token_ids[i]))
        return out

    @property
    def token_mismatches(self) -> list[tuple[int, int, int]]:
        """``(response index, trace response_tokens, tokenized length)`` for tokenized mismatches."""
        return sorted((i, e, g) for i, (e, g) in self._mismatches.items() if i < self.num_samples)

    def head(self, n: int) -> TraceGroup:
        """The first ``n`` responses (a view sharing cached token ids)."""
        if not 1 <= n <= self.num_samples:
            raise ValueError(f"group {self.group_id!r} has {self.num_samples} responses, asked for {n}")
        if n == self.num_samples:
            return self
        return TraceGroup(
            group_id=self.group_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            responses=self.responses[:n],
            expected_tokens=self.expected_tokens[:n],
            tokenizer=self.tokenizer,
            _slots=self._slots,
            _mismatches=self._mismatches,
        )

    def _tokenize(self, indices: list[int]) -> None:
        encoded = self.tokenizer.encode_many([self.responses[i] for i in indices])
        bad = []
        for i, ids in zip(indices, encoded):
            self._slots[i] = ids
            expected = self.expected_tokens[i]
            if expected is not None and expected != len(ids):
                self._mismatches[i] = (expected, len(ids))
                bad.append(f"#{i}: trace says {expected}, tokenizer gives {len(ids)}")
        if bad:
            warnings.warn(
                f"group {self.group_id!r}: token counts differ from response_tokens "
                f"({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''})",
                TraceTokenMismatchWarning,
                stacklevel=3,
            )


def _placeholder_prompt(group_id: str) -> str:
    """A short deterministic prompt for traces that do not include theirs."""
    return f"Prompt of trace group {group_id}. Think step by step, then answer."


_TRACE_CACHE: dict[tuple[str, int, int, str], list[TraceGroup]] = {}


def load_trace(
    path: str | os.PathLike,
    tokenizer: str | os.PathLike | TraceTokenizer | None = None,
    *,
    tokenize: bool = False,
) -> list[TraceGroup]:
    """Read a gzip JSON-lines trace into groups (cached per file for this process).

    Responses are tokenized lazily on first access to ``response_token_ids``, or
    up front with ``tokenize=True``; either way counts are checked against the
    trace's ``response_tokens`` and mismatches are warned about, not raised, so a
    benchmark can still run. Returns a new list of shared group objects.
    """
    trace = resolve_trace_path(path).resolve()
    tok = (
        tokenizer
        if isinstance(tokenizer, TraceTokenizer)
        else get_tokenizer(tokenizer or default_tokenizer_path(trace))
    )
    stat = trace.stat()
    key = (str(trace), stat.st_mtime_ns, stat.st_size, str(tok.path.resolve()))
    groups = _TRACE_CACHE.get(key)
    if groups is None:
        groups = _TRACE_CACHE[key] = _read_trace(trace, tok)
    if tokenize:
        tokenize_groups(groups)
    return list(groups)


def _read_trace(path: Path, tok: TraceTokenizer) -> list[TraceGroup]:
    """Parse every record (naming the line of a bad one); prompts are tokenized in one batch."""
    records = []
    first_line: dict[str, int] = {}  # group id -> the line that gave it
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(_record(json.loads(line)))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path.name}:{lineno}: not a trace record ({e})") from e
                gid = records[-1][0]  # responses are keyed by group id: two groups cannot share one
                if gid in first_line:
                    raise ValueError(f"{path.name}:{lineno}: group_id {gid!r} repeats line {first_line[gid]}")
                first_line[gid] = lineno
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
        raise ValueError(f"{path}: not a gzip JSON-lines trace ({e})") from None
    if not records:
        raise ValueError(f"{path}: the trace holds no groups")
    prompt_texts = [r[1] if r[1] is not None else _placeholder_prompt(r[0]) for r in records]
    prompt_ids = tok.encode_many(prompt_texts)
    groups = []
    for (gid, prompt, responses, expected, prompt_tokens), ids in zip(records, prompt_ids):
        if prompt is not None and prompt_tokens is not None and prompt_tokens != len(ids):
            warnings.warn(
                f"group {gid!r}: prompt tokenizes to {len(ids)} tokens, trace says {prompt_tokens}",
                TraceTokenMismatchWarning,
                stacklevel=3,
            )
        groups.append(TraceGroup(gid, prompt, ids, responses, expected, tok))
    return groups


def _record(rec: dict) -> tuple:
    """One line's fields, type-checked (TypeError, KeyError: the caller names the line):
    a wrong type would otherwise surface far from the trace, as a tokenizer or
    arithmetic error."""
    if not isinstance(rec, dict):
        raise TypeError(f"expected an object, got {type(rec).__name__}")
    responses, prompt = rec["responses"], rec.get("prompt")
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise TypeError("'responses' must be a list of strings")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError("'prompt' must be a string or null")
    counts = rec.get("response_tokens")
    if counts is not None and (
        not isinstance(counts, list) or not all(c is None or (is_int(c) and c >= 0) for c in counts)
    ):
        raise TypeError("'response_tokens' must be a list of token counts (integers >= 0) or null")
    prompt_tokens = rec.get("prompt_tokens")
    if prompt_tokens is not None and not (is_int(prompt_tokens) and prompt_tokens >= 0):
        raise TypeError("'prompt_tokens' must be a token count (an integer >= 0) or null")
    expected = tuple(counts) if counts is not None else (None,) * len(responses)
    return str(rec["group_id"]), prompt, tuple(responses), expected, prompt_tokens


def tokenize_groups(groups: Iterable[TraceGroup]) -> int:
    """Tokenize every not-yet-tokenized response of ``groups``; returns the token count."""
    total = 0
    for g in groups:
        total += sum(len(ids) for ids in g.response_token_ids)
    return total
