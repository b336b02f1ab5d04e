"""Which responses make a simulated rollout's tail (from the 90th-percentile finish to
the last), and when they started: late starters (an ordering problem) or long responses
that ran the whole rollout (a per-response speed problem). The last of ``--iterations``
rollouts of the same prompts (as ``simulate --repeat-prompts``), so ``+history``
policies show their tail once their store holds the earlier ones.

    python benchmarks/sim_tail.py --setup kimi-k2 --policy seer,oracle \\
        --out benchmarks/results/simulator/tail/kimi-k2.json
    python benchmarks/sim_tail.py --setup kimi-k2 --policy context+history,oracle --iterations 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from seer_engine.rollout.context_manager import add_context_order_arg
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import (
    HISTORY_SUFFIX,
    check_context_flags,
    distinct_policies,
    rollout_policy_names,
)
from seer_engine.rollout.types import sample_key
from seer_engine.sim.acceptance import acceptance_for
from seer_engine.sim.setups import SETUPS
from seer_engine.sim.simulator import policy_for, setup_groups, simulate, true_lengths


def tail_rows(result, lengths: dict[str, int]) -> list[dict]:
    """Every response: first start, last (re)start, finish, chunks and length."""
    rows = []
    for gid, samples in result.samples.items():
        for s in samples:
            key = sample_key(gid, s.sample_index)
            rows.append({
                "key": key, "start_s": result.started_at[key], "last_start_s": result.resumed_at[key],
                "finish_s": s.finished_at, "chunks": s.chunks, "tokens": lengths[key],
            })  # fmt: skip
    return sorted(rows, key=lambda r: r["finish_s"])


def summarize(result, lengths: dict[str, int], max_tokens: int, last: int) -> dict:
    """The tail as the reports measure it (``metrics.tail_s``): responses finished after it began."""
    rows, metrics = tail_rows(result, lengths), result.metrics
    makespan = metrics.makespan_s
    tail = [r for r in rows if r["finish_s"] > makespan - metrics.tail_s]
    return {
        "makespan_s": makespan,
        "tail_s": metrics.tail_s,
        "tail_responses": len(tail),
        "tail_median_start_share": statistics.median(r["start_s"] for r in tail) / makespan,
        "tail_median_chunks": statistics.median(r["chunks"] for r in tail),
        "tail_share_at_max_tokens": sum(r["tokens"] >= max_tokens for r in tail) / len(tail),
        "last": [
            {**r, "tokens_per_s": r["tokens"] / (r["finish_s"] - r["start_s"])} for r in rows[::-1][:last]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", default="kimi-k2")
    p.add_argument("--policy", default="seer,oracle", help="comma-separated (+history: --iterations >= 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=1, help="rollouts of one prompt set; shows the last")
    p.add_argument("--last", type=int, default=10, help="list this many of the last responses to finish")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    add_context_order_arg(p)
    args = p.parse_args(argv)
    if args.setup not in SETUPS:
        p.error(f"unknown setup {args.setup!r}; choose from {sorted(SETUPS)}")
    setup = SETUPS[args.setup]
    try:
        policies = distinct_policies(rollout_policy_names(args.policy))
        check_context_flags(policies, None, args.context_order)
    except ValueError as e:
        p.error(str(e))
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    if args.iterations == 1 and any(name.endswith(HISTORY_SUFFIX) for name in policies):
        p.error("--policy: one iteration has no history; drop the +history policies or pass --iterations 2")
    out = {
        "command": shlex.join(["python", "benchmarks/sim_tail.py", *sys.argv[1:]]),
        "iteration": args.iterations,
        "policies": {},
    }
    for name in policies:
        store = HistoryStore() if name.endswith(HISTORY_SUFFIX) else None
        for it in range(args.iterations):
            groups = setup_groups(setup, args.seed, iteration=it)
            policy = policy_for(name, groups, setup.max_tokens, setup.starvation_s, store, args.context_order)
            model = acceptance_for(store, setup.samples, prompts=[g.prompt for g in groups])
            result = simulate(
                groups, policy, setup.profile, setup.instances, setup.max_tokens, setup.chunk_tokens,
                SeerPlacement(), acceptance=model,
            )  # fmt: skip
            if store is not None:
                store.next_iteration()
        lengths = true_lengths(groups, setup.max_tokens)
        s = out["policies"][name] = summarize(result, lengths, setup.max_tokens, args.last)
        print(f"{name}: makespan {s['makespan_s']:,.0f} s, tail {s['tail_s']:,.0f} s; the tail's "
              f"{s['tail_responses']} responses started at a median {s['tail_median_start_share']:.0%} of "
              f"the makespan, ran {s['tail_median_chunks']:g} chunks, {s['tail_share_at_max_tokens']:.0%} "
              f"at max_tokens", flush=True)  # fmt: skip
        for r in s["last"]:
            print(f"  finish {r['finish_s']:7,.0f} s  start {r['start_s']:7,.0f} s  last chunk from "
                  f"{r['last_start_s']:7,.0f} s  {r['chunks']:3d} chunks  {r['tokens']:7,} tokens  "
                  f"{r['tokens_per_s']:6.1f} tokens/s")  # fmt: skip
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
