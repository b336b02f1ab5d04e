"""Markdown tables from `seer_engine simulate --report DIR` runs: per setup, iteration and
policy, throughput against the same iteration's baseline and oracle, the tail, preemptions
and chunk cuts; with --targets, issue 13's targets for one setup across runs (seeds); with
--summary, the targets of each setup's run in one folder.

    python benchmarks/sim_tables.py DIR [SETUP ...]
    python benchmarks/sim_tables.py --targets SETUP DIR [DIR ...]
    python benchmarks/sim_tables.py --summary DIR [SETUP ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seer_engine.sim.setups import PAPER_ABLATION


def table(report: dict) -> list[str]:
    lines = [
        "| iteration | policy | tokens/s | x baseline | x oracle | tail s | tail vs baseline | preemptions "
        "| chunk cuts | accepted/step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for it, run in enumerate(report["iterations"], 1):
        pols = run["policies"]
        base, oracle = pols.get("baseline"), pols.get("oracle")
        for name, m in pols.items():
            tps = m["throughput_tokens_per_s"]
            xb = f"{tps / base['throughput_tokens_per_s']:.2f}" if base else ""
            xo = f"{tps / oracle['throughput_tokens_per_s']:.0%}" if oracle else ""
            tail = f"{m['tail_s'] / base['tail_s'] - 1:+.0%}" if base and base["tail_s"] else ""
            lines.append(
                f"| {it} | {name} | {tps:,.0f} | {xb} | {xo} | {m['tail_s']:,.0f} | {tail} | "
                f"{m['preemptions']:,} | {m.get('chunk_cuts', 0):,} | {m['accepted_tokens_per_step']:.2f} |"
            )
    return lines


# Issue 13's iteration-1 targets: `divided` and `context` within 10% of the paper's ablation.
FIRST_ITERATION = {name: tuple(round(0.9 * x, 2) for x in pair) for name, pair in PAPER_ABLATION.items()}


def _ratios(report: dict) -> list[dict[str, float]]:
    out = []
    for run in report["iterations"]:
        p = run["policies"]
        tps = {name: m["throughput_tokens_per_s"] for name, m in p.items()}
        base, oracle, base_tail = tps["baseline"], tps["oracle"], p["baseline"]["tail_s"]
        out.append({
            "divided": tps["divided"] / base, "context": tps["context"] / base,
            "context_oracle": tps["context"] / oracle, "history_oracle": tps["context+history"] / oracle,
            "seer_history": tps["seer+history"] / base, "tail": p["seer+history"]["tail_s"] / base_tail - 1,
            "divided_preemptions": sum(m["preemptions"] for name, m in p.items() if name != "baseline"),
        })  # fmt: skip
    return out


def _target_rows(setup: str) -> list[tuple]:
    """(label, key, iterations it is judged on, passes, format) per target."""
    div, ctx = FIRST_ITERATION[setup]
    return [
        (f"it. 1 `divided` >= {div}x", "divided", slice(0, 1), lambda v: v >= div, "{:.2f}"),
        (f"it. 1 `context` >= {ctx}x", "context", slice(0, 1), lambda v: v >= ctx, "{:.2f}"),
        ("it. 1 `context` >= 90% of oracle", "context_oracle", slice(0, 1), lambda v: v >= 0.9, "{:.1%}"),
        ("it. 2-3 `context+history` >= 97% of oracle", "history_oracle", slice(1, None), lambda v: v >= 0.97,
         "{:.1%}"),
        ("it. 2-3 `seer+history` >= 2.2x", "seer_history", slice(1, None), lambda v: v >= 2.2, "{:.2f}"),
        ("it. 2-3 `seer+history` tail <= -85%", "tail", slice(1, None), lambda v: v <= -0.85, "{:+.0%}"),
        ("every iteration: 0 preemptions for divided policies", "divided_preemptions", slice(None),
         lambda v: v == 0, "{:,.0f}"),
    ]  # fmt: skip


def _cell(run: list[dict[str, float]], key: str, iterations: slice, passes, fmt: str) -> tuple[str, int, int]:
    """The figures of one run for one target (each iteration judged), bold where they miss;
    how many met, of how many."""
    parts, met = [], 0
    for figures in run[iterations]:
        ok = passes(figures[key])
        text = fmt.format(figures[key])
        parts.append(text if ok else f"**{text}**")
        met += ok
    return " / ".join(parts), met, len(run[iterations])


def _load(root: Path, setup: str) -> list[dict[str, float]]:
    return _ratios(json.loads((root / setup / "report.json").read_text()))


def targets(setup: str, roots: list[Path]) -> list[str]:
    """One row per target, one column per run: the figure, bold where it misses."""
    runs = [_load(root, setup) for root in roots]
    lines = [
        "| target | " + " | ".join(f"run {k}" for k in range(len(roots))) + " | met |",
        "|---|" + "---|" * len(roots) + "---|",
    ]
    for name, key, iterations, passes, fmt in _target_rows(setup):
        cells = [_cell(run, key, iterations, passes, fmt) for run in runs]
        met, total = sum(c[1] for c in cells), sum(c[2] for c in cells)
        lines.append(f"| {name} | " + " | ".join(c[0] for c in cells) + f" | {met} of {total} |")
    return lines


def summary(root: Path, setups: list[str]) -> list[str]:
    """One run per setup: one row per target, one column per setup (the iteration-1
    thresholds differ per setup and are named in their cells), and how many target
    cells (a target on a setup, every iteration it judges) are met."""
    runs = {setup: _load(root, setup) for setup in setups}
    ablation = "90% of the paper's ablation"
    labels = [f"it. 1 `divided` >= {ablation}", f"it. 1 `context` >= {ablation}",
              *(row[0] for row in _target_rows(setups[0])[2:])]  # fmt: skip
    lines = ["| target | " + " | ".join(setups) + " |", "|---|" + "---|" * len(setups)]
    met = 0
    for k, label in enumerate(labels):
        cells = []
        for setup in setups:
            name, key, iterations, passes, fmt = _target_rows(setup)[k]
            text, ok, total = _cell(runs[setup], key, iterations, passes, fmt)
            cells.append(f"{text} (>= {name.split('>= ')[1]})" if k < 2 else text)
            met += ok == total
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, "", f"{met} of {len(labels) * len(setups)} target cells met."]


USAGE = __doc__.strip().splitlines()[-3:]


def usage(problem: str) -> int:
    print(f"sim_tables.py: {problem}\nusage:\n" + "\n".join(USAGE), file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("\n".join(USAGE))
        return 0 if argv else 2
    if argv[0] == "--targets":
        if len(argv) < 3:
            return usage("--targets needs a setup and at least one report directory")
        if argv[1] not in FIRST_ITERATION:
            return usage(f"unknown setup {argv[1]!r}; choose from {sorted(FIRST_ITERATION)}")
        missing = [a for a in argv[2:] if not (Path(a) / argv[1] / "report.json").is_file()]
        if missing:
            return usage(f"no {argv[1]}/report.json under {', '.join(missing)}")
        print("\n".join(targets(argv[1], [Path(a) for a in argv[2:]])))
        return 0
    summarize = argv[0] == "--summary"
    if summarize:
        argv = argv[1:]
        if not argv:
            return usage("--summary needs a report directory")
    root = Path(argv[0])
    if not root.is_dir():
        return usage(f"{str(root)!r} is not a directory of simulate reports")
    setups = argv[1:] or sorted(p.name for p in root.iterdir() if (p / "report.json").exists())
    missing = [s for s in setups if not (root / s / "report.json").is_file()]
    if missing:
        return usage(f"no report.json for {', '.join(missing)} under {root}")
    if summarize:
        unknown = [s for s in setups if s not in FIRST_ITERATION]
        if unknown:
            return usage(f"no targets for {', '.join(unknown)}; choose from {sorted(FIRST_ITERATION)}")
        print("\n".join(summary(root, setups)))
        return 0
    for setup in setups:
        report = json.loads((root / setup / "report.json").read_text())
        print(f"#### {setup}\n\n`{report['meta']['command']}`\n")
        print("\n".join(table(report)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
