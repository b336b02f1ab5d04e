"""Fitting the simulator's acceptance model: real trace groups replayed through the
engine's own C++ group suffix tree with exact-match acceptance, in lock-step and with
staggered starts (``sim/acceptance.py`` says what the table means).

    python -m seer_engine.sim.acceptance_replay --trace qwen3-8b-mcq-cot.jsonl.gz --groups all \
        --samples 8 --output seer_engine/sim/profiles/acceptance_qwen3.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from seer_engine.core.draft import DraftTree
from seer_engine.sim.acceptance import (
    COVERAGE_STATISTICS,
    COVERAGE_WINDOW,
    DEFAULT_ACCEPTANCE_PATH,
    DEFAULT_STAGE_EDGES,
    AcceptanceModel,
    bin_index,
    lead_share,
)
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY, GroupSuffixTrees

DEFAULT_BUDGETS = (1, 2, 4, 8, 16)
DEFAULT_COVERAGE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DEFAULT_SPREADS = (0.0, 0.5, 2.0)  # lock-step, and starts staggered over half / twice a mean response
# One sibling starts this many mean response lengths ahead of the others, which start
# together: Seer's probe, dispatched a chunk before the rest of its group.
DEFAULT_PROBE_LEADS = (0.5,)
DEFAULT_COVERAGE_STATISTIC = "root_mean"
DEFAULT_MAX_DEPTH = SpeculativeConfig.max_depth
DEFAULT_MIN_PROB = SpeculativeConfig.min_prob
DEFAULT_BACKOFF = SpeculativeConfig.backoff
HISTORY_KEY_BASE = 1 << 20  # tree keys of history responses (siblings use their index)


class ReplayGroup(Protocol):
    """The part of ``workloads.groups.WorkloadGroup`` a replay reads."""

    @property
    def group_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def response_token_ids(self) -> list[list[int]]: ...


class ReplayStep(NamedTuple):
    """One live sibling's step in a replay."""

    stage: float  # share of the group's responses finished at the step's start
    coverage: float  # its siblings' mean lead share (``acceptance.lead_share``)
    accepted: int  # draft tokens accepted
    drafted: int  # draft nodes verified
    response: int  # which sibling


def accepted_len(draft: DraftTree, truth: Sequence[int]) -> int:
    """Draft tokens verification accepts when the target emits ``truth``: the longest
    root path of the draft tree that matches it (exact-match acceptance)."""
    if not draft:
        return 0
    children = draft.children
    row = accepted = 0
    for tok in truth:
        child = children[row].get(tok)
        if child is None:
            break
        row, accepted = child + 1, accepted + 1
    return accepted


def replay_group(
    group: ReplayGroup,
    budget: int,
    multi_path: bool = True,
    max_depth: int = DEFAULT_MAX_DEPTH,
    min_prob: float = DEFAULT_MIN_PROB,
    history: Sequence[Sequence[int]] = (),
    starts: Sequence[int] | None = None,
    *,
    backoff: float = DEFAULT_BACKOFF,
) -> list[ReplayStep]:
    """Speculative decoding of one group in engine steps: one ``ReplayStep`` per live
    sibling and step.

    Each step every live sibling drafts from the tree as it stands at the step's start
    (as ``SuffixProposer.propose`` does: a context tail while its output is short, its
    stored sequence after), accepts the longest draft path matching its real
    continuation, and advances by that plus the bonus token; then the new tokens go
    into the tree. ``stage`` is the fraction of the group's siblings finished at the
    step's start, ``coverage`` the mean over the other siblings of how far each has
    written past this one (``COVERAGE_WINDOW`` tokens or more counts 1; the model's
    coverage axis reads it through its statistic). ``starts``:
    the step at which each sibling starts (default: all at once, lock-step).
    ``history``: responses of the same prompt from an earlier iteration, in the tree
    from the start (a history-seeded drafter).
    """
    trees = GroupSuffixTrees(max_depth=max_depth, min_prob=min_prob, backoff=backoff)
    gid = group.group_id
    prompt = list(group.prompt_token_ids)
    responses = group.response_token_ids
    trees.append(gid, PROMPT_KEY, prompt)
    for j, earlier in enumerate(history):
        trees.append(gid, HISTORY_KEY_BASE + j, list(earlier))
    cap = max_depth // 2
    prompt_tail = prompt[-cap:] if cap else []
    size = len(responses)
    starts = list(starts) if starts is not None else [0] * size
    if len(starts) != size:
        raise ValueError(f"replay_group: {len(starts)} starts for {size} responses")
    pos = [0] * size
    waiting = [k for k, r in enumerate(responses) if r]
    live: list[int] = []
    records: list[ReplayStep] = []
    step = 0
    while live or waiting:
        live += [k for k in waiting if starts[k] <= step]
        waiting = [k for k in waiting if starts[k] > step]
        stage = sum(1 for k, r in enumerate(responses) if pos[k] >= len(r)) / size
        drafts = []
        for k in live:
            p = pos[k]
            if p >= cap:  # its own output is context enough: no walk from the root
                drafts.append(trees.speculate_sequence(gid, k, budget, multi_path))
            else:
                tail = (prompt_tail + responses[k][:p])[-cap:]
                drafts.append(trees.speculate(gid, tail, budget, multi_path))
        coverage = [lead_share(pos[k], (q for j, q in enumerate(pos) if j != k)) for k in live]
        for k, draft, cover in zip(live, drafts, coverage):
            r, p = responses[k], pos[k]
            accepted = accepted_len(draft, r[p : p + len(draft)])
            new = min(len(r), p + accepted + 1)
            trees.append(gid, k, r[p:new])
            pos[k] = new
            records.append(ReplayStep(stage, cover, accepted, len(draft), k))
        live = [k for k in live if pos[k] < len(responses[k])]
        step += 1
    trees.free(gid)
    return records


