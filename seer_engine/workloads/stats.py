"""The figures of ``../shared/traces/README.md``: length statistics and n-gram overlap.

These are the properties Seer exploits (similar lengths within a group, an early
response predicting the longest, siblings sharing content), so a workload must
reproduce them to be a fair benchmark.

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

from collections.abc import Sequence
from typing import Any

import numpy as np

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
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2.0)[inverse.reshape(-1)]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson on average ranks); NaN if either side is constant.

    numpy only: scipy (``scipy.stats.spearmanr``) is not a dependency, and adding it for
    this one figure is not worth its install size.
    """
    rx, ry = _average_ranks(np.asarray(x, np.float64)), _average_ranks(np.asarray(y, np.float64))
    if rx.shape != ry.shape:
        raise ValueError(f"spearman needs sequences of equal length, got {rx.size} and {ry.size}")
    return float(np.corrcoef(rx, ry)[0, 1]) if rx.std() > 0 and ry.std() > 0 else float("nan")


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
