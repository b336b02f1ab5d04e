"""Rollout reports: the per-policy figures as JSON and one PNG of the timelines."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from seer_engine.rollout.metrics import RolloutResult

REPORT_KEYS = (
    "throughput_tokens_per_s",
    "makespan_s",
    "tail_s",
    "preemptions",
    "recomputed_tokens",
    "steps",
    "idle_fraction",
    "accepted_tokens_per_step",
    "accepted_tokens_per_step_thirds",
    "draft_tokens_verified",
    "drafter_s",
    "verification_overhead",
)


def writable_dir(path: str | Path, flag: str) -> Path:
    """``path`` as a directory this run can write into (made if missing). Checked before
    the run, so a mistyped or read-only path fails at once, not after the work."""
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} is not a directory this run can write to: {e}") from None
    return out


def policy_summary(result: RolloutResult) -> dict:
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(result.metrics).items()}
    summary["pool_time_share_per_instance"] = round(pool_time_share(result.metrics), 6)
    return summary


def pool_time_share(m) -> float:
    """Instance time spent saving and loading pool KV, per instance, as a share of the
    makespan (Seer reports migration under 0.1% of rollout time per instance)."""
    instances = max(1, len(m.instance_busy_s))
    return (m.pool_save_s + m.pool_load_s) / instances / m.makespan_s if m.makespan_s else 0.0


def format_table(results: dict[str, RolloutResult]) -> str:
    cols = (
        "policy",
        "tokens/s",
        "makespan_s",
        "tail_s",
        "preempt",
        "recomputed",
        "migrations",
        "pool_loads",
        "pool_time",
        "steps",
        "idle",
        "acc/step",
        "early/mid/tail",
    )
    width = max(11, *(len(n) for n in results))
    lines = ["  ".join(f"{c:>{width}}" for c in cols)]
    for name, r in results.items():
        m = r.metrics
        thirds = "/".join(f"{x:.2f}" for x in m.accepted_tokens_per_step_thirds)
        row = (name, f"{m.throughput_tokens_per_s:.1f}", f"{m.makespan_s:.2f}", f"{m.tail_s:.2f}",
               m.preemptions, m.recomputed_tokens, m.migrations, m.pool_loads,
               f"{pool_time_share(m):.2%}", m.steps,
               f"{m.idle_fraction:.1%}", f"{m.accepted_tokens_per_step:.2f}", thirds)  # fmt: skip
        lines.append("  ".join(f"{str(v):>{width}}" for v in row))
    return "\n".join(lines)


def write_report(
    out_dir: Path,
    results: dict[str, RolloutResult],
    meta: dict,
    extras: dict[str, dict] | None = None,
    iterations: list[dict[str, RolloutResult]] | None = None,
) -> Path:
    """report.json (``extras[policy]`` joins that policy's figures; ``iterations``: every
    iteration's results, ``results`` being the last's) and the plots (of ``results``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    extras = extras or {}
    report = {
        "meta": meta,
        "policies": {
            name: {**policy_summary(r), **(extras or {}).get(name, {})} for name, r in results.items()
        },
    }
    for ref in ("baseline", "context"):
        base = results.get(ref)
        if base is not None and base.metrics.throughput_tokens_per_s:
            report[f"vs_{ref}"] = {name: _ratios(r, base) for name, r in results.items()}
    if iterations is not None:
        report["iterations"] = [
            {"policies": {name: policy_summary(r) for name, r in it.items()}} for it in iterations
        ]
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot_timelines(results, out_dir / "report.png")
    acceptance = out_dir / "acceptance.png"
    if any(r.metrics.draft_tokens_verified for r in results.values()):
        plot_acceptance(results, acceptance)
    else:  # an earlier run's would stand beside a report whose policies never drafted
        acceptance.unlink(missing_ok=True)
    return path


def written(path: Path, *more: Path) -> str:
    """The files ``write_report`` wrote for ``path`` (and ``more``), as a line names them."""
    files = [path, path.with_suffix(".png")]
    files += [f for f in [path.parent / "acceptance.png"] if f.is_file()] + list(more)
    return ", ".join(map(str, files[:-1])) + f" and {files[-1]}"


def _ratios(result: RolloutResult, base: RolloutResult) -> dict:
    m, b = result.metrics, base.metrics
    return {
        "throughput_x": round(m.throughput_tokens_per_s / b.throughput_tokens_per_s, 3),
        "tail_reduction": round(1 - m.tail_s / b.tail_s, 3) if b.tail_s else None,
    }


def plot_acceptance(results: dict[str, RolloutResult], path: Path) -> None:
    """Accepted draft tokens per request-step, early / middle / tail third, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 3.4))
    width = 0.8 / 3
    for k, label in enumerate(("early", "middle", "tail")):
        values = [results[n].metrics.accepted_tokens_per_step_thirds[k] for n in names]
        ax.bar([i + (k - 1) * width for i in range(len(names))], values, width, label=label)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("accepted draft tokens / step")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LEGEND_INSTANCES = 8  # more instances than this are told apart by colour only


def plot_group_lengths(lengths: list[list[int]], path: Path, title: str) -> None:
    """Output lengths of every response, one column per group (groups by mean length):
    the spread within a group against the spread across groups at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(range(len(lengths)), key=lambda k: sum(lengths[k]) / len(lengths[k]))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(lengths) + 2), 3.6))
    for x, k in enumerate(order):
        ax.scatter([x] * len(lengths[k]), lengths[k], s=10, alpha=0.6, color="tab:blue")
        ax.plot([x - 0.3, x + 0.3], [sum(lengths[k]) / len(lengths[k])] * 2, color="black", lw=1.5)
    ax.set_xticks(range(len(order)), [str(k) for k in order], fontsize=7)
    ax.set_xlabel("group (prompt index, sorted by mean length; bar: mean)")
    ax.set_ylabel("output tokens")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timelines(results: dict[str, RolloutResult], path: Path) -> None:
    """One row per policy: running requests per instance (left); KV per instance (right),
    used (solid) beside reserved for chunks in flight (dashed), and their means over the
    instances (black): under divided rollout the gap between the two is concurrency the
    reservation costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    instances = max((len(r.timelines) for r in results.values()), default=1)
    many = instances > LEGEND_INSTANCES
    cmap = plt.get_cmap("viridis" if many else "tab10")
    colours = [cmap(i / max(1, instances - 1)) if many else cmap(i % 10) for i in range(instances)]
    lw = 0.5 if many else 0.9
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 2.4 * len(results)), squeeze=False, sharex=True)
    for row, (name, result) in enumerate(results.items()):
        ax_run, ax_kv = axes[row]
        for i, timeline in enumerate(result.timelines):
            t = [p.time for p in timeline]
            ax_run.step(t, [p.running for p in timeline], where="post", color=colours[i], lw=lw)
            style = {"where": "post", "color": colours[i], "lw": lw, "alpha": 0.6}
            ax_kv.step(t, [100 * p.kv_usage for p in timeline], **style)
            ax_kv.step(t, [100 * p.kv_reserved for p in timeline], ls="--", **style)
        grid, used, reserved = _mean_kv(result.timelines, result.metrics.makespan_s)
        ax_kv.plot(grid, used, color="black", lw=1.6)
        ax_kv.plot(grid, reserved, color="black", lw=1.6, ls="--")
        m = result.metrics
        ax_run.set_title(f"{name}: {m.throughput_tokens_per_s:.0f} tok/s, makespan {m.makespan_s:.1f}s, "
                         f"tail {m.tail_s:.1f}s", fontsize=9)  # fmt: skip
        ax_run.set_ylabel("running")
        ax_kv.set_ylabel("KV %")
        ax_kv.set_ylim(0, 105)
    styles = [Line2D([], [], color="0.3", lw=1), Line2D([], [], color="0.3", lw=1, ls="--"),
              Line2D([], [], color="black", lw=1.6)]  # fmt: skip
    axes[0][1].legend(styles, ["used", "reserved", "mean over instances"], fontsize=7, loc="upper right",
                      framealpha=0.85)  # fmt: skip
    if many:
        fig.suptitle(f"{instances} instances, one colour each", fontsize=9)
    else:
        handles = [Line2D([], [], color=c, lw=1) for c in colours]
        axes[0][0].legend(handles, [f"instance {i}" for i in range(instances)], fontsize=7, loc="upper right",
                          framealpha=0.85)  # fmt: skip
    axes[-1][0].set_xlabel("time (s, per-instance clocks)")
    axes[-1][1].set_xlabel("time (s, per-instance clocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_kv(timelines: list[list], makespan: float, points: int = 200):
    """Used and reserved KV (%) averaged over instances on a common time grid, each
    instance holding its last reported value."""
    import numpy as np

    grid = np.linspace(0.0, makespan, points)
    used, reserved = np.zeros(points), np.zeros(points)
    for timeline in timelines:
        if not timeline:
            continue
        t = np.array([p.time for p in timeline])
        at = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, None)
        before = grid < t[0]
        used += np.where(before, 0.0, np.array([p.kv_usage for p in timeline])[at])
        reserved += np.where(before, 0.0, np.array([p.kv_reserved for p in timeline])[at])
    n = max(1, len(timelines))
    return grid, 100 * used / n, 100 * reserved / n


class Progress:
    """A line every ~10% of finished responses, so long runs show they move."""

    def __init__(self, name: str, total: int, file: TextIO | None = None) -> None:
        self.name, self.total, self.done, self.file = name, total, 0, file
        self.every = max(1, total // 10)
        self.start = time.perf_counter()

    def __call__(self, sample) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            print(f"[{self.name}] {self.done}/{self.total} responses, "
                  f"{time.perf_counter() - self.start:.1f}s wall", file=self.file, flush=True)  # fmt: skip
