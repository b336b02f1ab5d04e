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
from seer_engine.sim.setups import PAPER_ABLATION, get_setup
from seer_engine.sim.simulator import policy_for, simulate, synthetic_groups

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
    groups = synthetic_groups(
        setup.prompts, setup.samples, setup.max_tokens, setup.prompt_len, seed, setup.mean_tokens,
        prompt_len_sigma=setup.prompt_len_sigma, prompt_len_corr=setup.prompt_len_corr, across_sigma=across,
    )  # fmt: skip
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


STYLES = (("divided", "o-"), ("context", "s-"), ("oracle", "^--"), ("oracle/peak-known", "v:"))


def plot(report: dict, path: Path) -> None:
    """Ratios to the baseline against the spread of group means, one panel per (extra
    fixed cost, KV scale), with the paper's ablation for the setup as a reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    panels = sorted({(p["extra_overhead_s"], p["kv_scale"]) for p in points})
    width = max(6.5, 4.2 * len(panels))  # one panel still fits the title
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.8), sharey=True, squeeze=False)
    for ax, (overhead, kv) in zip(axes[0], panels):
        chosen = sorted((p for p in points if (p["extra_overhead_s"], p["kv_scale"]) == (overhead, kv)),
                        key=lambda p: p["across_sigma"])  # fmt: skip
        x = [p["across_sigma"] for p in chosen]
        for name, style in (
            ("divided", "o-"),
            ("context", "s-"),
            ("oracle", "^--"),
            ("oracle/peak-known", "v:"),
        ):
            y = [p["tokens_per_s"][name] / p["tokens_per_s"]["baseline"] for p in chosen]
            ax.plot(x, y, style, label=name.replace("/peak-known", ", known lengths"))
        ax.axhline(1.0, color="grey", lw=0.8)
        paper = PAPER_ABLATION.get(report["setup"], ())
        for value, label in zip(paper, ("paper: divided", "paper: context")):
            ax.axhline(value, color="black", lw=0.8, ls=(0, (1, 3)))
            ax.annotate(label, (ax.get_xlim()[0], value), fontsize=7, va="bottom")
        ax.set_title(f"+{overhead * 1e3:g} ms per step, KV x{kv:g}", fontsize=10)
        ax.set_xlabel("sd of log group means")
    axes[0][0].set_ylabel("throughput / baseline")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{report['setup']}: what scheduling can gain over the modeled baseline", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", default="qwen2vl-72b")
    p.add_argument("--across", default="0.44,0.8,1.2,1.6", help="sd of the log group means (the fit: 0.44)")
    p.add_argument("--overhead-ms", default="0,30", help="added to the profile's fixed cost per step")
    p.add_argument("--kv-scale", default="1,0.5", help="times the profile's KV capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the points as JSON here (and a .png beside)")
    p.add_argument("--replot", type=Path, default=None, help="only redraw the plot of this JSON")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
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
        plot(report, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
