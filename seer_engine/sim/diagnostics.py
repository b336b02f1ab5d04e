"""The paper's diagnostics of a rollout (measured on its veRL baseline), computed for a
simulated one, so a workload's calibration can be checked against them.

Seer (Qwen2-VL-72B, one baseline iteration): 13,686 preemptions; instances finish
spread across 70% of the iteration, idle 37% on average; the last 10% of requests
take up to ~50% of the rollout; the last 5% of requests to finish are among the
longest 15% yet start on average at 42% of the iteration.
"""

from __future__ import annotations

import math

from seer_engine.rollout.metrics import RolloutResult

PAPER_BASELINE: dict[str, float] = {
    "preemptions": 13_686,  # Qwen2-VL-72B only
    "idle_share": 0.37,
    "tail_share": 0.50,  # "up to"
    "last5_start_share": 0.42,
    "last5_resume_share": 0.42,  # the paper's "start", read as the start of the run that finished
    "last5_among_longest15": 1.0,  # "are among the longest 15%"
    "finish_spread_share": 0.70,
}

LABELS = {
    "preemptions": "preemptions per iteration",
    "idle_share": "mean idle share per instance",
    "tail_share": "tail (last 10% of requests) share of makespan",
    "last5_start_share": "last 5% of requests first start at (share)",
    "last5_resume_share": "last 5% of requests last (re)start at (share)",
    "last5_among_longest15": "last 5% that are among the longest 15%",
    "finish_spread_share": "instances finish spread (share of makespan)",
}


def diagnostics(result: RolloutResult) -> dict[str, float]:
    """The paper's baseline diagnostics of one rollout (start times need modeled engines:
    ``result.started_at``; without them those figures are NaN)."""
    m = result.metrics
    flat = [s for group in result.samples.values() for s in group]
    makespan = m.makespan_s or math.nan
    by_finish = sorted(flat, key=lambda s: s.finished_at or 0.0)
    last = by_finish[len(by_finish) - max(1, math.ceil(0.05 * len(flat))) :]
    by_length = sorted(flat, key=lambda s: s.num_generated)
    longest = {s.key for s in by_length[len(by_length) - max(1, math.ceil(0.15 * len(flat))) :]}
    starts = [result.started_at[s.key] for s in last if s.key in result.started_at]
    resumes = [result.resumed_at[s.key] for s in last if s.key in result.resumed_at]
    finish_by_instance: dict[int, float] = {}
    for s in flat:
        if s.instance is not None:
            end = max(finish_by_instance.get(s.instance, 0.0), s.finished_at or 0.0)
            finish_by_instance[s.instance] = end
    ends = list(finish_by_instance.values())
    return {
        "preemptions": float(m.preemptions),
        "idle_share": m.idle_fraction,
        "tail_share": m.tail_s / makespan,
        "last5_start_share": sum(starts) / len(starts) / makespan if starts else math.nan,
        "last5_resume_share": sum(resumes) / len(resumes) / makespan if resumes else math.nan,
        "last5_among_longest15": sum(s.key in longest for s in last) / len(last),
        "finish_spread_share": (max(ends) - min(ends)) / makespan if ends else math.nan,
    }


def format_diagnostics(setup: str, figures: dict[str, float]) -> str:
    lines = [f"{setup}: baseline diagnostics (paper: its veRL baseline, Qwen2-VL-72B)",
             f"  {'figure':<48} {'simulated':>10} {'paper':>10}"]  # fmt: skip
    for key, label in LABELS.items():
        value, paper = figures.get(key, math.nan), PAPER_BASELINE[key]
        fmt = (lambda v: f"{v:,.0f}") if key == "preemptions" else (lambda v: f"{v:.0%}")
        lines.append(f"  {label:<48} {fmt(value):>10} {fmt(paper):>10}")
    return "\n".join(lines)
