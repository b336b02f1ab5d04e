"""``seer_engine trace-stats``: print a trace's (or a synthetic workload's) README figures."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from seer_engine.workloads.groups import scale_lengths, select_groups
from seer_engine.workloads.paths import resolve_trace_path
from seer_engine.workloads.stats import README_FIGURES, ngram_overlap, trace_stats
from seer_engine.workloads.synthetic import synthetic_workload
from seer_engine.workloads.traces import load_trace

FIGURE_LABELS: dict[str, str] = {
    "groups": "groups",
    "responses": "responses",
    "mean_len": "tokens/response, mean",
    "median_len": "tokens/response, median",
    "p90_len": "tokens/response, p90",
    "max_len": "tokens/response, max",
    "within_cv": "CV of length within a group (mean over groups)",
    "across_cv": "CV across group means",
    "within_share": "share of length variance within groups",
    "longest_over_mean": "longest / group mean (mean over groups)",
    "spearman_first_longest": "Spearman(first response, longest)",
    "ngram_within": "word n-grams also in a sibling",
    "ngram_cross": "word n-grams also in another group",
}


def _format_value(key: str, value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if key in ("groups", "responses"):
        return f"{int(value):,}"
    if key.endswith("_len"):
        return f"{value:,.0f}"
    if key.startswith("ngram"):
        return f"{100 * value:.1f}%"
    return f"{value:.3f}"


def format_table(figures: dict[str, float], reference: dict[str, float] | None = README_FIGURES) -> str:
    """Figures as a plain-text table, beside the Qwen3 trace README's values where it has one."""
    rows = [(FIGURE_LABELS.get(k, k), _format_value(k, v), k) for k, v in figures.items()]
    width = max(len(r[0]) for r in rows)
    head = f"{'figure':<{width}}  {'value':>9}"
    lines = [head + ("   README (qwen3)" if reference else ""), "-" * (len(head) + (17 if reference else 0))]
    for label, value, key in rows:
        line = f"{label:<{width}}  {value:>9}"
        if reference and key in reference:
            ref = reference[key]
            shown = f"{100 * ref:.0f}%" if key.startswith("ngram") else f"{ref:.2f}"
            line += f"   {shown:>15}"
        lines.append(line)
    return "\n".join(lines)


def _cmd_trace_stats(args: argparse.Namespace) -> int:
    """Bad input is a ValueError, which the ``seer_engine`` command turns into exit 2."""
    start = time.perf_counter()
    groups: list[Any]
    if args.synthetic:
        if args.file is not None:
            raise ValueError("give either a trace FILE or --synthetic, not both")
        if args.max_len is None:
            raise ValueError("--synthetic needs --max-len (e.g. 65536, 40960 or 98304)")
        try:
            num_groups = int(args.groups) if args.groups else 90
        except ValueError:
            raise ValueError(f"--groups for --synthetic is a count, got {args.groups!r}") from None
        samples = 50 if args.samples is None else args.samples
        checks = (("--groups", num_groups, 1), ("--samples", samples, 1), ("--seed", args.seed, 0))
        for flag, value, least in checks:
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        groups = synthetic_workload(num_groups, samples, args.max_len, args.seed, vocab_size=args.vocab_size)
        title = (
            f"synthetic workload: {num_groups} groups x {samples}, max_len {args.max_len}, seed {args.seed}"
        )
        stats_input: Sequence[Any] = groups
    else:
        if args.file is None:
            raise ValueError("give a trace FILE (path or name in the traces folder) or --synthetic")
        try:
            path = resolve_trace_path(args.file)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        groups = select_groups(load_trace(path), args.groups, args.samples)
        title = f"{path.name}: groups {args.groups or 'all'}, samples {args.samples or 'all'}"
        stats_input = groups
        if args.max_len is not None:
            stats_input = scale_lengths([g.lengths for g in groups], args.max_len)
            title += f", lengths scaled p99 -> {args.max_len}"
    want_ngrams = args.ngrams if args.ngrams is not None else not args.synthetic
    figures = trace_stats(stats_input)
    if want_ngrams:
        overlap = ngram_overlap(groups, n=args.n)
        figures["ngram_within"] = overlap["within"]
        figures["ngram_cross"] = overlap["cross"]
    print(title)
    print(format_table(figures))
    print(f"({time.perf_counter() - start:.1f}s)", file=sys.stderr)
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``trace-stats`` on the ``seer_engine`` command's subparsers."""
    p = subparsers.add_parser(
        "trace-stats",
        help="length and n-gram figures of a rollout trace or a synthetic workload",
        description="Print the figures of ../shared/traces/README.md for a trace file "
        "(path, or name in the traces folder) or for a synthetic workload.",
    )
    p.add_argument("file", nargs="?", default=None, help="trace file (.jsonl.gz): path or name")
    p.add_argument("--groups", default=None, help="'30' (first 30) or '60:90'; with --synthetic a count (90)")
    p.add_argument(
        "--samples", type=int, default=None, help="first N responses of each group (synthetic: 50)"
    )
    p.add_argument("--synthetic", action="store_true", help="a synthetic workload instead of a trace")
    p.add_argument("--max-len", type=int, default=None, help="scale lengths so their p99 is this")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    p.add_argument("--vocab-size", type=int, default=32000, help="synthetic token ids (n-grams only)")
    p.add_argument("--n", type=int, default=8, help="n-gram size (default 8)")
    ngram = p.add_mutually_exclusive_group()
    ngram.add_argument(
        "--ngrams",
        dest="ngrams",
        action="store_true",
        default=None,
        help="compute n-gram overlap (default for traces; for --synthetic it generates every token)",
    )
    ngram.add_argument("--no-ngrams", dest="ngrams", action="store_false", help="skip n-gram overlap")
    p.set_defaults(func=_cmd_trace_stats)
    return p
