"""Markdown tables from `seer_engine simulate --report DIR` runs: per setup, iteration and
policy, throughput against the same iteration's baseline and oracle, the tail, preemptions
and chunk cuts. Usage: python benchmarks/sim_tables.py DIR [SETUP ...]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


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


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    setups = argv[1:] or sorted(p.name for p in root.iterdir() if (p / "report.json").exists())
    for setup in setups:
        report = json.loads((root / setup / "report.json").read_text())
        print(f"#### {setup}\n\n`{report['meta']['command']}`\n")
        print("\n".join(table(report)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
