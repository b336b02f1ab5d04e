"""The real engine's policy order against the simulator's on the same workload: per
iteration and policy, tokens/s (x baseline), engine / simulator, accepted draft tokens
per step, the order of policies by throughput and the pairs of policies the simulator
orders differently (with each side's gap), and for the policies that draft, draft nodes
per row and step and the share of them accepted. Reads `report.json` files written
by `seer_engine bench rollout --report` and `seer_engine simulate --report`.

    python benchmarks/engine_vs_sim.py ENGINE_REPORT SIM_REPORT [SIM_REPORT ...] [--within 0.15]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _iterations(path: str) -> list[dict]:
    report = json.loads(Path(path).read_text())
    return [run["policies"] for run in report.get("iterations") or [{"policies": report["policies"]}]]


def _order(policies: dict) -> str:
    ranked = sorted(policies, key=lambda name: -policies[name]["throughput_tokens_per_s"])
    return " > ".join(ranked)


def compare(engine: list[dict], sims: list[list[dict]], within: float) -> tuple[list[str], list[str]]:
    """Markdown lines of the side-by-side table and of the orders; misses are named."""
    head = "| iteration | policy | engine tokens/s (x baseline) | engine acc/step |"
    rule = "|---|---|---:|---:|"
    for k in range(len(sims)):
        head += f" sim {k + 1} tokens/s (x baseline) | engine / sim {k + 1} | sim {k + 1} acc/step |"
        rule += "---:|---:|---:|"
    lines, orders = (
        [head, rule],
        ["| iteration | engine | " + " | ".join(f"sim {k + 1}" for k in range(len(sims))) + " |"],
    )
    orders.append("|---|---|" + "---|" * len(sims))
    for it, pols in enumerate(engine):
        base = pols["baseline"]["throughput_tokens_per_s"] if "baseline" in pols else None
        for name, m in pols.items():
            tps = m["throughput_tokens_per_s"]
            row = f"| {it + 1} | {name} | {tps:,.0f}" + (f" ({tps / base:.2f}x)" if base else "")
            row += f" | {m['accepted_tokens_per_step']:.2f} |"
            for sim in sims:
                s = sim[it][name]
                stps = s["throughput_tokens_per_s"]
                sbase = sim[it]["baseline"]["throughput_tokens_per_s"] if "baseline" in sim[it] else None
                ratio = tps / stps
                flag = "" if abs(ratio - 1) <= within else " **miss**"
                row += f" {stps:,.0f}" + (f" ({stps / sbase:.2f}x)" if sbase else "")
                row += f" | {ratio:.2f}{flag} | {s['accepted_tokens_per_step']:.2f} |"
            lines.append(row)
        orders.append(f"| {it + 1} | {_order(pols)} | " + " | ".join(_order(sim[it]) for sim in sims) + " |")
    return lines, orders


def swaps(engine: list[dict], sims: list[list[dict]]) -> list[str]:
    """Markdown lines: per iteration and simulator run, each pair of policies it orders
    unlike the engine, with how far apart each puts them (how close a call it was)."""
    lines = []
    for k, sim in enumerate(sims, 1):
        for i, (eng, run) in enumerate(zip(engine, sim), 1):
            names = [n for n in eng if n in run]
            tps = {n: (eng[n]["throughput_tokens_per_s"], run[n]["throughput_tokens_per_s"]) for n in names}
            for a in names:
                for b in names:
                    (ea, sa), (eb, sb) = tps[a], tps[b]
                    if ea > eb and sa < sb:
                        lines.append(
                            f"- sim {k}, iteration {i}: engine {a} > {b} by {ea / eb - 1:.1%}, "
                            f"simulator {b} > {a} by {sb / sa - 1:.1%}"
                        )
    return lines or ["- none: every simulator run orders the policies as the engine does"]


def _drafts(m: dict) -> str:
    """Draft nodes verified per row and step, and the share accepted (rows' steps are
    accepted tokens over accepted per step)."""
    verified, accepted, per_step = (
        m["draft_tokens_verified"],
        m["draft_tokens_accepted"],
        m["accepted_tokens_per_step"],
    )
    if not verified or not per_step:
        return "- | -"
    return f"{verified * per_step / accepted:.2f} | {accepted / verified:.3f}"


def drafts(engine: list[dict], sims: list[list[dict]]) -> list[str]:
    """Markdown lines: draft nodes per row-step and accepted per node, engine beside each sim."""
    head = "| iteration | policy | engine nodes / row-step | engine accepted / node |"
    head += "".join(
        f" sim {k + 1} nodes / row-step | sim {k + 1} accepted / node |" for k in range(len(sims))
    )
    lines = [head, "|---|---|" + "---:|---:|" * (1 + len(sims))]
    for it, pols in enumerate(engine):
        for name, m in pols.items():
            if m["draft_tokens_verified"]:
                cells = [_drafts(m)] + [_drafts(sim[it][name]) for sim in sims]
                lines.append(f"| {it + 1} | {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", help="the engine's report.json (bench rollout --report)")
    parser.add_argument("sims", nargs="+", help="simulator report.json files (simulate --report)")
    parser.add_argument("--within", type=float, default=0.15, help="flag engine / sim outside 1 +- this")
    args = parser.parse_args(argv)
    engine = _iterations(args.engine)
    sims = [_iterations(p) for p in args.sims]
    for path, sim in zip(args.sims, sims):
        if len(sim) != len(engine):
            parser.error(f"{path} has {len(sim)} iterations, the engine's report {len(engine)}")
    lines, orders = compare(engine, sims, args.within)
    print("\n".join(f"sim {k + 1}: `{p}`" for k, p in enumerate(args.sims)) + "\n")
    print("\n".join(lines) + "\n\nOrder by throughput:\n\n" + "\n".join(orders))
    print("\nPairs ordered differently:\n\n" + "\n".join(swaps(engine, sims)))
    print("\nDrafts:\n\n" + "\n".join(drafts(engine, sims)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
