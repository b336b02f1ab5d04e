"""Rollout workloads: real response traces and a fitted synthetic generator.

Rollout benchmarks replay real responses (see DESIGN.md, "Trace replay") and the
cluster simulator needs realistic group-structured output lengths at the scale of
the setup being modelled. Both consume the same small interface
(:class:`WorkloadGroup`): ``group_id``, ``prompt_token_ids``, ``lengths``,
``response_token_ids``, ``num_samples`` and ``head(n)``, so either source can feed
either consumer.

Figures reproduced on ``qwen3-8b-mcq-cot.jsonl.gz`` (all 90 groups, 4,485 responses)
by :func:`trace_stats` / :func:`ngram_overlap`, README value in brackets:

- within-group CV of length, mean over groups: 0.339 [0.34]
- CV of group means: 0.445 [0.44]
- within-group share of length variance: 0.392 [0.39]
- longest / group mean, mean over groups: 1.966 [1.97]
- Spearman(first response length, longest): 0.684 [0.68]; 0.770 on the 45
  ``faith_uncued*`` groups [0.77]
- word 8-grams also found in a sibling: 29.0% [29%]; in another group: 1.9% [2%]
- tokens/response mean / median / p90 / max: 1,619 / 1,406 / 2,867 / 10,307 [same]

Definitions (chosen because they are the ones that reproduce the README): standard
deviations are population ones (ddof=0; ddof=1 gives an across-group CV of 0.447);
the variance share is within-group sum of squares over total sum of squares;
Spearman uses average ranks for ties; words are whitespace-separated; a response's
8-grams are counted once each (distinct). "Another group" is one other group, the
next in trace order (cyclically), so both sides of the comparison search a pool of
about one group's responses. Against *every* other group the qwen3 figure is 33%,
because the trace holds each question twice (cued and uncued prompt) and answers
share boilerplate; averaged over the choice of the other group it is 1.1%.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FIT",
    "FIGURE_LABELS",
    "README_FIGURES",
    "SyntheticGroup",
    "TraceGroup",
    "TraceTokenMismatchWarning",
    "TraceTokenizer",
    "WorkloadGroup",
    "add_cli",
    "default_tokenizer_path",
    "format_table",
    "get_tokenizer",
    "load_trace",
    "ngram_overlap",
    "resolve_trace_path",
    "scale_lengths",
    "select_groups",
    "spearman",
    "synthetic_workload",
    "take_samples",
    "tokenize_groups",
    "trace_stats",
    "traces_dir",
]

TOKENIZER_FILENAME = "bpe32k-tokenizer.json"

# The Qwen3 trace's figures as printed in ../shared/traces/README.md: the targets of
# the synthetic generator's fit and the reference column of the CLI table.
README_FIGURES: dict[str, float] = {
    "within_cv": 0.34,
    "across_cv": 0.44,
    "within_share": 0.39,
    "longest_over_mean": 1.97,
    "spearman_first_longest": 0.68,
    "ngram_within": 0.29,
    "ngram_cross": 0.02,
}

FIGURE_LABELS: dict[str, str] = {
    "groups": "groups",
    "responses": "responses",
    "mean_len": "tokens/response, mean",
    "median_len": "tokens/response, median",
    "p90_len": "tokens/response, p90",
    "max_len": "tokens/response, max",
    "within_cv": "CV of length within a group (mean over groups)",
    "across_cv": "CV across group means",
    "within_share": "share of length variance within groups",
    "longest_over_mean": "longest / group mean (mean over groups)",
    "spearman_first_longest": "Spearman(first response, longest)",
    "ngram_within": "word n-grams also in a sibling",
    "ngram_cross": "word n-grams also in another group",
}


# --------------------------------------------------------------------------- paths


def traces_dir() -> Path:
    """The shared traces folder: ``$SEER_TRACES_DIR``, else ``../shared/traces`` beside the repo.

    Traces are data that must never be committed into the project, so they are
    looked up outside it rather than shipped as package data.
    """
    env = os.environ.get("SEER_TRACES_DIR")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "traces"


def default_tokenizer_path(trace_path: str | os.PathLike | None = None) -> Path:
    """The trace tokenizer: next to the trace file if present there, else in :func:`traces_dir`."""
    if trace_path is not None:
        beside = Path(trace_path).resolve().parent / TOKENIZER_FILENAME
        if beside.is_file():
            return beside
    return traces_dir() / TOKENIZER_FILENAME


def resolve_trace_path(name: str | os.PathLike) -> Path:
    """Accept an existing path, or a bare file name / stem found in :func:`traces_dir`."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    folder = traces_dir()
    for candidate in (folder / str(name), folder / f"{name}.jsonl.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"trace {str(name)!r} not found (also looked in {folder})")


# ---------------------------------------------------------------------- tokenizer


def _byte_level_alphabet() -> list[str]:
    """Byte -> printable character map used by byte-level BPE (the GPT-2 convention)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# The byte-level pre-tokenizer's regex (contractions, letters, digits, other symbols,
# whitespace runs) with its Unicode classes spelled out for ASCII plus the non-ASCII
# characters of the text at hand. Python's ``re`` runs it several times faster than
# tokenizers' Oniguruma runs the \p{L}/\p{N} original, and splits identically.
_ASCII_WS = "\t\n\x0b\x0c\r "
_UNICODE_WS = frozenset("\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B)
)
# ASCII separators whose whitespace class differs between regex flavours: texts
# containing them take the reference path.
_AMBIGUOUS_WS = re.compile("[\x1c-\x1f]")


@lru_cache(maxsize=4096)
def _pretoken_pattern(extra: frozenset[str]) -> re.Pattern[str]:
    """The pre-tokenizer regex, exact for ASCII plus the characters in ``extra``."""
    import unicodedata

    def cls(chars: Iterable[str]) -> str:
        return "".join(re.escape(c) for c in sorted(chars))

    letters = "A-Za-z" + cls(c for c in extra if unicodedata.category(c).startswith("L"))
    digits = "0-9" + cls(c for c in extra if unicodedata.category(c).startswith("N"))
    ws = re.escape(_ASCII_WS) + cls(extra & _UNICODE_WS)
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{digits}]+| ?[^{ws}{letters}{digits}]+"
        rf"|[{ws}]+(?![^{ws}])|[{ws}]+"
    )


class TraceTokenizer:
    """The trace tokenizer with a fast exact path for byte-level BPE (what the traces use).

    ``tokenizers`` spends most of its time in its regex pre-tokenizer: 13-15 s for
    the 4,485 Qwen3 responses on the 2-core dev machine. We split with an equivalent
    Python regex and BPE-encode each distinct piece once (pieces repeat heavily),
    which gives the same ids in 2.2 s. Trust is earned, not assumed: the first few texts,
    and the first text containing each new non-ASCII character, are compared with
    ``tokenizers``; a difference routes those texts (or everything, for ASCII) to
    ``tokenizers``, as are special-token text and other tokenizer types.
    """

    _SPOT_CHECKS = 4

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"trace tokenizer not found: {self.path}")
        self.tokenizer = Tokenizer.from_file(str(self.path))
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._alphabet = _byte_level_alphabet()
        self._spot_checks_left = self._SPOT_CHECKS
        self._verified: set[str] = set()
        self._refused: set[str] = set()
        self.fast = self._fast_path_applies()

    def _fast_path_applies(self) -> bool:
        """Only a plain byte-level BPE (no normalizer, regex pre-tokenizer) splits like our regex."""
        cfg = json.loads(self.tokenizer.to_str())
        model = cfg.get("model") or {}
        pre = cfg.get("pre_tokenizer") or {}
        return (
            model.get("type") == "BPE"
            and not model.get("dropout")
            and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix")
            and cfg.get("normalizer") is None
            and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
        )

    def _reference(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _encode_fast(self, text: str, pattern: re.Pattern[str]) -> list[int]:
        pieces = pattern.findall(text)
        cache = self._pieces
        try:
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:
            model, alphabet = self.tokenizer.model, self._alphabet
            for piece in pieces:
                if piece not in cache:
                    mapped = "".join(alphabet[b] for b in piece.encode("utf-8"))
                    cache[piece] = tuple(t.id for t in model.tokenize(mapped))
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def _try_fast(self, text: str) -> list[int] | None:
        """Ids by the fast path, or None when the text must go to ``tokenizers``."""
        if not self.fast or _AMBIGUOUS_WS.search(text) or any(s in text for s in self._specials):
            return None
        extra = frozenset() if text.isascii() else frozenset(c for c in set(text) if ord(c) > 127)
        if extra & self._refused:
            return None
        ids = self._encode_fast(text, _pretoken_pattern(extra))
        unverified = extra - self._verified
        if self._spot_checks_left > 0 or unverified:
            self._spot_checks_left = max(0, self._spot_checks_left - 1)
            ref = self._reference(text)
            if ids != ref:
                if not unverified:
                    warnings.warn(
                        f"fast tokenization differs from tokenizers for {self.path.name}; "
                        "using tokenizers only",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    self.fast = False
                self._refused |= unverified
                return ref
            self._verified |= unverified
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; identical to ``Tokenizer.encode_batch(texts)``."""
        out: list[list[int] | None] = [self._try_fast(text) for text in texts]
        slow = [i for i, ids in enumerate(out) if ids is None]
        if slow:
            encoded = self.tokenizer.encode_batch([texts[i] for i in slow], add_special_tokens=False)
            for i, enc in zip(slow, encoded):
                out[i] = enc.ids
        return out  # type: ignore[return-value]


_TOKENIZERS: dict[Path, TraceTokenizer] = {}


def get_tokenizer(path: str | os.PathLike | None = None) -> TraceTokenizer:
    """One shared :class:`TraceTokenizer` per file, so its piece cache is reused."""
    resolved = Path(path or default_tokenizer_path()).resolve()
    tok = _TOKENIZERS.get(resolved)
    if tok is None:
        tok = _TOKENIZERS[resolved] = TraceTokenizer(resolved)
    return tok


# ------------------------------------------------------------------ the interface


class WorkloadGroup(Protocol):
    """What a replay benchmark or the simulator needs from one group of responses.

    A static interface only (not ``runtime_checkable``): an isinstance check would
    evaluate the properties, i.e. tokenize or generate every response.
    """

    @property
    def group_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def lengths(self) -> list[int]: ...

    @property
    def response_token_ids(self) -> list[list[int]]: ...

    @property
    def num_samples(self) -> int: ...

    def head(self, n: int) -> WorkloadGroup: ...


class TraceTokenMismatchWarning(UserWarning):
    """A response tokenized to a different count than the trace's ``response_tokens``."""


# ------------------------------------------------------------------ trace groups


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
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                gid = str(rec["group_id"])
                responses = tuple(str(r) for r in rec["responses"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path.name}:{lineno}: not a trace record ({e})") from e
            counts = rec.get("response_tokens")
            expected = tuple(counts) if counts is not None else (None,) * len(responses)
            records.append((gid, rec.get("prompt"), responses, expected, rec.get("prompt_tokens")))
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


def tokenize_groups(groups: Iterable[TraceGroup]) -> int:
    """Tokenize every not-yet-tokenized response of ``groups``; returns the token count."""
    total = 0
    for g in groups:
        total += sum(len(ids) for ids in g.response_token_ids)
    return total


# ---------------------------------------------------------------------- selection


def select_groups(
    groups: Sequence[WorkloadGroup], spec: str | int | None = None, samples: int | None = None
) -> list[Any]:
    """Pick groups by a spec ("30": the first 30; "60:90": indices 60..89) and trim samples.

    ``spec`` None, "" or "all" keeps every group; range bounds may be omitted
    ("60:", ":30"). ``samples`` keeps the first n responses of each group
    (see :func:`take_samples`).
    """
    chosen = list(groups)[_parse_group_spec(spec, len(groups))]
    return take_samples(chosen, samples) if samples is not None else chosen


def _parse_group_spec(spec: str | int | None, available: int) -> slice:
    if spec is None:
        return slice(0, available)
    if isinstance(spec, bool):
        raise ValueError(f"invalid group spec {spec!r}")
    text = str(spec).strip()
    if text in ("", "all"):
        return slice(0, available)
    usage = "expected a count like '30' or an index range like '60:90'"
    if ":" in text:
        parts = text.split(":")
        if len(parts) != 2:
            raise ValueError(f"invalid group spec {text!r}: {usage}")
        try:
            start = int(parts[0]) if parts[0].strip() else 0
            end = int(parts[1]) if parts[1].strip() else available
        except ValueError:
            raise ValueError(f"invalid group spec {text!r}: {usage}") from None
        if start < 0 or end < 0:
            raise ValueError(f"invalid group spec {text!r}: indices must be >= 0")
        if start >= end:
            raise ValueError(f"group range {text!r} is empty: start must be below end")
        if end > available:
            raise ValueError(f"group range {text!r} ends past the last group: only {available} available")
        return slice(start, end)
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"invalid group spec {text!r}: {usage}") from None
    if count < 1:
        raise ValueError(f"invalid group spec {text!r}: the count must be at least 1")
    if count > available:
        raise ValueError(f"group spec {text!r} asks for {count} groups but only {available} are available")
    return slice(0, count)


def take_samples(groups: Sequence[WorkloadGroup], n: int) -> list[Any]:
    """The first ``n`` responses of every group; a group with fewer is an error, not a silent skip."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"samples must be a positive integer, got {n!r}")
    short = [g for g in groups if g.num_samples < n]
    if short:
        first = short[0]
        raise ValueError(
            f"samples={n} but group {first.group_id!r} has only {first.num_samples} responses "
            f"({len(short)} of {len(groups)} groups have fewer than {n}; "
            f"the smallest has {min(g.num_samples for g in short)})"
        )
    return [g.head(n) for g in groups]


def scale_lengths(
    lengths_by_group: Sequence[Sequence[int]], max_len: int, quantile: float = 0.99
) -> list[list[int]]:
    """Rescale lengths so that their ``quantile`` lands on ``max_len``; clip to [1, max_len].

    Rule: one factor ``max_len / q`` for all responses, where ``q`` is the given
    quantile of all lengths pooled. The default p99 keeps the shape (CVs, ratios,
    ranks) and lets ~1% of responses hit the cap, as responses truncated at
    ``max_tokens`` do in real rollouts; ``quantile=1.0`` maps the longest response
    exactly to ``max_len`` and truncates nothing.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    pooled = np.concatenate([np.asarray(g, dtype=np.float64) for g in lengths_by_group])
    if pooled.size == 0:
        return [[] for _ in lengths_by_group]
    q = float(np.quantile(pooled, quantile))
    factor = max_len / max(q, 1e-12)
    return [
        np.clip(np.rint(np.asarray(g, dtype=np.float64) * factor), 1, max_len).astype(np.int64).tolist()
        for g in lengths_by_group
    ]


# --------------------------------------------------------------------- statistics


def _lengths_of(groups: Sequence[Any]) -> list[np.ndarray]:
    out = []
    for g in groups:
        arr = np.asarray(g.lengths if hasattr(g, "lengths") else g, dtype=np.float64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError("every group needs at least one length")
        out.append(arr)
    return out


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties sharing their average rank (what Spearman's rho needs)."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends + 1) / 2.0  # mean of ranks start+1 .. end
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); NaN if either side is constant."""
    rx, ry = _average_ranks(np.asarray(x, np.float64)), _average_ranks(np.asarray(y, np.float64))
    rx -= rx.mean()
    ry -= ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")


def trace_stats(lengths_by_group: Sequence[Any]) -> dict[str, float]:
    """The README's length figures for groups of lengths (sequences, or objects with ``lengths``).

    These are the properties Seer exploits (similar lengths within a group, an
    early response predicting the longest), so a workload must reproduce them to
    be a fair benchmark. Population standard deviations; a one-response group has
    within-CV 0 and longest/mean 1. Keys: groups, responses, mean_len, median_len,
    p90_len, max_len, within_cv, across_cv, within_share, longest_over_mean,
    spearman_first_longest (NaN with fewer than 2 groups or constant inputs).
    """
    groups = _lengths_of(lengths_by_group)
    if not groups:
        raise ValueError("trace_stats needs at least one group")
    pooled = np.concatenate(groups)
    means = np.array([g.mean() for g in groups])
    within_ss = sum(float(((g - g.mean()) ** 2).sum()) for g in groups)
    total_ss = float(((pooled - pooled.mean()) ** 2).sum())
    return {
        "groups": float(len(groups)),
        "responses": float(pooled.size),
        "mean_len": float(pooled.mean()),
        "median_len": float(np.median(pooled)),
        "p90_len": float(np.percentile(pooled, 90)),
        "max_len": float(pooled.max()),
        "within_cv": float(np.mean([g.std() / g.mean() for g in groups])),
        "across_cv": float(means.std() / means.mean()),
        "within_share": within_ss / total_ss if total_ss > 0 else float("nan"),
        "longest_over_mean": float(np.mean([g.max() / g.mean() for g in groups])),
        "spearman_first_longest": (
            spearman([g[0] for g in groups], [g.max() for g in groups]) if len(groups) > 1 else float("nan")
        ),
    }


_FNV_OFFSET = np.uint64(14695981039346656037)
_FNV_PRIME = np.uint64(1099511628211)


def _ngram_hashes(words: np.ndarray, n: int) -> np.ndarray:
    """Distinct 64-bit hashes of the n-grams of an integer sequence (FNV-style, vectorised)."""
    m = len(words) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    h = np.full(m, _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            h = (h ^ words[k : k + m]) * _FNV_PRIME
    return np.unique(h)


def _word_sequences(groups: Sequence[Any]) -> list[list[np.ndarray]]:
    """Each group's responses as integer arrays: hashed words of texts, or token ids as they are."""
    out = []
    for g in groups:
        if hasattr(g, "responses"):
            items: Sequence[Any] = g.responses
        elif hasattr(g, "response_token_arrays"):
            items = g.response_token_arrays()
        elif hasattr(g, "response_token_ids"):
            items = g.response_token_ids
        else:
            items = g
        seqs = []
        for item in items:
            if isinstance(item, str):
                words = item.split()
                seqs.append(np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64))
            else:
                seqs.append(np.asarray(item, dtype=np.int64).view(np.uint64))
        out.append(seqs)
    return out


def ngram_overlap(groups: Sequence[Any], n: int = 8) -> dict[str, float]:
    """How much of a response's content appears in its siblings versus in other groups.

    Grouped speculative decoding drafts from siblings, so this is the head-room it
    has. For each response: the share of its distinct word n-grams that occur in
    another response of its group (``within``), and the share that occur in some
    response of one other group, the next one in order (``cross``); both averaged
    over responses with at least one n-gram. ``cross_expected`` averages the cross
    share over the choice of the other group instead (exact, via per-n-gram group
    counts). Groups may be :class:`TraceGroup` (whitespace words of the texts),
    objects with ``response_token_ids`` (tokens are the words), or plain lists of
    texts / token sequences. N-grams are 64-bit hashes; collisions are negligible.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    empty = np.zeros(0, np.uint64)
    # Per group: the distinct n-grams of each response, concatenated, with owners.
    flat: list[tuple[np.ndarray, np.ndarray, int]] = []
    for seqs in _word_sequences(groups):
        hashed = [_ngram_hashes(s, n) for s in seqs]
        sizes = np.array([h.size for h in hashed], dtype=np.int64)
        owners = np.repeat(np.arange(len(hashed)), sizes)
        flat.append((np.concatenate(hashed) if hashed else empty, owners, len(hashed)))
    # Work on each group's distinct n-grams (sorted, so look-ups stay cache friendly)
    # and map back to responses through the inverse index.
    uniq = [np.unique(h, return_inverse=True, return_counts=True) for h, _, _ in flat]
    group_sets = [u for u, _, _ in uniq]
    all_u, all_c = np.unique(np.concatenate(group_sets) if group_sets else empty, return_counts=True)
    num_groups = len(flat)

    def per_response(flags: np.ndarray, owners: np.ndarray, count: int) -> np.ndarray:
        totals = np.bincount(owners, minlength=count)
        hits = np.bincount(owners, weights=flags.astype(np.float64), minlength=count)
        return hits[totals > 0] / totals[totals > 0]

    within, cross, expected = [], [], []
    for gi, ((h, owners, count), (u, inverse, counts)) in enumerate(zip(flat, uniq)):
        if h.size == 0:
            continue
        within.append(per_response((counts >= 2)[inverse], owners, count))
        if num_groups > 1:
            other = group_sets[(gi + 1) % num_groups]
            if other.size:
                pos = np.minimum(np.searchsorted(other, u), other.size - 1)
                found = other[pos] == u
            else:
                found = np.zeros(u.size, dtype=bool)
            cross.append(per_response(found[inverse], owners, count))
            others = all_c[np.searchsorted(all_u, u)] - 1
            expected.append(per_response((others / (num_groups - 1))[inverse], owners, count))

    def mean(parts: list[np.ndarray]) -> float:
        joined = np.concatenate(parts) if parts else empty
        return float(joined.mean()) if joined.size else float("nan")

    return {
        "within": mean(within),
        "cross": mean(cross),
        "cross_expected": mean(expected),
        "responses": float(sum(p.size for p in within)),
    }


# ------------------------------------------------------------- synthetic workload

# Fit note (lengths). log L = log mu_g + s_g * z - s_g^2 / 2 with z ~ N(0, 1):
# group means log mu_g ~ N(0, across_sigma^2), and a per-group spread
# s_g = within_sigma * exp(within_sigma_spread * N(0, 1)), because groups differ in
# how variable they are (in the trace the per-group sd of log length is 0.34 +- 0.09).
# Chosen by grid search (across 0.30..0.55, within 0.25..0.40, spread 0..0.5, then a
# finer grid averaged over two seeds of 8,000 groups) minimising the summed squared
# relative error of the five length figures against README_FIGURES at 50 samples
# per group (the trace's group size), after p99 -> max_len scaling and clipping.
# Population figures of the chosen point (4,000 groups x 50, three seeds, any of the
# paper's max_len): within_cv 0.33, across_cv 0.44-0.46, within_share 0.38-0.41,
# longest/mean 1.97-1.99, Spearman 0.68-0.70. A 90-group workload (the trace's
# size) scatters about as much as the trace itself would: Spearman sd ~0.06.
# Figures that are maxima over a group depend on its size. At 16 samples the model
# gives within_cv 0.32, longest/mean 1.71, Spearman 0.71, and the trace cut to its
# first 16 responses 0.32, 1.68, 0.79 (at 8: 0.30, 1.54, 0.73 against 0.30, 1.50, 0.80).
# With the same p99 the synthetic mean is ~10% below the trace's (its tail is a
# little heavier): p99/mean 3.2 against the trace's 2.9.
#
# Fit note (content). A response is a chain of phrase_len-token segments, each a
# phrase from its group's pool (prob. group_phrase_prob), from a workload-wide pool
# (global_phrase_prob) or fresh random tokens. Pools are sized so that any one
# sibling uses a given phrase with probability phrase_reuse: the overlap then grows
# with the number of siblings as in the trace (within 13% / 18% / 29% at 8 / 16 /
# 46 samples, cross 0.8% / 1.2% / 1.8%) and does not depend on the length scale.
# Only 8-grams wholly inside a shared phrase repeat, so
# within ~ (p_group + p_global) * (phrase_len - 7) / phrase_len * (1 - (1 - reuse)^(G-1)).
FIT: dict[str, float] = {
    "across_sigma": 0.44,
    "within_sigma": 0.325,
    "within_sigma_spread": 0.25,
    "group_phrase_prob": 0.36,
    "global_phrase_prob": 0.026,
    "phrase_reuse": 0.08,
}


@lru_cache(maxsize=32)
def _population_quantile(across: float, within: float, spread: float, quantile: float) -> float:
    """Quantile of the generative length distribution (median group mean = 1), by fixed-seed Monte Carlo.

    Scaling by the population quantile (not the sample's) keeps a small workload at
    the same scale as a large one drawn with the same seed.
    """
    rng = np.random.default_rng(0x5EE12)
    size = 1 << 18
    mu = across * rng.standard_normal(size)
    s = within * np.exp(spread * rng.standard_normal(size))
    return float(np.quantile(np.exp(mu + s * rng.standard_normal(size) - s * s / 2), quantile))


def _pool_size(mean_len: float, phrase_len: int, prob: float, reuse: float) -> int:
    """Phrases in a pool from which a response of ``mean_len`` picks each with probability ``reuse``."""
    draws = mean_len / phrase_len * prob
    return max(1, math.ceil(draws / -math.log1p(-reuse)))


@dataclass(frozen=True, eq=False)
class SyntheticGroup:
    """A generated group: lengths up front, token ids generated on demand.

    Token ids of response i depend only on (seed, group index, i), so ``head(n)``
    views and workloads with more samples agree on the shared prefix.
    """

    group_id: str
    index: int
    lengths_full: tuple[int, ...]
    seed: int
    vocab_size: int | None = None
    prompt_len: int = 128
    phrase_len: int = 32
    group_phrase_prob: float = FIT["group_phrase_prob"]
    global_phrase_prob: float = FIT["global_phrase_prob"]
    group_pool_size: int = 64
    global_pool_size: int = 16
    first_token_id: int = 3
    samples: int | None = None
    _cache: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def num_samples(self) -> int:
        return self.samples if self.samples is not None else len(self.lengths_full)

    @property
    def lengths(self) -> list[int]:
        return list(self.lengths_full[: self.num_samples])

    def head(self, n: int) -> SyntheticGroup:
        """The first ``n`` responses, sharing generated token ids."""
        if not 1 <= n <= self.num_samples:
            raise ValueError(f"group {self.group_id!r} has {self.num_samples} responses, asked for {n}")
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "_cache"}
        return SyntheticGroup(**{**fields, "samples": n, "_cache": self._cache})

    def _rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.index, *stream])

    def _vocab(self) -> int:
        if self.vocab_size is None:
            raise ValueError("this synthetic workload was made without vocab_size, so it has lengths only")
        return self.vocab_size

    def _pools(self) -> tuple[np.ndarray, np.ndarray]:
        """This group's phrase pool and the workload-wide one (the same for every group of a seed)."""
        pools = self._cache.get("pools")
        if pools is None:
            vocab, low, width = self._vocab(), self.first_token_id, self.phrase_len
            shared = np.random.default_rng([self.seed, 0x610BA1, self.global_pool_size])
            glob = shared.integers(low, vocab, size=(self.global_pool_size, width))
            own = self._rng(1).integers(low, vocab, size=(self.group_pool_size, width))
            pools = self._cache["pools"] = (own, glob)
        return pools

    @property
    def prompt_token_ids(self) -> list[int]:
        """A deterministic random prompt of ``prompt_len`` tokens."""
        ids = self._cache.get("prompt")
        if ids is None:
            ids = self._cache["prompt"] = (
                self._rng(2).integers(self.first_token_id, self._vocab(), size=self.prompt_len).tolist()
            )
        return list(ids)

    def _response(self, i: int) -> np.ndarray:
        own, glob = self._pools()
        length = self.lengths_full[i]
        rng = self._rng(3, i)
        segments = -(-length // self.phrase_len)
        kind = rng.random(segments)
        rows = rng.integers(self.first_token_id, self._vocab(), size=(segments, self.phrase_len))
        use_glob = kind < self.global_phrase_prob
        use_own = ~use_glob & (kind < self.global_phrase_prob + self.group_phrase_prob)
        rows[use_own] = own[rng.integers(0, len(own), size=int(use_own.sum()))]
        rows[use_glob] = glob[rng.integers(0, len(glob), size=int(use_glob.sum()))]
        out = rows.reshape(-1)[:length].astype(np.int32)
        out.flags.writeable = False
        return out

    def response_token_arrays(self) -> list[np.ndarray]:
        """Token ids per response as read-only int32 arrays (the cached form: 4 bytes a token)."""
        cache = self._cache.setdefault("responses", {})
        for i in range(self.num_samples):
            if i not in cache:
                cache[i] = self._response(i)
        return [cache[i] for i in range(self.num_samples)]

    @property
    def response_token_ids(self) -> list[list[int]]:
        """Token ids per response, exactly ``lengths[i]`` long, siblings sharing phrases.

        Fresh lists on every call: at the paper's scales the ids are cached as int32
        arrays, since lists of Python ints would take ~9x the memory.
        """
        return [a.tolist() for a in self.response_token_arrays()]


def synthetic_workload(
    num_groups: int,
    samples: int,
    max_len: int,
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    across_sigma: float = FIT["across_sigma"],
    within_sigma: float = FIT["within_sigma"],
    within_sigma_spread: float = FIT["within_sigma_spread"],
    scale_quantile: float = 0.99,
    prompt_len: int = 128,
    phrase_len: int = 32,
    group_phrase_prob: float = FIT["group_phrase_prob"],
    global_phrase_prob: float = FIT["global_phrase_prob"],
    phrase_reuse: float = FIT["phrase_reuse"],
    first_token_id: int = 3,
) -> list[SyntheticGroup]:
    """Groups whose lengths (and optionally tokens) have the trace's statistics at any scale.

    Log-normal group means and log-normal within-group spread (see the fit notes
    above ``FIT``); lengths are scaled so the population's ``scale_quantile`` lands
    on ``max_len`` (the rule :func:`scale_lengths` uses for traces) and clipped to
    [1, max_len]. Deterministic for a seed, and group g is the same whatever
    ``num_groups`` is. ``vocab_size`` enables ``prompt_token_ids`` and
    ``response_token_ids``, with ids in [first_token_id, vocab_size) so that
    special tokens such as EOS never occur inside a response.
    """
    if num_groups < 1 or samples < 1 or max_len < 1:
        raise ValueError(f"need num_groups, samples, max_len >= 1 (got {num_groups}, {samples}, {max_len})")
    if min(group_phrase_prob, global_phrase_prob) < 0 or group_phrase_prob + global_phrase_prob > 1:
        raise ValueError("group_phrase_prob and global_phrase_prob must be >= 0 and sum to at most 1")
    if not 0.0 < phrase_reuse < 1.0:
        raise ValueError(f"phrase_reuse must be in (0, 1), got {phrase_reuse}")
    if phrase_len < 1 or prompt_len < 0 or first_token_id < 0:
        raise ValueError("phrase_len must be >= 1, prompt_len and first_token_id >= 0")
    if vocab_size is not None and vocab_size <= first_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no token ids at or above {first_token_id}")
    scale = max_len / _population_quantile(across_sigma, within_sigma, within_sigma_spread, scale_quantile)
    population_mean = min(scale * math.exp(across_sigma**2 / 2), max_len)
    global_pool = _pool_size(population_mean, phrase_len, global_phrase_prob, phrase_reuse)
    groups = []
    for g in range(num_groups):
        rng = np.random.default_rng([seed, g, 0])
        mu = across_sigma * rng.standard_normal()
        s = within_sigma * math.exp(within_sigma_spread * rng.standard_normal())
        z = rng.standard_normal(samples)
        lengths = np.clip(np.rint(np.exp(mu + s * z - s * s / 2) * scale), 1, max_len).astype(np.int64)
        group_mean = min(scale * math.exp(mu), max_len)
        groups.append(
            SyntheticGroup(
                group_id=f"synthetic-{seed}-{g}",
                index=g,
                lengths_full=tuple(int(x) for x in lengths),
                seed=seed,
                vocab_size=vocab_size,
                prompt_len=prompt_len,
                phrase_len=phrase_len,
                group_phrase_prob=group_phrase_prob,
                global_phrase_prob=global_phrase_prob,
                group_pool_size=_pool_size(group_mean, phrase_len, group_phrase_prob, phrase_reuse),
                global_pool_size=global_pool,
                first_token_id=first_token_id,
            )
        )
    return groups


# ---------------------------------------------------------------------------- CLI


def _format_value(key: str, value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if key in ("groups", "responses"):
        return f"{int(value):,}"
    if key.endswith("_len"):
        return f"{value:,.0f}"
    if key.startswith("ngram"):
        return f"{100 * value:.1f}%"
    return f"{value:.3f}"


def format_table(figures: dict[str, float], reference: dict[str, float] | None = README_FIGURES) -> str:
    """Figures as a plain-text table, beside the Qwen3 trace README's values where it has one."""
    rows = [(FIGURE_LABELS.get(k, k), _format_value(k, v), k) for k, v in figures.items()]
    width = max(len(r[0]) for r in rows)
    head = f"{'figure':<{width}}  {'value':>9}"
    lines = [head + ("   README (qwen3)" if reference else ""), "-" * (len(head) + (17 if reference else 0))]
    for label, value, key in rows:
        line = f"{label:<{width}}  {value:>9}"
        if reference and key in reference:
            ref = reference[key]
            shown = f"{100 * ref:.0f}%" if key.startswith("ngram") else f"{ref:.2f}"
            line += f"   {shown:>15}"
        lines.append(line)
    return "\n".join(lines)


def _cmd_trace_stats(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    groups: list[Any]
    if args.synthetic:
        if args.file is not None:
            raise ValueError("give either a trace FILE or --synthetic, not both")
        if args.max_len is None:
            raise ValueError("--synthetic needs --max-len (e.g. 65536, 40960 or 98304)")
        try:
            num_groups = int(args.groups) if args.groups else 90
        except ValueError:
            raise ValueError(f"--groups for --synthetic is a count, got {args.groups!r}") from None
        samples = args.samples or 50
        groups = synthetic_workload(num_groups, samples, args.max_len, args.seed, vocab_size=args.vocab_size)
        title = (
            f"synthetic workload: {num_groups} groups x {samples}, max_len {args.max_len}, seed {args.seed}"
        )
        stats_input: Sequence[Any] = groups
    else:
        if args.file is None:
            raise ValueError("give a trace FILE (path or name in the traces folder) or --synthetic")
        try:
            path = resolve_trace_path(args.file)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        groups = select_groups(load_trace(path), args.groups, args.samples)
        title = f"{path.name}: groups {args.groups or 'all'}, samples {args.samples or 'all'}"
        stats_input = groups
        if args.max_len is not None:
            stats_input = scale_lengths([g.lengths for g in groups], args.max_len)
            title += f", lengths scaled p99 -> {args.max_len}"
    want_ngrams = args.ngrams if args.ngrams is not None else not args.synthetic
    figures = trace_stats(stats_input)
    if want_ngrams:
        overlap = ngram_overlap(groups, n=args.n)
        figures["ngram_within"] = overlap["within"]
        figures["ngram_cross"] = overlap["cross"]
    print(title)
    print(format_table(figures))
    print(f"({time.perf_counter() - start:.1f}s)", file=sys.stderr)
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``trace-stats`` on the ``seer_engine`` command's subparsers."""
    p = subparsers.add_parser(
        "trace-stats",
        help="length and n-gram figures of a rollout trace or a synthetic workload",
        description="Print the figures of ../shared/traces/README.md for a trace file "
        "(path, or name in the traces folder) or for a synthetic workload.",
    )
    p.add_argument("file", nargs="?", default=None, help="trace file (.jsonl.gz): path or name")
    p.add_argument("--groups", default=None, help="'30' (first 30) or '60:90'; with --synthetic a count (90)")
    p.add_argument(
        "--samples", type=int, default=None, help="first N responses of each group (synthetic: 50)"
    )
    p.add_argument("--synthetic", action="store_true", help="a synthetic workload instead of a trace")
    p.add_argument("--max-len", type=int, default=None, help="scale lengths so their p99 is this")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    p.add_argument("--vocab-size", type=int, default=32000, help="synthetic token ids (n-grams only)")
    p.add_argument("--n", type=int, default=8, help="n-gram size (default 8)")
    ngram = p.add_mutually_exclusive_group()
    ngram.add_argument(
        "--ngrams",
        dest="ngrams",
        action="store_true",
        default=None,
        help="compute n-gram overlap (default for traces; for --synthetic it generates every token)",
    )
    ngram.add_argument("--no-ngrams", dest="ngrams", action="store_false", help="skip n-gram overlap")
    p.set_defaults(func=_cmd_trace_stats)
    return p
