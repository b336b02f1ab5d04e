"""An experiment on the acceptance replay, not part of the simulator: which reading of the
siblings' lead predicts what a step accepts, what Seer's probe start pattern does to it,
and how a step's verdict follows the one before.

    python benchmarks/results/history/g48/cells/replay_stats.py TRACE GROUPS > replay_stats.md

Each group (8 responses) is replayed at budgets 1, 4 and 16 under four start patterns:
lock-step, starts staggered over 0.5 and 2 mean response lengths (``staggered_starts``,
the fits' seeds), and the probe (``probe_starts`` at 0.5). ``lead_share`` is wrapped to
keep each step's leads, so every statistic reads the same steps.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from statistics import NormalDist

import numpy as np

import seer_engine.sim.acceptance_replay as replay
from seer_engine.sim.acceptance import COVERAGE_WINDOW, DEFAULT_STAGE_EDGES, bin_index, lead_share
from seer_engine.workloads.groups import select_groups
from seer_engine.workloads.traces import load_trace

PATTERNS = ("lock", "spread 0.5", "spread 2", "probe 0.5")
WINDOWS = (16, 64, 256)


def replay_steps(groups, budget: int) -> list[tuple[str, int, float, list[float], int, int]]:
    """(pattern, response, stage, leads, accepted, drafted) per step, in step order."""
    leads: list[list[float]] = []

    def recording(position, siblings, window=COVERAGE_WINDOW):
        siblings = list(siblings)
        leads.append([max(0.0, q - position) for q in siblings])
        return lead_share(position, siblings, window)

    replay.lead_share = recording
    rows = []
    for gi, group in enumerate(groups, 1):
        starts = {
            "lock": [0] * len(group.response_token_ids),
            "spread 0.5": replay.staggered_starts(group, 0.5, random.Random(f"0:{gi}:0.5")),
            "spread 2": replay.staggered_starts(group, 2.0, random.Random(f"0:{gi}:2.0")),
            "probe 0.5": replay.probe_starts(group, 0.5),
        }
        for name in PATTERNS:
            leads.clear()
            for step, ahead in zip(replay.replay_group(group, budget, starts=starts[name]), leads):
                rows.append((name, step.response, step.stage, ahead, step.accepted, step.drafted))
    replay.lead_share = lead_share
    return rows


def statistics(rows) -> list[str]:
    """R^2 of per-cell means (5 stage x 5 coverage bins), and the mean error predicting
    each start pattern from a table fitted on the other three."""
    accepted = np.array([r[4] for r in rows], float)
    stage = np.array([bin_index(DEFAULT_STAGE_EDGES, r[2]) for r in rows])
    pattern = np.array([r[0] for r in rows])
    lines = []
    for window in WINDOWS:
        shares = np.array([[min(window, x) / window for x in r[3]] for r in rows])
        for name, value in (
            ("mean", shares.mean(1)),
            ("root of mean", np.sqrt(shares.mean(1))),
            ("max", shares.max(1)),
            ("(mean + max) / 2", (shares.mean(1) + shares.max(1)) / 2),
        ):
            cell = np.minimum((value * 5).astype(int), 4) + 5 * stage
            means = np.array([accepted[cell == c].mean() if (cell == c).any() else 0.0 for c in range(25)])
            r2 = 1 - ((accepted - means[cell]) ** 2).sum() / ((accepted - accepted.mean()) ** 2).sum()
            errors = []
            for held in PATTERNS:
                out = pattern == held
                inside = [(cell == c) & ~out for c in range(25)]
                fit = np.array([accepted[m].mean() if m.any() else 0.0 for m in inside])
                errors.append(abs(fit[cell[out]].mean() - accepted[out].mean()))
            lines.append(
                f"| {name} | {window} | {r2:.3f} | {np.mean(errors):.3f} | "
                + " / ".join(f"{e:.2f}" for e in errors)
                + " |"
            )
    return lines


def probe_split(rows) -> list[str]:
    """Accepted per step of rows whose mean lead share is under 0.2 (coverage bin 0 under
    the plain mean), by pattern, and of those with a sibling a whole draft ahead."""
    lines = []
    for name in PATTERNS:
        low = [r for r in rows if r[0] == name and lead_share(0, r[3]) < 0.2]
        ahead = [r for r in low if max(r[3], default=0) >= COVERAGE_WINDOW]
        mean = sum(r[4] for r in low) / len(low)
        mean_ahead = sum(r[4] for r in ahead) / len(ahead) if ahead else float("nan")
        lines.append(f"| {name} | {len(low)} | {mean:.2f} | {len(ahead)} | {mean_ahead:.2f} |")
    return lines


def lag_one(rows) -> str:
    """Gaussian-copula correlation of consecutive steps' hits (>= 1 token accepted) of one
    response, with each step's hit rate that of its (pattern, stage, mean-share) cell."""
    cells = [(r[0], bin_index(DEFAULT_STAGE_EDGES, r[2]), bin_index(DEFAULT_STAGE_EDGES, lead_share(0, r[3])))
             for r in rows]  # fmt: skip
    hits, seen = Counter(), Counter()
    for c, r in zip(cells, rows):
        seen[c] += 1
        hits[c] += r[4] > 0
    rate = {c: hits[c] / seen[c] for c in seen}
    pairs, last = Counter(), {}
    both = 0
    for c, r in zip(cells, rows):
        key = (r[0], r[1])  # rows of one pattern and response come in step order
        if key in last:
            pairs[(last[key][0], c)] += 1
            both += last[key][1] and r[4] > 0
        last[key] = (c, r[4] > 0)
    normal = NormalDist()
    z = {c: normal.inv_cdf(min(max(p, 1e-9), 1 - 1e-9)) for c, p in rate.items()}
    xs = np.linspace(-9, 9, 4001)
    density, dx = np.exp(-(xs**2) / 2) / math.sqrt(2 * math.pi), xs[1] - xs[0]
    cdf = np.vectorize(normal.cdf)

    def joint(rho: float) -> float:
        total = 0.0
        for (a, b), n in pairs.items():
            below = xs <= z[a]
            given = cdf((z[b] - rho * xs[below]) / math.sqrt(1 - rho * rho))
            total += n * float((density[below] * given).sum() * dx)
        return total

    lo, hi = -0.99, 0.99
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if joint(mid) < both else (lo, mid)
    n = sum(pairs.values())
    independent = sum(k * rate[a] * rate[b] for (a, b), k in pairs.items()) / n
    return f"{lo:.2f} ({n} pairs; both hit {both / n:.3f}, if independent {independent:.3f})"


def main(trace: str, groups: str) -> None:
    chosen = [g.head(8) for g in select_groups(load_trace(trace), groups, 8)]
    print(f"`python benchmarks/results/history/g48/cells/replay_stats.py {trace} {groups}`\n")
    for budget in (4, 16):
        rows = replay_steps(chosen, budget)
        print(f"### Budget {budget}: {len(rows)} steps\n")
        print("| statistic | window | R^2 | leave-one-pattern-out error | lock / spread 0.5 / 2 / probe |")
        print("|---|---:|---:|---:|---|")
        print("\n".join(statistics(rows)) + "\n")
        print("| pattern | steps, mean share < 0.2 | accepted/step | a sibling >= 16 ahead | accepted/step |")
        print("|---|---:|---:|---:|---:|")
        print("\n".join(probe_split(rows)) + "\n")
    print("### Lag-1 correlation of a response's hits\n")
    for budget in (1, 4, 16):
        print(f"- budget {budget}: {lag_one(replay_steps(chosen, budget))}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
