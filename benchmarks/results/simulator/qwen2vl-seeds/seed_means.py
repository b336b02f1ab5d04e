"""qwen2vl-72b, iteration 1, over the eight seeds' reports: the baseline's mean idle share,
and each policy's gain over the baseline (ratio of mean makespans, and the geometric mean
of the per-seed ratios). Run from the repository root:

    python benchmarks/results/simulator/qwen2vl-seeds/seed_means.py [DIR]

DIR: a folder of ``seed<N>/qwen2vl-72b/report.json`` (every seed there); without it, the
eight reports this file's README section names.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIM = HERE.parent
REPORTS = [SIM / "qwen2vl-72b"] + [SIM / f"seed{n}" / "qwen2vl-72b" for n in (1, 2, 3)]
REPORTS += [HERE / f"seed{n}" / "qwen2vl-72b" for n in (4, 5, 6, 7)]
POLICIES = ("divided", "context", "oracle")


def main() -> None:
    reports = REPORTS
    if len(sys.argv) > 1:
        reports = sorted(Path(sys.argv[1]).glob("seed*/qwen2vl-72b"), key=lambda d: int(d.parent.name[4:]))
    first = [json.loads((d / "report.json").read_text())["iterations"][0]["policies"] for d in reports]
    base = [p["baseline"]["makespan_s"] for p in first]
    idle = [p["baseline"]["idle_fraction"] for p in first]
    print(f"{len(first)} seeds; baseline: mean makespan {sum(base) / len(base):,.0f} s, "
          f"mean idle {100 * sum(idle) / len(idle):.1f}%")  # fmt: skip
    for name in POLICIES:
        spans = [p[name]["makespan_s"] for p in first]
        geo = math.exp(sum(math.log(b / s) for b, s in zip(base, spans)) / len(spans))
        ratio = sum(base) / sum(spans)
        print(f"{name}: mean makespan {sum(spans) / len(spans):,.0f} s, "
              f"x baseline {ratio:.2f} (geometric mean of the ratios {geo:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