def probe_starts(group: ReplayGroup, lead: float) -> list[int]:
    """The first response starts at step 0, the others together ``lead`` times the
    group's mean response length later."""
    responses = group.response_token_ids
    if not responses:
        return []
    later = int(lead * sum(map(len, responses)) / len(responses))
    return [0] + [later] * (len(responses) - 1)


def staggered_starts(group: ReplayGroup, spread: float, rng: random.Random) -> list[int]:
    """Start steps drawn uniformly over ``spread`` times the group's mean response length
    (0: lock-step)."""
    responses = group.response_token_ids
    if spread <= 0 or not responses:
        return [0] * len(responses)
    horizon = spread * sum(map(len, responses)) / len(responses)
    return [int(rng.random() * horizon) for _ in responses]


def fit_acceptance(
    groups: Sequence[ReplayGroup],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    stage_edges: Sequence[float] = DEFAULT_STAGE_EDGES,
    multi_path: bool = True,
    max_depth: int = DEFAULT_MAX_DEPTH,
    min_prob: float = DEFAULT_MIN_PROB,
    progress: bool = True,
    history: Sequence[Sequence[Sequence[int]]] | None = None,
    coverage_edges: Sequence[float] = (0.0, 1.0),
    spreads: Sequence[float] = (0.0,),
    seed: int = 0,
    probe_leads: Sequence[float] = (),
    coverage_statistic: str = DEFAULT_COVERAGE_STATISTIC,
    backoff: float = DEFAULT_BACKOFF,
) -> AcceptanceModel:
    """Replay every group at every budget and start pattern (a fresh tree each) and average
    accepted tokens per request-step by stage and coverage bin. The patterns: each of
    ``spreads`` (``staggered_starts``; the same starts at every budget, drawn from
    ``seed``), then each of ``probe_leads`` (``probe_starts``). Cells no step fell into
    copy the nearest cell with data (``measured["filled_bins"]`` says which).
    ``history``: per group, earlier responses that seed its tree (see ``replay_group``)."""
    if not groups:
        raise ValueError("fit_acceptance: no groups to replay")
    if not spreads or any(not math.isfinite(x) or x < 0 for x in spreads):
        raise ValueError(f"fit_acceptance: spreads must be >= 0, got {list(spreads)}")
    if any(not math.isfinite(x) or x <= 0 for x in probe_leads):
        raise ValueError(f"fit_acceptance: probe leads must be > 0, got {list(probe_leads)}")
    budgets, edges = tuple(budgets), tuple(float(e) for e in stage_edges)
    cover = tuple(float(e) for e in coverage_edges)
    nb, ns, nc = len(budgets), len(edges) - 1, len(cover) - 1
    empty = (
        tuple((0.0,) * nb for _ in range(ns))
        if nc == 1
        else tuple(tuple((0.0,) * nb for _ in range(nc)) for _ in range(ns))
    )
    # Validated early; bins the replayed steps' coverage as the fitted model will read it.
    axis = AcceptanceModel(budgets, edges, empty, coverage_edges=cover, coverage_statistic=coverage_statistic)
    cells = [(s, c) for s in range(ns) for c in range(nc)]
    sums = {cell: [0] * nb for cell in cells}
    nodes = {cell: [0] * nb for cell in cells}
    steps = {cell: [0] * nb for cell in cells}
    start = time.perf_counter()
    every = max(1, len(groups) // 10)
    for gi, group in enumerate(groups, 1):
        seeded = history[gi - 1] if history is not None else ()
        patterns = [staggered_starts(group, x, random.Random(f"{seed}:{gi}:{x}")) for x in spreads]
        for starts in patterns + [probe_starts(group, lead) for lead in probe_leads]:
            for bi, budget in enumerate(budgets):
                for stage, coverage, accepted, drafted, _ in replay_group(
                    group, budget, multi_path, max_depth, min_prob, seeded, starts, backoff=backoff
                ):
                    cell = (bin_index(edges, stage), axis.lead_bin(coverage))
                    sums[cell][bi] += accepted
                    nodes[cell][bi] += drafted
                    steps[cell][bi] += 1
        if progress and (gi % every == 0 or gi == len(groups)):
            overall = sum(v[-1] for v in sums.values()) / max(1, sum(v[-1] for v in steps.values()))
            print(
                f"[acceptance] {gi}/{len(groups)} groups, {time.perf_counter() - start:.1f}s, "
                f"budget {budgets[-1]}: {overall:.3f} accepted/step",
                flush=True,
            )
    if not any(steps[cell][0] for cell in cells):
        raise ValueError("fit_acceptance: the groups produced no steps (empty responses?)")
    table = {cell: [0.0] * nb for cell in cells}
    drafted_table = {cell: [0.0] * nb for cell in cells}
    filled: dict[str, str] = {}
    for i in range(nb):
        have = [cell for cell in cells if steps[cell][i]]
        for cell in cells:
            src = min(have, key=lambda h: (abs(h[0] - cell[0]) + abs(h[1] - cell[1]), h))
            table[cell][i] = sums[src][i] / steps[src][i]
            drafted_table[cell][i] = nodes[src][i] / steps[src][i]
            if src != cell:
                filled.setdefault(_cell_key(cell, nc), f"no steps; copied from bin {_cell_key(src, nc)}")
    totals = [sum(steps[cell][i] for cell in cells) for i in range(nb)]
    measured: dict[str, Any] = {
        "groups": len(groups),
        "samples_per_group": sorted({len(g.response_token_ids) for g in groups}),
        "history_per_group": sorted({len(h) for h in history}) if history is not None else [0],
        "multi_path": multi_path,
        "max_depth": max_depth,
        "min_prob": min_prob,
        "backoff": backoff,
        "spreads": list(spreads),
        "probe_leads": list(probe_leads),
        "coverage_window": COVERAGE_WINDOW,
        "steps": _shaped({cell: v for cell, v in steps.items()}, ns, nc),
        "overall_accepted_per_step": [sum(sums[cell][i] for cell in cells) / totals[i] for i in range(nb)],
        "filled_bins": filled,
        "fit_seconds": round(time.perf_counter() - start, 1),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    return AcceptanceModel(
        budgets,
        edges,
        _shaped(table, ns, nc),
        _shaped(drafted_table, ns, nc),
        measured=measured,
        coverage_edges=cover,
        coverage_statistic=coverage_statistic,
    )


def _cell_key(cell: tuple[int, int], coverages: int) -> str:
    """``"stage bin"``, or ``"stage bin/coverage bin"`` where the table has coverage bins."""
    return str(cell[0]) if coverages == 1 else f"{cell[0]}/{cell[1]}"


def _shaped(values: dict[tuple[int, int], list], stages: int, coverages: int) -> list:
    """Per-cell lists as the model's nesting: [stage][budget] or [stage][coverage][budget]."""
    if coverages == 1:
        return [values[(s, 0)] for s in range(stages)]
    return [[values[(s, c)] for c in range(coverages)] for s in range(stages)]


# --------------------------------------------------------------------------- CLI


def _numbers(text: str, kind: type) -> tuple:
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of {kind.__name__} numbers") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Fit on a trace and write the model (``python -m seer_engine.sim.acceptance_replay``)."""
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.traces import load_trace

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", default="qwen3-8b-mcq-cot.jsonl.gz", help="trace path or name in traces_dir()"
    )
    parser.add_argument("--groups", default="all", help="'30' (first 30), '0:90', or 'all'")
    parser.add_argument("--samples", type=int, default=8, help="responses (siblings) per group")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--stage-edges", default=",".join(map(str, DEFAULT_STAGE_EDGES)))
    parser.add_argument(
        "--coverage-edges", default=",".join(map(str, DEFAULT_COVERAGE_EDGES)),
        help="bins of how far the siblings have written past a response ('0,1': one bin, coverage ignored)",
    )  # fmt: skip
    parser.add_argument(
        "--spreads", default=",".join(map(str, DEFAULT_SPREADS)),
        help="replay each group once per spread: siblings start at random steps over this many mean "
        "response lengths (0: lock-step)",
    )  # fmt: skip
    parser.add_argument(
        "--probe-leads", default=",".join(map(str, DEFAULT_PROBE_LEADS)),
        help="replay each group once more per lead: one response starts this many mean response lengths "
        "ahead of the others, which start together ('': none)",
    )  # fmt: skip
    parser.add_argument(
        "--coverage-statistic", default=DEFAULT_COVERAGE_STATISTIC, choices=sorted(COVERAGE_STATISTICS),
        help="what the coverage axis reads of the siblings' mean lead share",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the staggered starts' seed")
    parser.add_argument("--single-path", action="store_true", help="drafts are single paths, not trees")
    parser.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH)
    parser.add_argument("--min-prob", type=float, default=DEFAULT_MIN_PROB)
    parser.add_argument(
        "--backoff", type=float, default=DEFAULT_BACKOFF,
        help="the drafter's backoff pseudo-counts (0: the longest match alone)",
    )  # fmt: skip
    parser.add_argument(
        "--history-samples", type=int, default=0,
        help="seed each group's tree with this many other responses of its trace group (those after "
        "--samples), as a drafter seeded from an earlier iteration would be",
    )  # fmt: skip
    parser.add_argument("--output", default=str(DEFAULT_ACCEPTANCE_PATH))
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)

    full = select_groups(load_trace(args.trace), args.groups, args.samples + args.history_samples)
    groups = [g.head(args.samples) for g in full]
    history = None
    if args.history_samples:
        history = [g.response_token_ids[args.samples :] for g in full]
    try:  # number lists that do not parse, or that the fit refuses, are the caller's error
        model = fit_acceptance(
            groups,
            _numbers(args.budgets, int),
            _numbers(args.stage_edges, float),
            multi_path=not args.single_path,
            max_depth=args.max_depth,
            min_prob=args.min_prob,
            history=history,
            coverage_edges=_numbers(args.coverage_edges, float),
            spreads=_numbers(args.spreads, float),
            seed=args.seed,
            probe_leads=_numbers(args.probe_leads, float),
            coverage_statistic=args.coverage_statistic,
            backoff=args.backoff,
        )
    except ValueError as e:
        parser.error(str(e))
    command = " ".join(["python -m seer_engine.sim.acceptance_replay", *argv])
    derivation = (
        f"`{command}`: exact-match replay of {len(groups)} groups (--groups {args.groups}) x "
        f"{args.samples} responses of {Path(args.trace).name} through the engine's C++ GroupSuffixTrees "
        f"(max_depth {args.max_depth}, min_prob {args.min_prob}, backoff {args.backoff}, "
        f"multi_path {not args.single_path}); "
        "per group and budget a fresh tree holding the prompt"
        + (
            f" and {args.history_samples} other responses of the trace group (a drafter seeded from an "
            "earlier iteration; same policy, so an upper bound of what history gives)"
            if args.history_samples
            else ""
        )
        + f"; replayed once per start spread {list(model.measured['spreads'])} (siblings start at random "
        "steps over that many mean response lengths; 0 is lock-step) and once per probe lead "
        f"{list(model.measured['probe_leads'])} (one response starts that many mean response lengths ahead "
        "of the others, which start together); every step each live response drafts "
        "(context tail, or its stored sequence once it has max_depth // 2 tokens), accepts the longest "
        "draft path matching its real continuation and advances by that + 1 bonus token. Stage = fraction "
        "of the group's responses finished at the step's start; coverage = "
        f"{model.coverage_statistic} over its siblings of how far each has written past it "
        f"({COVERAGE_WINDOW} tokens or more counts 1); values are mean accepted "
        "draft tokens (accepted) and draft nodes (drafted) per request-step."
    )
    model = AcceptanceModel(
        model.budgets,
        model.stage_edges,
        model.accepted,
        model.drafted,
        derivation,
        {"trace": Path(args.trace).name, "command": command, **model.measured},
        model.coverage_edges,
        model.coverage_statistic,
    )
    out = model.save(args.output)
    print(f"wrote {out} in {model.measured['fit_seconds']}s")
    for lo, hi, cell in zip(model.stage_edges, model.stage_edges[1:], model.accepted):
        rows = [cell] if len(model.coverage_edges) == 2 else list(cell)
        for c, row in zip(model.coverage_edges, rows):
            where = f"stage [{lo:.1f}, {hi:.1f})" + (f" coverage >= {c:.1f}" if len(rows) > 1 else "")
            print(f"  {where}: " + "  ".join(f"b{b}={v:.3f}" for b, v in zip(model.budgets, row)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
