"""How far scheduling alone can beat the modeled veRL baseline on a setup, over a grid of
calibrations the paper leaves open.

For each point of the grid (the synthetic workload's spread of group means, an extra
fixed cost per step, a scale on the KV capacity) it simulates one iteration under
``baseline``, ``divided``, ``context`` and ``oracle`` with the default ``peak``
admission, and ``oracle`` again with ``peak-known`` admission (told every true length:
no scheduler that never preempts packs an instance tighter), and prints each against
the baseline beside the baseline's diagnostics (``sim/diagnostics.py``).

    python benchmarks/sim_calibration_grid.py --setup qwen2vl-72b \\
        --across 0.44,0.8,1.2,1.6 --overhead-ms 0,30 --kv-scale 1,0.5 --out grid.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import platform
import sys
import time
from pathlib import Path

from seer_engine.sim.diagnostics import diagnostics
from seer_engine.sim.setups import get_setup
from seer_engine.sim.simulator import SimGroup, policy_for, simulate
from seer_engine.workloads.synthetic import synthetic_workload

RUNS = (
    ("baseline", "peak"), ("divided", "peak"), ("context", "peak"),
    ("oracle", "peak"), ("oracle", "peak-known"),
)  # fmt: skip


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def point(setup_name: str, across: float, overhead_s: float, kv_scale: float, seed: int) -> dict:
    setup = get_setup(setup_name)
    step = setup.profile.step
    profile = dataclasses.replace(
        setup.profile,
        step=dataclasses.replace(step, a_s=step.a_s + overhead_s),
        kv_capacity_tokens=int(setup.profile.kv_capacity_tokens * kv_scale),
    )
    workload = synthetic_workload(
        setup.prompts, setup.samples, setup.max_tokens, seed=seed, mean_len=setup.mean_tokens,
        prompt_len=setup.prompt_len, prompt_len_sigma=setup.prompt_len_sigma,
        prompt_len_corr=setup.prompt_len_corr, across_sigma=across,
    )  # fmt: skip
    groups = [SimGroup(f"s{k}", g.prompt_len, g.lengths, g.group_id) for k, g in enumerate(workload)]
    lengths = [n for g in groups for n in g.lengths]
    out: dict = {
        "across_sigma": across, "extra_overhead_s": overhead_s, "kv_scale": kv_scale,
        "mean_tokens": sum(lengths) / len(lengths),
        "at_max_tokens": sum(n >= setup.max_tokens for n in lengths) / len(lengths),
        "tokens_per_s": {},
    }  # fmt: skip
    for name, admission in RUNS:
        policy = policy_for(name, groups, setup.max_tokens, setup.starvation_s)
        result = simulate(
            groups, policy, profile, setup.instances, setup.max_tokens, setup.chunk_tokens,
            admission=admission,
        )  # fmt: skip
        label = name if admission == "peak" else f"{name}/{admission}"
        out["tokens_per_s"][label] = result.metrics.throughput_tokens_per_s
        if name == "baseline":
            out["baseline_makespan_s"] = result.metrics.makespan_s
            out["baseline_diagnostics"] = diagnostics(result)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", default="qwen2vl-72b")
    p.add_argument("--across", default="0.44,0.8,1.2,1.6", help="sd of the log group means (the fit: 0.44)")
    p.add_argument("--overhead-ms", default="0,30", help="added to the profile's fixed cost per step")
    p.add_argument("--kv-scale", default="1,0.5", help="times the profile's KV capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the points as JSON here")
    args = p.parse_args(argv)
    points = []
    grid = list(itertools.product(_floats(args.across), _floats(args.overhead_ms), _floats(args.kv_scale)))
    for k, (across, overhead_ms, kv_scale) in enumerate(grid, 1):
        start = time.perf_counter()
        pt = point(args.setup, across, overhead_ms / 1e3, kv_scale, args.seed)
        points.append(pt)
        base = pt["tokens_per_s"]["baseline"]
        ratios = " ".join(f"{name}={tps / base:.2f}" for name, tps in pt["tokens_per_s"].items())
        d = pt["baseline_diagnostics"]
        print(
            f"[{k}/{len(grid)}] across={across} overhead+{overhead_ms:g}ms kv x{kv_scale:g} "
            f"({time.perf_counter() - start:.0f}s): {ratios} | "
            f"baseline makespan {pt['baseline_makespan_s']:,.0f}s "
            f"idle {d['idle_share']:.0%} tail {d['tail_share']:.0%} spread {d['finish_spread_share']:.0%} "
            f"last5-longest15 {d['last5_among_longest15']:.0%} preemptions {d['preemptions']:,.0f}",
            flush=True,
        )
    if args.out:
        meta = {
            "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"meta": meta, "setup": args.setup, "points": points}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
