"""CPU cost of the speculative-decoding drafter, measured from Python on a real rollout trace.

Why: the drafter runs on the engine's critical path between two decode steps, once per
request, so its per-token and per-call cost must stay in the microseconds for grouped
speculation to pay off (the Seer paper builds its tree in C++ for this reason).

What is simulated, per group of the trace: the prompt goes in once, then the siblings
decode in lock-step; every step each live sibling appends its next real token (one
``append`` call per sibling, as ``SuffixProposer.observe`` does), and then each drafts
with budget ``--budget``: ``speculate_sequence`` and ``speculate`` on a context tail
(the last ``max_depth // 2`` tokens of prompt + output), each single-path and multi-path.
Every call is timed alone with ``time.perf_counter_ns`` (garbage collection paused while
timing, as ``timeit`` does); arguments (token slices, context tails) are built outside
the timed region, the way the engine's caller already holds them.

Measured: (a) the C++ tree through ``GroupSuffixTrees``; (b) the pure-Python reference
``RefGroupSuffixTree`` (a brute-force test oracle, so on a short prefix only); (c) the
engine-facing proposers on ``Request`` objects: ``NgramProposer.propose`` and, for the
same calls, ``SuffixProposer.observe`` / ``propose``. Also tree memory per group and how
the lock-step append cost depends on ``max_depth``. The "accepted" column is how much of
each draft greedy verification would take; siblings still advance one token per step,
so it is not the accepted tokens per step of a rollout that advances by what it accepts.

It prints and writes measured figures only; what they mean is in
``benchmarks/results/drafter_cost/README.md``, written from a recorded run.

    python benchmarks/drafter_cost.py [--groups 12] [--samples 8] [--budget 16]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from seer_engine.core.draft import DraftTree
from seer_engine.core.request import Request
from seer_engine.rollout.machine import machine_info
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.acceptance_replay import accepted_len
from seer_engine.spec_decode._suffix_tree_ref import RefGroupSuffixTree
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.proposers import NgramProposer, SuffixProposer
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY, GroupSuffixTree, GroupSuffixTrees
from seer_engine.workloads.groups import select_groups
from seer_engine.workloads.paths import traces_dir
from seer_engine.workloads.traces import TraceGroup, load_trace

DEFAULT_TRACE = traces_dir() / "qwen3-8b-mcq-cot.jsonl.gz"
REPO = Path(__file__).resolve().parents[1]

# Targets for this benchmark (µs per call, mean).
TARGET_APPEND_US = 2.0
TARGET_SPECULATE_US = 20.0

# Timed operations of the tree passes, in report order.
SPEC_KINDS = ("spec_seq_single", "spec_seq_multi", "spec_tail_single", "spec_tail_multi")
LABELS = {
    "append": "append (per token)",
    "spec_seq_single": "speculate_sequence, single path",
    "spec_seq_multi": "speculate_sequence, multi-path",
    "spec_tail_single": "speculate(context tail), single path",
    "spec_tail_multi": "speculate(context tail), multi-path",
    "ngram_propose": "NgramProposer.propose",
    "suffix_observe": "SuffixProposer.observe (grouped, 1 token)",
    "suffix_propose": "SuffixProposer.propose (grouped, multi-path)",
}


class Samples:
    """Per-operation timings (ns) plus draft sizes and accepted lengths, kept raw for percentiles."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {}
        self.draft_len: dict[str, list[int]] = {}
        self.accepted: dict[str, list[int]] = {}
        self.grew: list[bool] = []  # per append: did the node vector double (a copy) during it

    def growth(self) -> dict[str, float]:
        """How much of the append time went to the calls during which the node vector doubled."""
        ns = self.ns.get("append", [])
        if len(self.grew) != len(ns) or not ns:
            return {}
        grown = [v for v, g in zip(ns, self.grew) if g]
        rest = [v for v, g in zip(ns, self.grew) if not g]
        return {
            "growth_calls": len(grown),
            "growth_share_of_time": sum(grown) / sum(ns),
            "growth_max_us": max(grown, default=0) / 1e3,
            "mean_us_without_growth": statistics.fmean(rest or [0]) / 1e3,
        }

    def time(self, op: str, ns: int) -> None:
        self.ns.setdefault(op, []).append(ns)

    def draft(self, op: str, draft: DraftTree, truth: Sequence[int]) -> None:
        self.draft_len.setdefault(op, []).append(len(draft))
        self.accepted.setdefault(op, []).append(accepted_len(draft, truth))

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for op, values in self.ns.items():
            us = sorted(v / 1e3 for v in values)
            row = {
                "calls": len(us),
                "mean_us": statistics.fmean(us),
                "p50_us": us[len(us) // 2],
                "p99_us": us[min(len(us) - 1, int(0.99 * len(us)))],
                "max_us": us[-1],
                # Rare multi-µs stalls (page faults of a growing tree, another job
                # taking the CPU) can dominate a mean of sub-µs calls: say how much they weigh.
                "share_of_time_over_50us": sum(v for v in us if v > 50) / sum(us),
                "mean_us_without_over_50us": statistics.fmean([v for v in us if v <= 50] or [0.0]),
            }
            if op in self.draft_len:
                row["mean_draft_nodes"] = statistics.fmean(self.draft_len[op])
                row["mean_accepted"] = statistics.fmean(self.accepted[op])
            out[op] = row
        out.get("append", {}).update(self.growth())
        return out


def timer_overhead_ns(repeats: int = 20000) -> float:
    """Cost of one empty perf_counter_ns pair: included in (not subtracted from) every figure."""
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        start = clock()
        for _ in range(repeats):
            clock()
        best = min(best, (clock() - start) / repeats)
    return best


def lockstep(responses: list[list[int]], steps: int | None = None):
    """(step, sibling index) pairs in lock-step order, siblings dropping out as they finish."""
    longest = max(len(r) for r in responses)
    for step in range(longest if steps is None else min(steps, longest)):
        yield step, [k for k, r in enumerate(responses) if step < len(r)]


def tree_pass(
    groups: Sequence[TraceGroup],
    make_tree: Callable[[], Any],
    budget: int,
    max_depth: int,
    steps: int | None,
    progress: str,
) -> tuple[Samples, list[dict[str, Any]]]:
    """Lock-step appends and the four draft calls on one tree kind; ``make_tree`` gives either a
    ``GroupSuffixTrees`` (C++) or a ``RefAdapter`` (pure Python) with the same methods."""
    samples = Samples()
    memory: list[dict[str, Any]] = []
    clock = time.perf_counter_ns
    tail_len = max_depth // 2
    for gi, group in enumerate(groups):
        t0 = time.perf_counter()
        trees = make_tree()
        gid = group.group_id
        prompt = list(group.prompt_token_ids)
        responses = group.response_token_ids
        trees.append(gid, PROMPT_KEY, prompt)
        contexts = [prompt + r for r in responses]
        plen = len(prompt)
        appended = 0
        # The C++ node vector doubles (copy + fresh pages) when the node count passes a power of
        # two; ``num_nodes`` is O(1) there (``memory_bytes`` walks every edge list: too slow).
        cpp_tree = trees.tree(gid)
        num_nodes = cpp_tree.num_nodes if isinstance(cpp_tree, GroupSuffixTree) else None
        first = {op: len(samples.ns.get(op, [])) for op in ("append", *SPEC_KINDS)}
        gc.disable()
        try:
            for step, live in lockstep(responses, steps):
                for k in live:
                    token = responses[k][step : step + 1]
                    before = num_nodes() if num_nodes else 0
                    start = clock()
                    trees.append(gid, k, token)
                    samples.time("append", clock() - start)
                    if num_nodes:
                        samples.grew.append((num_nodes() - 1).bit_length() > (before - 1).bit_length())
                    appended += 1
                for k in live:
                    end = plen + step + 1
                    tail = contexts[k][max(0, end - tail_len) : end]
                    truth = responses[k][step + 1 : step + 1 + budget]
                    for op, multi in (("spec_seq_single", False), ("spec_seq_multi", True)):
                        start = clock()
                        draft = trees.speculate_sequence(gid, k, budget, multi)
                        samples.time(op, clock() - start)
                        samples.draft(op, draft, truth)
                    for op, multi in (("spec_tail_single", False), ("spec_tail_multi", True)):
                        start = clock()
                        draft = trees.speculate(gid, tail, budget, multi)
                        samples.time(op, clock() - start)
                        samples.draft(op, draft, truth)
        finally:
            gc.enable()
        tree = trees.tree(gid)
        row = {
            "group_id": gid,
            "responses": len(responses),
            "prompt_tokens": plen,
            "tokens": tree.num_tokens(),
            "append_us": statistics.fmean(samples.ns["append"][first["append"] :]) / 1e3,
            "speculate_us": statistics.fmean(v for op in SPEC_KINDS for v in samples.ns[op][first[op] :])
            / 1e3,
        }
        if hasattr(tree, "memory_bytes"):
            row.update(num_nodes=tree.num_nodes(), memory_bytes=tree.memory_bytes())
            row["bytes_per_token"] = row["memory_bytes"] / row["tokens"]
        memory.append(row)
        trees.free(gid)
        print(
            f"[{progress}] group {gi + 1}/{len(groups)} {gid}: {appended} appends, "
            f"{row['tokens']} tokens in tree, {time.perf_counter() - t0:.2f}s",
            flush=True,
        )
    return samples, memory


class RefAdapter:
    """The reference tree behind the ``GroupSuffixTrees`` calls the tree pass makes."""

    def __init__(self, max_depth: int, min_prob: float = 0.1, backoff: float = 0.0) -> None:
        self.max_depth = max_depth
        self.min_prob = min_prob
        self.backoff = backoff
        self._trees: dict[str, RefGroupSuffixTree] = {}

    def append(self, group_id: str, seq_key: int, tokens: list[int]) -> None:
        self._trees.setdefault(group_id, RefGroupSuffixTree(self.max_depth)).extend(seq_key, tokens)

    def speculate(self, group_id: str, tail: list[int], budget: int, multi_path: bool) -> DraftTree:
        tree = self._trees[group_id]
        opts = (self.min_prob, 0.0, self.max_depth // 2, self.backoff)
        return DraftTree(*tree.speculate(tail, budget, multi_path, *opts))

    def speculate_sequence(self, group_id: str, key: int, budget: int, multi_path: bool) -> DraftTree:
        tree = self._trees[group_id]
        opts = (self.min_prob, 0.0, self.max_depth // 2, self.backoff)
        return DraftTree(*tree.speculate_sequence(key, budget, multi_path, *opts))

    def tree(self, group_id: str) -> RefGroupSuffixTree:
        return self._trees[group_id]

    def free(self, group_id: str) -> None:
        self._trees.pop(group_id, None)


def proposer_pass(
    groups: Sequence[TraceGroup], budget: int, max_depth: int, min_prob: float, backoff: float
) -> Samples:
    """The engine-facing path: ``Request`` objects fed token by token to both proposers."""
    samples = Samples()
    clock = time.perf_counter_ns
    ngram = NgramProposer(SpeculativeConfig(method="ngram"))
    config = SpeculativeConfig(method="group_suffix", max_depth=max_depth, min_prob=min_prob, backoff=backoff)
    suffix = SuffixProposer(config, grouped=True)
    params = SamplingParams(temperature=0.0, max_tokens=None)
    for gi, group in enumerate(groups):
        t0 = time.perf_counter()
        responses = group.response_token_ids
        requests = [
            Request(
                request_id=f"{group.group_id}/{k}",
                prompt_token_ids=list(group.prompt_token_ids),
                sampling_params=params,
                max_tokens=1 << 20,
                seed=k,
                group_id=group.group_id,
                sample_index=k,
            )
            for k in range(len(responses))
        ]
        for req in requests:
            suffix.observe(req)  # registers the sequence (and the prompt once per group)
        gc.disable()
        try:
            for step, live in lockstep(responses):
                for k in live:
                    requests[k].append_output_token(responses[k][step])
                    start = clock()
                    suffix.observe(requests[k])
                    samples.time("suffix_observe", clock() - start)
                for k in live:
                    truth = responses[k][step + 1 : step + 1 + budget]
                    start = clock()
                    draft = ngram.propose(requests[k], budget, False)
                    samples.time("ngram_propose", clock() - start)
                    samples.draft("ngram_propose", draft, truth)
                    start = clock()
                    draft = suffix.propose(requests[k], budget, True)
                    samples.time("suffix_propose", clock() - start)
                    samples.draft("suffix_propose", draft, truth)
        finally:
            gc.enable()
        suffix.finish_group(group.group_id)
        print(
            f"[proposers] group {gi + 1}/{len(groups)} {group.group_id}: {time.perf_counter() - t0:.2f}s",
            flush=True,
        )
    return samples


def depth_sweep(group: TraceGroup, depths: Sequence[int]) -> list[dict[str, float]]:
    """Lock-step append cost and memory against ``max_depth``: the knob that trades them for
    match length. Also the same tokens appended one whole response at a time, to separate the
    per-token work from the cache misses of interleaving siblings."""
    clock = time.perf_counter_ns
    responses = group.response_token_ids
    rows = []
    for depth in depths:
        trees = GroupSuffixTrees(max_depth=depth)
        trees.append("g", PROMPT_KEY, list(group.prompt_token_ids))
        total = n = 0
        gc.disable()
        try:
            for step, live in lockstep(responses):
                for k in live:
                    token = responses[k][step : step + 1]
                    start = clock()
                    trees.append("g", k, token)
                    total += clock() - start
                    n += 1
        finally:
            gc.enable()
        tree = trees.tree("g")
        bulk = GroupSuffixTree(depth)
        start = clock()
        for k, r in enumerate(responses):
            bulk.extend(k, r)
        bulk_ns = clock() - start
        rows.append(
            {
                "max_depth": depth,
                "lockstep_append_us": total / n / 1e3,
                "bulk_append_us": bulk_ns / n / 1e3,
                "nodes_per_token": tree.num_nodes() / tree.num_tokens(),
                "bytes_per_token": tree.memory_bytes() / tree.num_tokens(),
            }
        )
        print(f"[depth sweep] max_depth {depth}: {rows[-1]['lockstep_append_us']:.2f} µs/token", flush=True)
    return rows


def best_of(runs: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per operation, the repeat with the lowest mean (least disturbed by other jobs on the
    machine), with every repeat's mean kept beside it so the spread stays visible."""
    out = {}
    for op in runs[0]:
        best = min(runs, key=lambda r: r[op]["mean_us"])[op]
        out[op] = {**best, "repeat_means_us": [r[op]["mean_us"] for r in runs]}
    return out


def op_rows(summary: dict[str, dict[str, Any]], ops: Sequence[str]) -> list[str]:
    """Markdown rows: calls, mean (best repeat), p50, p99, the repeats' means, draft size, accepted."""
    rows = []
    for op in ops:
        if op not in summary:
            rows.append(f"| {LABELS[op]} | not run | | | | | | |")
            continue
        r = summary[op]
        spread = " / ".join(f"{v:.2f}" for v in r.get("repeat_means_us", [r["mean_us"]]))
        drafts = (
            f"{r['mean_draft_nodes']:.1f} | {r['mean_accepted']:.2f}" if "mean_draft_nodes" in r else "– | –"
        )
        rows.append(
            f"| {LABELS[op]} | {r['calls']:,} | **{r['mean_us']:.2f}** | {r['p50_us']:.2f} | "
            f"{r['p99_us']:.2f} | {spread} | {drafts} |"
        )
    return rows


OPS_HEADER = [
    "| operation | calls | mean µs | p50 µs | p99 µs | mean µs per repeat | draft nodes | accepted |",
    "|---|---|---|---|---|---|---|---|",
]


def target_rows(res: dict[str, Any]) -> list[str]:
    """Markdown rows: each target, the measured mean (best repeat), every repeat's mean, met or not."""
    cpp, prop = res["cpp"], res["proposers"]
    worst_kind = max(SPEC_KINDS, key=lambda k: cpp[k]["mean_us"])
    checks = [
        ("append per token, `GroupSuffixTrees`", cpp["append"], TARGET_APPEND_US),
        (f"draft call, `GroupSuffixTrees` (slowest kind: {LABELS[worst_kind]})", cpp[worst_kind],
         TARGET_SPECULATE_US),
    ]  # fmt: skip
    if prop:
        checks += [
            ("observe per token, `SuffixProposer` on `Request`", prop["suffix_observe"], TARGET_APPEND_US),
            ("draft call, `SuffixProposer` on `Request`", prop["suffix_propose"], TARGET_SPECULATE_US),
        ]
    rows = []
    for label, r, target in checks:
        repeats = r.get("repeat_means_us", [r["mean_us"]])
        met = sum(v <= target for v in repeats)
        rows.append(
            f"| {label} | {target:g} | **{r['mean_us']:.2f}** | {' / '.join(f'{v:.2f}' for v in repeats)} | "
            f"{'met' if r['mean_us'] <= target else 'not met'} ({met}/{len(repeats)} repeats) |"
        )
    return rows


def write_markdown(path: Path, res: dict[str, Any]) -> None:
    """The measured figures as tables; what they mean is in the folder's hand-written README.md."""
    cpp, ref, ref_cpp, prop = res["cpp"], res["ref"], res["ref_cpp"], res["proposers"]
    cfg, host, mem = res["config"], res["machine"], res["memory"]
    append = cpp["append"]
    lines = [
        "# Drafter CPU cost, measured from Python",
        "",
        f"- command (repo root): `{res['command']}` ({res['wall_s']:.0f} s; `drafter_cost.json`, "
        "`drafter_cost.png`)",
        f"- date: {res['date']}",
        f"- machine: {host['cpu']}, {host['cpu_count']} CPUs, {host['platform']}, Python {host['python']}; "
        f"1-minute load average {host['loadavg_1m_at_start']:.2f} at the start, "
        f"{host['loadavg_1m_at_end']:.2f} at the end",
        f"- workload: {len(mem)} groups of `{Path(cfg['trace']).name}` (`--groups {cfg['groups']}`), "
        f"{cfg['samples']} responses each in lock-step, {sum(m['tokens'] for m in mem):,} tokens in the "
        f"trees; budget {cfg['budget']}, `max_depth` {cfg['max_depth']}, "
        f"`min_prob` {cfg.get('min_prob', 0.1)}, "
        f"`backoff` {cfg.get('backoff', 0.0)}, context tail "
        f"{cfg['max_depth'] // 2} tokens",
        f"- timer pair (included in every figure): {res['timer_overhead_ns']:.0f} ns; C++ passes: "
        f"{cfg['repeats']}, each figure from the repeat with the lowest mean",
        "",
        "## Targets (mean µs per call)",
        "",
        "| operation | target | best repeat | every repeat | verdict |",
        "|---|---|---|---|---|",
        *target_rows(res),
        "",
        "## (a) C++ group suffix tree through `GroupSuffixTrees`",
        "",
        *OPS_HEADER,
        *op_rows(cpp, ("append", *SPEC_KINDS)),
        "",
        "Draft nodes and accepted: means per call; accepted = the real next tokens that greedy "
        "verification would take from the draft (siblings advance one token per step whatever is accepted).",
        "",
        "| append calls | p50 µs | share of time in calls > 50 µs | mean µs without them | calls while "
        "nodes passed a power of two | their share of time | their max ms | mean µs of the others |",
        "|---|---|---|---|---|---|---|---|",
        f"| {append['calls']:,} | {append['p50_us']:.2f} | {100 * append['share_of_time_over_50us']:.1f}% | "
        f"{append['mean_us_without_over_50us']:.2f} | {append.get('growth_calls', 0):,} | "
        f"{100 * append.get('growth_share_of_time', 0):.1f}% | {append.get('growth_max_us', 0) / 1e3:.2f} | "
        f"{append.get('mean_us_without_growth', 0):.2f} |",
        "",
        "## Tree memory and cost per group (first repeat)",
        "",
        "| group | responses | tokens | nodes | nodes/token | MiB | bytes/token | append µs | speculate µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in mem:
        lines.append(
            f"| {m['group_id']} | {m['responses']} | {m['tokens']:,} | {m['num_nodes']:,} | "
            f"{m['num_nodes'] / m['tokens']:.1f} | {m['memory_bytes'] / 2**20:.1f} | "
            f"{m['bytes_per_token']:.0f} | {m['append_us']:.2f} | {m['speculate_us']:.2f} |"
        )
    lines += [
        "",
        "Speculate µs: mean over the four draft kinds; `memory_bytes` counts vector capacities.",
        "",
        "## `max_depth` against append cost and memory (first group)",
        "",
        "| max_depth | lock-step append µs/token | one response at a time | nodes/token | bytes/token |",
        "|---|---|---|---|---|",
    ]
    for d in res["depth_sweep"]:
        lines.append(
            f"| {d['max_depth']} | {d['lockstep_append_us']:.2f} | {d['bulk_append_us']:.2f} | "
            f"{d['nodes_per_token']:.1f} | {d['bytes_per_token']:.0f} |"
        )
    lines += [
        "",
        f"## (b) Pure-Python reference (`RefGroupSuffixTree`), first {cfg['ref_steps']} steps of "
        f"{cfg['ref_groups']} group(s), up to {max(m['tokens'] for m in res['ref_memory']):,} tokens",
        "",
        "| operation | Python reference mean µs | C++ same prefix mean µs | ratio |",
        "|---|---|---|---|",
    ]
    for op in ("append", *SPEC_KINDS):
        a, b = ref[op]["mean_us"], ref_cpp[op]["mean_us"]
        lines.append(f"| {LABELS[op]} | {a:,.1f} | {b:.2f} | {a / b:,.{0 if a / b >= 10 else 1}f}x |")
    lines += [
        "",
        "## (c) Engine-facing proposers on `Request` objects (same groups, same lock-step, one pass)",
        "",
        *OPS_HEADER,
        *op_rows(prop, ("suffix_observe", "suffix_propose", "ngram_propose")),
        "",
        "![drafter cost](drafter_cost.png)",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def _fmt(us: float) -> str:
    return f"{us:,.0f}" if us >= 100 else f"{us:.2f}"


def plot(path: Path, res: dict[str, Any]) -> None:
    """Log-scale bars: C++, its short-prefix run, the Python reference, the proposers, with targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ["append", *SPEC_KINDS]
    short = ["append\n/token", "spec_seq\nsingle", "spec_seq\nmulti", "spec tail\nsingle", "spec tail\nmulti"]
    series = [
        ("C++ tree (GroupSuffixTrees)", [res["cpp"][o]["mean_us"] for o in ops], "tab:blue"),
        (
            f"Python reference (first {res['config']['ref_steps']} steps, "
            f"<= {max(m['tokens'] for m in res['ref_memory'])} tokens)",
            [res["ref"][o]["mean_us"] for o in ops],
            "tab:red",
        ),
    ]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.38
    for i, (label, values, color) in enumerate(series):
        xs = [x + (i - 0.5) * width for x in range(len(ops))]
        bars = ax.bar(xs, values, width, label=label, color=color)
        ax.bar_label(bars, labels=[_fmt(v) for v in values], fontsize=7)
    prop = res["proposers"]
    extra = [
        ("SuffixProposer\n.propose", prop.get("suffix_propose", {}).get("mean_us", 0.0), "tab:green"),
        ("NgramProposer\n.propose", prop.get("ngram_propose", {}).get("mean_us", 0.0), "tab:orange"),
    ]
    for j, (name, value, color) in enumerate(extra if prop else []):
        x = len(ops) + j
        bars = ax.bar([x], [value], width, color=color, label=name.replace("\n", ""))
        ax.bar_label(bars, labels=[_fmt(value)], fontsize=7)
        short.append(name)
    ax.axhline(TARGET_APPEND_US, color="gray", ls="--", lw=1, label=f"append target {TARGET_APPEND_US:g} µs")
    ax.axhline(
        TARGET_SPECULATE_US, color="black", ls=":", lw=1, label=f"speculate target {TARGET_SPECULATE_US:g} µs"
    )
    ax.set_xticks(range(len(short)), short, fontsize=8)
    ax.set_yscale("log")
    tallest = max([v for _, values, _ in series for v in values] + [e[1] for e in extra])
    ax.set_ylim(0.1, tallest * 40)  # headroom above the bars for the legend
    ax.set_ylabel("µs per call (mean, from Python)")
    ax.set_title(
        f"Drafter CPU cost, budget {res['config']['budget']}, "
        f"{res['config']['samples']} siblings in lock-step"
    )
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="rollout trace (.jsonl.gz)")
    parser.add_argument("--groups", default="12", help="'12' (first 12) or '30:42'")
    parser.add_argument("--samples", type=int, default=8, help="responses (siblings) per group")
    parser.add_argument("--budget", type=int, default=16, help="draft budget per speculate call")
    parser.add_argument(
        "--max-depth", type=int, default=64, help="suffix tree depth (the engine's default: 64)"
    )
    parser.add_argument(
        "--min-prob", type=float, default=0.1, help="drop draft nodes below this path probability"
    )
    parser.add_argument(
        "--backoff", type=float, default=0.0, help="backoff pseudo-counts (0: the longest match alone)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="C++ passes; each figure keeps its best")
    parser.add_argument("--ref-groups", type=int, default=1, help="groups for the pure-Python reference")
    parser.add_argument("--ref-steps", type=int, default=12, help="lock-step steps for the Python reference")
    parser.add_argument("--depths", default="16,32,64", help="max_depth values for the append sweep")
    parser.add_argument("--no-proposers", action="store_true", help="skip the Request-level proposer pass")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "drafter_cost"))
    parser.add_argument(
        "--render", action="store_true", help="only rewrite the .md and .png from the .json under --out"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:
        res = json.loads((out / "drafter_cost.json").read_text(encoding="utf-8"))
        write_markdown(out / "drafter_cost.md", res)
        plot(out / "drafter_cost.png", res)
        print(f"rendered {out}/drafter_cost.{{md,png}}")
        return 0

    wall = time.perf_counter()
    groups = select_groups(load_trace(args.trace), args.groups, args.samples)
    for g in groups:  # tokenize up front, outside every timed region
        g.response_token_ids  # noqa: B018
    print(f"{len(groups)} groups x {args.samples} responses from {args.trace}", flush=True)
    host = machine_info()
    overhead = timer_overhead_ns()

    def cpp_trees() -> GroupSuffixTrees:
        return GroupSuffixTrees(max_depth=args.max_depth, min_prob=args.min_prob, backoff=args.backoff)

    def ref_trees() -> RefAdapter:
        return RefAdapter(args.max_depth, args.min_prob, args.backoff)

    cpp_runs, memory = [], []
    for r in range(args.repeats):
        run, mem = tree_pass(
            groups, cpp_trees, args.budget, args.max_depth, None, f"C++ {r + 1}/{args.repeats}"
        )
        cpp_runs.append(run.summary())
        memory = memory or mem
    ref_groups = groups[: args.ref_groups]
    ref, ref_memory = tree_pass(
        ref_groups, ref_trees, args.budget, args.max_depth, args.ref_steps, "Python ref"
    )
    ref_cpp, _ = tree_pass(
        ref_groups, cpp_trees, args.budget, args.max_depth, args.ref_steps, "C++ same prefix"
    )
    prop = (
        Samples()
        if args.no_proposers
        else proposer_pass(groups, args.budget, args.max_depth, args.min_prob, args.backoff)
    )
    sweep = depth_sweep(groups[0], [int(d) for d in args.depths.split(",")])

    res: dict[str, Any] = {
        "command": " ".join(["python benchmarks/drafter_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {**host, "loadavg_1m_at_end": os.getloadavg()[0]},
        "config": {
            "trace": args.trace,
            "groups": args.groups,
            "samples": args.samples,
            "budget": args.budget,
            "max_depth": args.max_depth,
            "min_prob": args.min_prob,
            "backoff": args.backoff,
            "repeats": args.repeats,
            "ref_groups": args.ref_groups,
            "ref_steps": args.ref_steps,
        },
        "timer_overhead_ns": overhead,
        "targets_us": {"append": TARGET_APPEND_US, "speculate": TARGET_SPECULATE_US},
        "cpp": best_of(cpp_runs),
        "cpp_repeats": cpp_runs,
        "memory": memory,
        "ref": ref.summary(),
        "ref_memory": ref_memory,
        "ref_cpp": ref_cpp.summary(),
        "proposers": prop.summary(),
        "depth_sweep": sweep,
    }
    worst = max(res["cpp"][k]["mean_us"] for k in SPEC_KINDS)
    res["meets_targets"] = {
        "append": res["cpp"]["append"]["mean_us"] <= TARGET_APPEND_US,
        "speculate": worst <= TARGET_SPECULATE_US,
    }
    res["wall_s"] = time.perf_counter() - wall

    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_cost.json").write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    write_markdown(out / "drafter_cost.md", res)
    plot(out / "drafter_cost.png", res)

    print(f"\nC++ via GroupSuffixTrees (mean µs): append {res['cpp']['append']['mean_us']:.2f}", end="")
    for k in SPEC_KINDS:
        print(f", {k} {res['cpp'][k]['mean_us']:.2f}", end="")
    print(
        f"\ntargets: append {res['meets_targets']['append']}, speculate {res['meets_targets']['speculate']}"
    )
    print(f"wrote {out}/drafter_cost.{{json,md,png}} in {res['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
