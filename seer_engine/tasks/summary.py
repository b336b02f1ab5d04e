"""What a graded rollout looked like: rewards, and output lengths within and across groups.

Seer's scheduling rests on lengths being similar within a group and different across
groups; GRPO learns only from groups whose rewards differ. This summary reports
both for a rollout of real model outputs, with the same length figures that
``seer_engine trace-stats`` gives for a trace (``workloads.stats.trace_stats``), so a
model's own rollouts can be set beside the traces.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from seer_engine.workloads.stats import trace_stats

_LENGTH_KEYS = (
    "mean_len", "median_len", "p90_len", "max_len", "within_cv", "across_cv", "within_share",
    "longest_over_mean", "spearman_first_longest",
)  # fmt: skip


def _std(xs: Sequence[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def rollout_summary(
    lengths: Sequence[Sequence[int]],
    rewards: Sequence[Sequence[float]] | None = None,
    names: Sequence[str] | None = None,
    finish_reasons: Sequence[str | None] = (),
) -> dict[str, Any]:
    """Per-group and across-group figures of a rollout (population standard deviations).

    ``lengths[g]`` (and ``rewards[g]``) are the output lengths (rewards) of group g's
    responses. Within-group spread: the mean over groups of each group's length std;
    across-group spread: the std of the group means.
    """
    if not lengths or any(len(g) == 0 for g in lengths):
        raise ValueError("a rollout summary needs at least one group, each with a response")
    if rewards is not None and [len(r) for r in rewards] != [len(g) for g in lengths]:
        raise ValueError("rewards and lengths must have the same groups and sizes")
    names = list(names) if names is not None else [f"g{i}" for i in range(len(lengths))]
    per_group = []
    for k, g in enumerate(lengths):
        row: dict[str, Any] = {
            "group": names[k], "n": len(g), "mean_len": round(sum(g) / len(g), 2), "max_len": max(g),
            "min_len": min(g), "std_len": round(_std(g), 2),
        }  # fmt: skip
        if rewards is not None:
            r = rewards[k]
            row["mean_reward"] = round(sum(r) / len(r), 4)
            row["mixed"] = len(set(r)) > 1
        per_group.append(row)
    figures = trace_stats(lengths)
    means = [row["mean_len"] for row in per_group]
    out: dict[str, Any] = {
        "groups": len(lengths),
        "responses": sum(len(g) for g in lengths),
        "length": {k: round(figures[k], 4) if math.isfinite(figures[k]) else None for k in _LENGTH_KEYS},
        "within_group_std": round(sum(row["std_len"] for row in per_group) / len(per_group), 2),
        "across_group_std": round(_std(means), 2),
        "finish_reasons": dict(Counter(r or "none" for r in finish_reasons)),
        "per_group": per_group,
    }
    if rewards is not None:
        flat = [x for r in rewards for x in r]
        out["mean_reward"] = round(sum(flat) / len(flat), 4)
        out["mixed_groups"] = sum(row["mixed"] for row in per_group)
    return out


def format_summary(summary: dict[str, Any], per_group: bool = True) -> str:
    """The summary as a few lines of text (a table of groups first, if asked)."""
    lines = []
    rewarded = "mean_reward" in summary
    if per_group:
        head = f"{'group':<16} {'n':>3} {'mean_len':>9} {'max_len':>8} {'std_len':>8}"
        lines.append(head + (f" {'reward':>7} {'mixed':>5}" if rewarded else ""))
        for row in summary["per_group"]:
            line = (f"{row['group']:<16} {row['n']:>3} {row['mean_len']:>9.1f} {row['max_len']:>8} "
                    f"{row['std_len']:>8.1f}")  # fmt: skip
            if rewarded:
                line += f" {row['mean_reward']:>7.3f} {'yes' if row['mixed'] else 'no':>5}"
            lines.append(line)
    length = summary["length"]
    if rewarded:
        lines.append(
            f"accuracy (mean reward) {summary['mean_reward']:.3f} over {summary['responses']} responses; "
            f"groups with mixed rewards {summary['mixed_groups']}/{summary['groups']}"
        )
    finish = ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items()))
    lines.append(
        f"output length: mean {length['mean_len']:.1f}, median {length['median_len']:.0f}, "
        f"max {length['max_len']:.0f}" + (f" (finish: {finish})" if finish else "")
    )
    lines.append(
        f"spread within groups: std {summary['within_group_std']:.1f} tokens (CV {_f(length['within_cv'])}); "
        f"across groups: std of group means {summary['across_group_std']:.1f} "
        f"(CV {_f(length['across_cv'])}); within-group share of variance {_f(length['within_share'])}"
    )
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
