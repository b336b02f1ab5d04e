"""Simulator fidelity: simulated vs real makespan and throughput, every policy, on the
same trace-replay workload (2 in-process instances of the tiny model on this machine).

    python benchmarks/sim_fidelity.py [--groups 8] [--repeats 2] [--out benchmarks/results/simulator]

Each repeat runs the real engine for every policy, fits the step-time model on those
runs' own steps and simulates the same workload (``seer_engine.sim.fidelity``); it
compares against the wall-clock runs, then against the engines re-run with the
fitted model as their clock (scheduling differences only).
Writes fidelity.json, fidelity.md and fidelity.png (sim/real ratio per policy).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

from seer_engine.model_executor.tiny_model import make_tiny_model
from seer_engine.rollout.machine import machine_info
from seer_engine.sim.fidelity import POLICIES, Workload, compare
from seer_engine.workloads.paths import traces_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trace", default=str(traces_dir() / "qwen3-8b-mcq-cot.jsonl.gz"))
    p.add_argument("--groups", default="8")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/simulator")
    args = p.parse_args(argv)
    machine = machine_info()
    w = Workload(args.trace, args.groups, args.samples, args.max_tokens)
    model = make_tiny_model(
        tempfile.mkdtemp(prefix="seer-fidelity-"), tokenizer=Path(args.trace).parent / "bpe32k-tokenizer.json"
    )
    runs = []
    for r in range(args.repeats):
        for clock in ("wall", "modeled"):
            comparisons, profile = compare(w, model, modeled_clock=clock == "modeled")
            print(
                f"repeat {r + 1}/{args.repeats}, real clock: {clock}; step = {profile.step.describe()}",
                flush=True,
            )
            for c in comparisons:
                print("  " + c.line(), flush=True)
            runs.append({"clock": clock, "step": profile.step.describe(),
                         **{c.policy: _figures(c) for c in comparisons}})  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python benchmarks/sim_fidelity.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine,
        "workload": vars(w),
    }
    (out / "fidelity.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    m = meta["machine"]
    lines = [f"# Simulator fidelity ({meta['date']})", "",
             f"`{meta['command']}` on {m['cpu']} ({m['cpu_count']} cores)", "",
             "| policy | " + " | ".join(f"sim/real, {r['clock']} clock" for r in runs) + " |",
             "|---|" + "---|" * len(runs)]  # fmt: skip
    for name in POLICIES:
        lines.append(f"| {name} | " + " | ".join(f"{r[name]['makespan_ratio']:.3f}" for r in runs) + " |")
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    _plot(runs, out / "fidelity.png")
    print(f"wrote {out}/fidelity.json, fidelity.md, fidelity.png")
    return 0


def _figures(c) -> dict:
    return {
        "makespan_ratio": round(c.makespan_ratio, 4),
        "throughput_ratio": round(c.throughput_ratio, 4),
        "real_makespan_s": round(c.real.makespan_s, 3),
        "sim_makespan_s": round(c.sim.makespan_s, 3),
        "real_steps": c.real.steps,
        "sim_steps": round(c.sim.steps),
        "real_draft_nodes": c.real.draft_tokens_verified,
        "sim_draft_nodes": round(c.sim.draft_tokens_verified),
    }


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        ax.bar([k + (i - (len(runs) - 1) / 2) * width for k in range(len(POLICIES))],
               [run[n]["makespan_ratio"] for n in POLICIES], width, label=f"repeat {i + 1}")  # fmt: skip
    ax.axhspan(0.85, 1.15, color="green", alpha=0.1, label="within 15%")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(POLICIES)), POLICIES)
    ax.set_ylabel("simulated / real makespan")
    ax.set_ylim(0.6, 1.4)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
