"""Rollout reports: the per-policy figures as JSON and one PNG of the timelines."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from seer_engine.rollout.rollout import RolloutResult

REPORT_KEYS = (
    "throughput_tokens_per_s",
    "makespan_s",
    "tail_s",
    "preemptions",
    "recomputed_tokens",
    "steps",
    "idle_fraction",
    "accepted_tokens_per_step",
)


def policy_summary(result: RolloutResult) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(result.metrics).items()}


def format_table(results: dict[str, RolloutResult]) -> str:
    cols = (
        "policy",
        "tokens/s",
        "makespan_s",
        "tail_s",
        "preempt",
        "recomputed",
        "migrations",
        "steps",
        "idle",
    )
    lines = ["  ".join(f"{c:>11}" for c in cols)]
    for name, r in results.items():
        m = r.metrics
        row = (name, f"{m.throughput_tokens_per_s:.1f}", f"{m.makespan_s:.2f}", f"{m.tail_s:.2f}",
               m.preemptions, m.recomputed_tokens, m.migrations, m.steps,
               f"{m.idle_fraction:.1%}")  # fmt: skip
        lines.append("  ".join(f"{str(v):>11}" for v in row))
    return "\n".join(lines)


def write_report(out_dir: Path, results: dict[str, RolloutResult], meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "policies": {name: policy_summary(r) for name, r in results.items()}}
    base = results.get("baseline")
    if base is not None and base.metrics.throughput_tokens_per_s:
        report["vs_baseline"] = {
            name: {
                "throughput_x": round(
                    r.metrics.throughput_tokens_per_s / base.metrics.throughput_tokens_per_s, 3
                ),
                "tail_reduction": round(1 - r.metrics.tail_s / base.metrics.tail_s, 3)
                if base.metrics.tail_s
                else None,
            }
            for name, r in results.items()
        }
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot_timelines(results, out_dir / "report.png")
    return path


def plot_timelines(results: dict[str, RolloutResult], path: Path) -> None:
    """One row per policy: running requests per instance (left), KV usage (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 2.4 * len(results)), squeeze=False, sharex=True)
    for row, (name, result) in enumerate(results.items()):
        ax_run, ax_kv = axes[row]
        for i, timeline in enumerate(result.timelines):
            t = [p.time for p in timeline]
            ax_run.step(t, [p.running for p in timeline], where="post", label=f"instance {i}", lw=0.9)
            ax_kv.plot(t, [100 * p.kv_usage for p in timeline], label=f"instance {i}", lw=0.9)
        m = result.metrics
        ax_run.set_title(f"{name}: {m.throughput_tokens_per_s:.0f} tok/s, makespan {m.makespan_s:.1f}s, "
                         f"tail {m.tail_s:.1f}s", fontsize=9)  # fmt: skip
        ax_run.set_ylabel("running")
        ax_kv.set_ylabel("KV used %")
        ax_kv.set_ylim(0, 105)
    axes[0][0].legend(fontsize=7, loc="upper right")
    axes[-1][0].set_xlabel("time (s, per-instance clocks)")
    axes[-1][1].set_xlabel("time (s, per-instance clocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
