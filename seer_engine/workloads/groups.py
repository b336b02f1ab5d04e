"""What every workload source offers (:class:`WorkloadGroup`) and the operations on any
of them: pick groups, keep the first responses, rescale lengths.

Rollout benchmarks replay real responses and the cluster simulator needs realistic
group-structured lengths at the scale of the setup being modelled; both consume this
one small interface, so a trace or the synthetic generator can feed either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


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
