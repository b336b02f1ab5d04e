"""``seer_engine simulate``: the paper's cluster setups (or a profiled machine) under
every policy, in the discrete-event simulator (``seer_engine/sim``).

Each iteration draws one workload (synthetic, or a trace's lengths) and runs every
policy on it, so the figures compare side by side. ``--report DIR`` writes, per
setup, the same ``report.json`` keys as ``bench rollout`` and a PNG of running
requests (and KV use) per instance over time, one row per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import shlex
import statistics
import time
from pathlib import Path

from seer_engine.rollout.context_manager import add_context_order_arg
from seer_engine.rollout.dispatcher import add_dispatch_args, check_dispatch_rules
from seer_engine.rollout.metrics import RolloutResult
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import (
    HISTORY_SUFFIX,
    ROLLOUT_POLICIES,
    check_context_flags,
    distinct_policies,
    rollout_policy_names,
)
from seer_engine.rollout.report import (
    Progress,
    format_table,
    policy_summary,
    writable_dir,
    write_report,
    written,
)
from seer_engine.sim.admission import KNOWN_ENDS
from seer_engine.workloads.synthetic import MAX_ACROSS_SIGMA


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="cluster-scale rollout simulation of the scheduling policies")
    p.add_argument("--setup", default="moonlight", help="comma-separated: moonlight, qwen2vl-72b, kimi-k2")
    p.add_argument("--policy", default="baseline,divided,context,seer,oracle", help="comma-separated")
    p.add_argument("--iterations", type=int, default=1, help="rollout iterations (a fresh workload each)")
    p.add_argument(
        "--repeat-prompts", action="store_true",
        help="every iteration samples the same prompts again (fresh responses; +history policies learn)",
    )  # fmt: skip
    p.add_argument("--drift", type=float, default=0.0, help="with --repeat-prompts: per-iteration "
                   "random walk (SD) of each prompt's log mean length (the policy changing)")  # fmt: skip
    add_dispatch_args(p, f" | {KNOWN_ENDS} (peak told the true lengths; simulator only)")
    p.add_argument("--seed", type=int, default=None, help="picks the workload (default 0)")
    p.add_argument(
        "--profile", default=None, help="an instance profile (seer_engine profile) replacing the setup's"
    )
    p.add_argument("--instances", type=int, default=None, help="override the setup's")
    p.add_argument("--prompts", type=int, default=None, help="groups per iteration (override)")
    p.add_argument("--samples", type=int, default=None, help="responses per prompt (override)")
    p.add_argument("--max-tokens", type=int, default=None, help="override the setup's")
    p.add_argument("--chunk-tokens", type=int, default=None, help="override the setup's (paper: 8192)")
    p.add_argument("--starvation-s", type=float, default=None, help="the Context Manager's starvation guard")
    p.add_argument(
        "--across-sigma", type=float, default=None,
        help="sd of the synthetic groups' log mean lengths (override; the setup's: sim/setups.py)",
    )  # fmt: skip
    add_context_order_arg(p)
    p.add_argument(
        "--trace", default=None, help="replay this trace's lengths instead of the synthetic generator"
    )
    p.add_argument(
        "--groups", default=None,
        help="with --trace: exactly these trace groups ('8', '60:90') with unscaled lengths, as bench "
        "rollout replays them (default: every group, cycled to --prompts, lengths scaled to --max-tokens)",
    )  # fmt: skip
    p.add_argument(
        "--acceptance", default=None,
        help="speculation's acceptance model (fit one on the workload's trace with `python -m "
        "seer_engine.sim.acceptance`); default: the committed Qwen3 fit",
    )  # fmt: skip
    p.add_argument(
        "--history-acceptance", default=None,
        help="the same for +history policies once the store holds an iteration (fit with "
        "--history-samples); default: the committed Qwen3 history fit",
    )  # fmt: skip
    p.add_argument(
        "--speculative-config", default=None,
        help="JSON keys laid over the speculative policies' own config (seer: group_suffix, "
        "adaptive budget, 16 nodes), e.g. '{\"budget\": \"fixed\"}'",
    )  # fmt: skip
    p.add_argument("--no-kv-pool", action="store_true", help="moved responses recompute (no global KV pool)")
    p.add_argument(
        "--migration-spread",
        type=int,
        default=32,
        help="place on the least-loaded instance once chunks in flight differ by more than this",
    )
    p.add_argument(
        "--pool-pull-tokens",
        type=int,
        default=512,
        help="a moved response loads its KV from the pool when it lacks more tokens than this",
    )
    p.add_argument("--report", default=None, help="write <setup>/report.json and report.png here")
    p.set_defaults(func=run_simulate)


def _setups(args: argparse.Namespace) -> list:
    from seer_engine.sim.profile import InstanceProfile
    from seer_engine.sim.setups import get_setup

    names = [s.strip() for s in args.setup.split(",") if s.strip()]
    if not names:
        raise ValueError("--setup names no setup")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # the second would run again and overwrite the first's report
        raise ValueError(f"--setup names {', '.join(twice)} more than once")
    profile = InstanceProfile.load(args.profile) if args.profile else None
    overrides = {
        "instances": args.instances, "prompts": args.prompts, "samples": args.samples,
        "max_tokens": args.max_tokens, "chunk_tokens": args.chunk_tokens, "starvation_s": args.starvation_s,
        "profile": profile, "across_sigma": args.across_sigma,
    }  # fmt: skip
    for key in ("instances", "prompts", "samples", "max_tokens", "chunk_tokens"):
        if overrides[key] is not None and overrides[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {overrides[key]}")
    if args.starvation_s is not None and not args.starvation_s >= 0:
        raise ValueError(f"--starvation-s must be >= 0, got {args.starvation_s}")
    if args.across_sigma is not None and not args.across_sigma >= 0:
        raise ValueError(f"--across-sigma must be >= 0, got {args.across_sigma}")
    if args.across_sigma is not None and args.across_sigma > MAX_ACROSS_SIGMA:
        raise ValueError(f"--across-sigma must be at most {MAX_ACROSS_SIGMA:g}, got {args.across_sigma}")
    return [_override(get_setup(n), {k: v for k, v in overrides.items() if v is not None}) for n in names]


def _override(setup, overrides: dict):
    """The setup with the command's overrides; a new max length keeps the setup's
    calibrated mean length in proportion (none at a max of one token, where every
    response is one token and no mean below the max exists)."""
    new_max = overrides.get("max_tokens")
    if new_max is not None and setup.mean_tokens is not None:
        mean = max(1, round(setup.mean_tokens * new_max / setup.max_tokens))
        overrides["mean_tokens"] = mean if mean < new_max else None
    return dataclasses.replace(setup, **overrides)


def _workload(args: argparse.Namespace, setup, iteration: int):
    from seer_engine.sim import simulator

    repeat = args.repeat_prompts
    seed = args.seed if repeat else args.seed + iteration
    if args.trace and args.groups:
        return simulator.bench_groups(
            args.trace, args.groups, setup.samples, setup.max_tokens, iteration=iteration if repeat else 0
        )
    if args.trace:
        return simulator.trace_groups(
            args.trace, setup.prompts, setup.samples, setup.max_tokens, seed,
            iteration=iteration if repeat else 0, iterations=args.iterations if repeat else 1,
        )  # fmt: skip
    return simulator.setup_groups(
        setup, seed, iteration=iteration if repeat else 0, drift=args.drift if repeat else 0.0
    )


def _acceptance_models(args: argparse.Namespace, policies: list[str]) -> dict:
    """``--acceptance`` and ``--history-acceptance``, refused where no policy of the run
    would draft with them."""
    from seer_engine.sim.acceptance import AcceptanceModel

    drafting = [p for p in policies if ROLLOUT_POLICIES[p.removesuffix(HISTORY_SUFFIX)].speculative]
    if args.acceptance and not drafting:
        raise ValueError(f"--acceptance models speculation: none of the policies {policies} speculates")
    if args.history_acceptance and not any(p.endswith(HISTORY_SUFFIX) for p in drafting):
        raise ValueError("--history-acceptance models the speculation of a +history policy that speculates "
                         f"(seer+history): none of {policies} does")  # fmt: skip
    if args.history_acceptance and args.iterations < 2:
        raise ValueError("--history-acceptance is used from the second iteration on, once the history store "
                         "holds one: pass --iterations N > 1")  # fmt: skip
    if args.history_acceptance and not args.repeat_prompts:  # every iteration's prompts are fresh
        raise ValueError("--history-acceptance is used once the history store knows the prompts: "
                         "pass --repeat-prompts")  # fmt: skip

    return {
        "plain": AcceptanceModel.load(args.acceptance) if args.acceptance else None,
        "history": AcceptanceModel.load(args.history_acceptance) if args.history_acceptance else None,
    }


def _speculative_overrides(value: str | None, policies: list[str]) -> dict:
    """``--speculative-config``: keys checked against every speculative policy's config
    now, not when its turn comes."""
    if value is None:
        return {}
    from seer_engine.sim.simulator import simulated_speculation
    from seer_engine.spec_decode.config import json_object

    overrides = json_object(value)
    specs = [ROLLOUT_POLICIES[name.removesuffix(HISTORY_SUFFIX)].speculative for name in policies]
    specs = [spec for spec in specs if spec is not None]
    if not specs:
        raise ValueError(f"--speculative-config: none of the policies {policies} speculates (seer does)")
    for spec in specs:
        simulated_speculation({**spec, **overrides})
    return overrides


def run_simulate(args: argparse.Namespace) -> int:
    from seer_engine.rollout.history import HistoryStore
    from seer_engine.sim.acceptance import acceptance_for
    from seer_engine.sim.diagnostics import diagnostics, format_diagnostics
    from seer_engine.sim.simulator import policy_for, simulate

    policies = distinct_policies(rollout_policy_names(args.policy))
    check_context_flags(policies, args.starvation_s, args.context_order)
    if args.groups and (args.seed, args.prompts) != (None, None):  # they would change nothing
        raise ValueError(
            "--seed and --prompts pick the groups (synthetic, or trace groups cycled to --prompts); "
            "--groups names the trace groups itself"
        )
    args.seed = 0 if args.seed is None else args.seed
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    if args.iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {args.iterations}")
    if not (math.isfinite(args.drift) and args.drift >= 0):  # inf put every length at 1 or the max
        raise ValueError(f"--drift must be a finite number >= 0, got {args.drift}")
    if args.repeat_prompts and args.iterations < 2:
        raise ValueError(
            "--repeat-prompts samples the same prompts in later iterations: pass --iterations N > 1 too"
        )
    if args.drift and not args.repeat_prompts:
        raise ValueError("--drift moves repeated prompts: pass --repeat-prompts too")
    args.admission = check_dispatch_rules(args.admission, args.backfill, own_rules=(KNOWN_ENDS,))
    if args.report:
        writable_dir(args.report, "--report")
    if args.groups and not args.trace:
        raise ValueError("--groups selects trace groups: pass --trace too")
    if args.trace and (args.drift or args.across_sigma is not None):  # it would change nothing
        flag = "--drift" if args.drift else "--across-sigma"
        raise ValueError(f"{flag} shapes the synthetic workload's lengths; --trace replays the trace's own")
    if args.groups and args.iterations > 1 and not args.repeat_prompts:  # each would replay the first
        raise ValueError(
            "--groups fixes the groups, so every iteration would replay the same responses: pass "
            "--repeat-prompts to take disjoint sibling sets of them, as bench rollout --iterations does"
        )
    if args.trace:
        from seer_engine.workloads.paths import resolve_trace_path

        try:
            args.trace = str(resolve_trace_path(args.trace))
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    spec_overrides = _speculative_overrides(args.speculative_config, policies)
    for flag in ("migration_spread", "pool_pull_tokens"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    placement = SeerPlacement(args.migration_spread, args.pool_pull_tokens)
    acceptance = _acceptance_models(args, policies)
    setups = _setups(args)
    if args.report:  # each setup's folder too: a file in its place failed only after the run
        for setup in setups:
            writable_dir(Path(args.report) / setup.name, "--report")
    for setup in setups:
        built = {}  # iteration -> its workload, built ahead of its turn
        if args.trace and args.groups:
            # The trace groups are the prompts (the header and report count them); a trace
            # too short for the last iteration fails now.
            built[args.iterations - 1] = _workload(args, setup, args.iterations - 1)
            setup = dataclasses.replace(setup, prompts=len(built[args.iterations - 1]))
        p = setup.profile
        print(f"simulate {setup.name}: {setup.instances} instances x {p.kv_capacity_tokens:,} KV tokens, "
              f"{setup.prompts} prompts x {setup.samples} responses, max {setup.max_tokens:,} tokens, "
              f"chunk {setup.chunk_tokens:,}; step = {p.step.describe()}", flush=True)  # fmt: skip
        runs: list[dict[str, RolloutResult]] = []
        stores = {name: HistoryStore() for name in policies if name.endswith(HISTORY_SUFFIX)}
        for it in range(args.iterations):
            groups = built.pop(it) if it in built else _workload(args, setup, it)
            total = sum(len(g.lengths) for g in groups)
            results = {}
            for name in policies:
                label = f"{setup.name} iter {it + 1}/{args.iterations} {name}"
                start = time.perf_counter()
                store = stores.get(name)
                policy = policy_for(
                    name, groups, setup.max_tokens, setup.starvation_s, store, args.context_order
                )
                if spec_overrides and policy.speculative is not None:
                    policy.speculative = {**policy.speculative, **spec_overrides}
                prompts = [g.prompt for g in groups]
                plain, seeded = acceptance["plain"], acceptance["history"]
                model = acceptance_for(store, setup.samples, plain, seeded, prompts)
                results[name] = simulate(
                    groups, policy, p, setup.instances, setup.max_tokens, setup.chunk_tokens, placement,
                    acceptance=model, pooled=not args.no_kv_pool,
                    on_sample_finished=Progress(label, total), admission=args.admission,
                    backfill=args.backfill,
                )  # fmt: skip
                if store is not None:
                    store.next_iteration()
                m = results[name].metrics
                print(f"[{label}] simulated {m.makespan_s:,.0f}s in {time.perf_counter() - start:.1f}s wall",
                      flush=True)  # fmt: skip
                if policy.context.spread.prompts:
                    spread = policy.context.spread.ratio()
                    print(f"[{label}] context order for known prompts: {policy.context.effective_order} "
                          f"(their length spread is {spread:.2f}x the within-prompt one)")  # fmt: skip
            runs.append(results)
            print(format_table(results))
            if "baseline" in results:
                print(format_diagnostics(setup.name, diagnostics(results["baseline"])))
        summary = _summary(runs)
        print(_format_summary(setup.name, summary))
        if args.report:
            _write(Path(args.report) / setup.name, setup, runs, summary, args)
    return 0


def _summary(runs: list[dict[str, RolloutResult]]) -> dict[str, dict]:
    """Per policy over the iterations: mean throughput, makespan, tail, and vs baseline.
    The tail reduction is the mean over the iterations whose baseline has a tail (as
    ``vs_baseline`` has it per iteration); None where none has."""
    out = {}
    for name in runs[0]:
        ms = [r[name].metrics for r in runs]
        row = {
            "throughput_tokens_per_s": statistics.mean(m.throughput_tokens_per_s for m in ms),
            "makespan_s": statistics.mean(m.makespan_s for m in ms),
            "tail_s": statistics.mean(m.tail_s for m in ms),
            "preemptions": statistics.mean(m.preemptions for m in ms),
            "chunk_cuts": statistics.mean(m.chunk_cuts for m in ms),
            "idle_fraction": statistics.mean(m.idle_fraction for m in ms),
        }
        if "baseline" in runs[0]:
            base = [r["baseline"].metrics for r in runs]
            row["throughput_x_baseline"] = statistics.mean(
                m.throughput_tokens_per_s / b.throughput_tokens_per_s for m, b in zip(ms, base)
            )
            cuts = [1 - m.tail_s / b.tail_s for m, b in zip(ms, base) if b.tail_s]
            row["tail_reduction_vs_baseline"] = statistics.mean(cuts) if cuts else None
        if "oracle" in runs[0]:
            row["throughput_x_oracle"] = statistics.mean(
                m.throughput_tokens_per_s / r["oracle"].metrics.throughput_tokens_per_s
                for m, r in zip(ms, runs)
            )
        out[name] = {k: None if v is None else round(v, 4) for k, v in row.items()}
    return out


def _format_summary(setup: str, summary: dict[str, dict]) -> str:
    w = max(10, *(len(name) for name in summary))
    lines = [f"{setup}: mean over iterations", f"{'policy':>{w}} {'tokens/s':>11} {'makespan_s':>11} "
             f"{'tail_s':>9} {'preempt':>8} {'idle':>6} {'x baseline':>11} {'tail vs base':>13}"]  # fmt: skip
    for name, r in summary.items():
        x = r.get("throughput_x_baseline")
        tail = r.get("tail_reduction_vs_baseline")
        change = "" if tail is None else f"{-tail:+.0%}".replace("-0%", "+0%")
        lines.append(
            f"{name:>{w}} {r['throughput_tokens_per_s']:>11,.0f} {r['makespan_s']:>11,.0f} "
            f"{r['tail_s']:>9,.0f} {r['preemptions']:>8,.0f} {r['idle_fraction']:>6.1%} "
            f"{'' if x is None else f'{x:.2f}x':>11} {change:>13}"
        )
    return "\n".join(lines)


def _write(out: Path, setup, runs: list[dict[str, RolloutResult]], summary: dict, args) -> None:
    from seer_engine.sim.diagnostics import PAPER_BASELINE, diagnostics

    meta = {
        "command": shlex.join(["seer_engine", *args.argv]),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "setup": setup.name, "gpus": setup.gpus, "instances": setup.instances, "prompts": setup.prompts,
        "samples": setup.samples, "max_tokens": setup.max_tokens, "chunk_tokens": setup.chunk_tokens,
        "starvation_s": setup.starvation_s, "iterations": args.iterations, "seed": args.seed,
        "workload": args.trace or "synthetic", "kv_pool": not args.no_kv_pool,
        "mean_tokens": None if args.trace else setup.mean_tokens,
        "across_sigma": None if args.trace else setup.across_sigma,
        "repeat_prompts": args.repeat_prompts, "drift": args.drift,
        "admission": args.admission, "backfill": args.backfill, "context_order": args.context_order,
        "acceptance": args.acceptance or "default",
        "history_acceptance": args.history_acceptance or "default",
        "profile": dataclasses.asdict(setup.profile), "notes": setup.notes,
        "policies_iteration": 1,  # the iteration the top-level keys and the figures show
    }  # fmt: skip
    path = write_report(out, runs[0], meta)  # figures and per-policy keys: the first iteration
    report = json.loads(path.read_text())
    report["iterations"] = [{"policies": {n: policy_summary(r) for n, r in run.items()}} for run in runs]
    report["mean_over_iterations"] = summary
    if "baseline" in runs[0]:
        report["baseline_diagnostics"] = {
            "simulated": [diagnostics(run["baseline"]) for run in runs],
            "paper": PAPER_BASELINE,
        }
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {written(path)}")
