"""The ratio the Context Manager's ``auto`` order reads (``LengthSpread``): how much
prompts differ in mean log length against how much one prompt's responses do, on the
simulator's workloads (one iteration per seed, as the history store holds it) and on
traces.

    python benchmarks/length_spread.py --seeds 0,1,2,3 \\
        --trace ../shared/traces/qwen3-8b-mcq-cot.jsonl.gz:0:90 \\
        --trace ../shared/traces/gpt4-game24-cot.jsonl.gz:16
"""

from __future__ import annotations

import argparse
import dataclasses

from seer_engine.rollout.context_manager import AUTO_SPREAD_RATIO, LengthSpread
from seer_engine.sim.setups import SETUPS
from seer_engine.sim.simulator import bench_groups, setup_groups


def ratio(groups) -> float:
    spread = LengthSpread()
    for g in groups:
        spread.add(g.lengths)
    return spread.ratio()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0", help="comma-separated")
    p.add_argument("--across-sigma", type=float, default=None, help="override every setup's spread")
    p.add_argument("--trace", action="append", default=[], help="PATH:GROUPS, 8 samples per group")
    args = p.parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",")]
    print(f"auto takes 'estimate' above {AUTO_SPREAD_RATIO:g}")
    for name, s in SETUPS.items():
        across = s.across_sigma if args.across_sigma is None else args.across_sigma
        workloads = [setup_groups(dataclasses.replace(s, across_sigma=across), seed) for seed in seeds]
        ratios = [ratio(groups) for groups in workloads]
        print(f"{name} (spread {across:g}), seeds {args.seeds}: " + ", ".join(f"{r:.2f}" for r in ratios))
    for spec in args.trace:
        path, groups = spec.split(":", 1)
        print(f"{spec}: {ratio(bench_groups(path, groups, 8, 1 << 30)):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
