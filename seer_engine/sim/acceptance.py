"""How many draft tokens grouped speculative decoding gets accepted, for the simulator.

The simulator does not draft; it needs "accepted draft tokens per request-step" as a
function of the draft budget and of the rollout stage (the fraction of a group's
responses already finished: late in a group, the stragglers draft from siblings that
have written their whole answer, so acceptance rises). The table is fitted by
replaying real trace groups through the engine's own C++ group suffix tree with
exact-match acceptance (:func:`replay_group`), so it carries the drafter's real
behaviour (match caps, ``min_prob``, multi-path trees) rather than a guess.

The table holds for the group size it was fitted with: more siblings, more to draft
from. On the Qwen3 trace (90 groups, budget 16, multi-path) the mean is 1.15 accepted
tokens per request-step with 8 responses per group, 1.32 with 16 and 1.57 with 46
(whole groups; 1.89 while the last 10% run, 1.28 single-path), which matches an
earlier exact-match lock-step simulation of the whole trace (1.56, 1.86, 1.29).

    python -m seer_engine.sim.acceptance --trace qwen3-8b-mcq-cot.jsonl.gz --groups all \
        --samples 8 --output seer_engine/sim/profiles/acceptance_qwen3.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Protocol

from seer_engine.core.draft import DraftTree
from seer_engine.sim.profile import SavedAsJson
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY, GroupSuffixTrees

__all__ = [
    "DEFAULT_ACCEPTANCE_PATH",
    "AcceptanceModel",
    "accepted_len",
    "default_acceptance",
    "history_acceptance",
    "fit_acceptance",
    "main",
    "replay_group",
]

DEFAULT_ACCEPTANCE_PATH = Path(__file__).parent / "profiles" / "acceptance_qwen3.json"
DEFAULT_BUDGETS = (1, 2, 4, 8, 16)
DEFAULT_STAGE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
# The drafter's defaults: the fit must see the tree the engine uses.
DEFAULT_MAX_DEPTH = SpeculativeConfig.max_depth
DEFAULT_MIN_PROB = SpeculativeConfig.min_prob
HISTORY_KEY_BASE = 1 << 20  # tree keys of history responses (siblings use their index)


class ReplayGroup(Protocol):
    """The part of ``workloads.groups.WorkloadGroup`` a replay reads."""

    @property
    def group_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def response_token_ids(self) -> list[list[int]]: ...


def _stage_bin(edges: Sequence[float], stage: float) -> int:
    """Index of the bin holding ``stage`` (clamped to [0, 1]; the last bin includes 1.0)."""
    stage = min(1.0, max(0.0, stage))
    return min(len(edges) - 2, max(0, bisect_right(edges, stage) - 1))


@dataclass(frozen=True)
class AcceptanceModel(SavedAsJson):
    """Mean accepted draft tokens per request-step, per stage bin (rows) and budget (columns)."""

    budgets: tuple[int, ...]
    stage_edges: tuple[float, ...]
    accepted: tuple[tuple[float, ...], ...]  # [stage bin][budget index]
    # Mean draft nodes per request-step, same shape: the tree often has less to offer
    # than the budget allows, and only drafted nodes are verified (and paid for).
    # Empty: every budget is drafted in full.
    drafted: tuple[tuple[float, ...], ...] = ()
    derivation: str = ""  # how the table was fitted (command, groups, samples, multi_path)
    measured: dict = field(default_factory=dict)  # trace, steps per bin, fit seconds, date

    def __post_init__(self) -> None:
        try:
            budgets = tuple(self.budgets)
            edges = tuple(float(e) for e in self.stage_edges)
            table = tuple(tuple(float(v) for v in row) for row in self.accepted)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"acceptance model: budgets, stage_edges and accepted must be number lists: {e}"
            ) from None
        if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
            raise ValueError(f"acceptance model: budgets must be positive integers, got {list(budgets)}")
        if any(a >= b for a, b in zip(budgets, budgets[1:])):
            raise ValueError(f"acceptance model: budgets must increase, got {list(budgets)}")
        if (
            len(edges) < 2
            or edges[0] != 0.0
            or edges[-1] != 1.0
            or any(a >= b for a, b in zip(edges, edges[1:]))
        ):
            raise ValueError(
                f"acceptance model: stage_edges must increase from 0.0 to 1.0 (>= 2 edges), got {list(edges)}"
            )
        if len(table) != len(edges) - 1 or any(len(row) != len(budgets) for row in table):
            raise ValueError(
                f"acceptance model: accepted must be {len(edges) - 1} stage rows of {len(budgets)} budgets, "
                f"got {[len(row) for row in table]}"
            )
        if any(not math.isfinite(v) or v < 0 for row in table for v in row):
            raise ValueError("acceptance model: accepted values must be finite and >= 0")
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "stage_edges", edges)
        object.__setattr__(self, "accepted", table)
        drafted = tuple(tuple(float(v) for v in row) for row in self.drafted)
        if drafted and [len(r) for r in drafted] != [len(r) for r in table]:
            raise ValueError("acceptance model: drafted must have the shape of accepted")
        object.__setattr__(self, "drafted", drafted)

    def stage_bin(self, stage: float) -> int:
        return _stage_bin(self.stage_edges, stage)

    def accepted_per_step(self, budget: float, stage: float) -> float:
        """Piecewise linear in budget through (0, 0) and the table points, flat past the last."""
        return self._interpolate(self.accepted, budget, stage)

    def drafted_per_step(self, budget: float, stage: float) -> float:
        """Draft nodes a request verifies per step with this budget (at most the budget)."""
        if not self.drafted:
            return max(0.0, budget)
        return min(max(0.0, budget), self._interpolate(self.drafted, budget, stage))

    def _interpolate(self, table, budget: float, stage: float) -> float:
        if budget <= 0:
            return 0.0
        row = table[self.stage_bin(stage)]
        budgets = self.budgets
        if budget >= budgets[-1]:
            return row[-1]
        i = bisect_left(budgets, budget)
        x0, y0 = (0, 0.0) if i == 0 else (budgets[i - 1], row[i - 1])
        return y0 + (row[i] - y0) * (budget - x0) / (budgets[i] - x0)

    def per_token_rate(self, stage: float) -> float:
        """Acceptance probability of a single draft token (what budget 1 accepts per step)."""
        return min(0.999, max(0.0, self.accepted_per_step(1, stage)))

    @classmethod
    def from_dict(cls, data: dict) -> AcceptanceModel:
        if not isinstance(data, dict):
            raise ValueError(f"acceptance model: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"acceptance model: unknown keys {unknown}")
        missing = [k for k in ("budgets", "stage_edges", "accepted") if k not in data]
        if missing:
            raise ValueError(f"acceptance model: missing keys {missing}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AcceptanceModel:
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"acceptance model {str(p)!r} not found (fit one with `python -m seer_engine.sim.acceptance`)"
            )
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"acceptance model {str(p)!r} is not valid: {e}") from None


def default_acceptance(samples: int = 8) -> AcceptanceModel:
    """The committed fit on the Qwen3 trace for groups of ``samples`` responses (8 or
    16: more siblings draft more), loaded once per process."""
    return _load_default(16 if samples >= 16 else 8)


def history_acceptance(samples: int = 8) -> AcceptanceModel:
    """The fit on the Qwen3 trace with every group's tree seeded by as many other
    responses of its prompt (an earlier iteration's, drafted from by a history store)."""
    return _load_default(16 if samples >= 16 else 8, "_history")


@cache
def _load_default(samples: int, variant: str = "") -> AcceptanceModel:
    path = (
        DEFAULT_ACCEPTANCE_PATH
        if samples == 8
        else DEFAULT_ACCEPTANCE_PATH.with_name(f"acceptance_qwen3_{samples}.json")
    )
    return AcceptanceModel.load(path.with_name(path.stem + variant + path.suffix))


# ------------------------------------------------------------------------ replay


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
) -> list[tuple[float, int, int]]:
    """Speculative decoding of one group in lock-step engine steps; ``(stage, accepted,
    drafted nodes)`` per live sibling and step.

    Each step every live sibling drafts from the tree as it stands at the step's start
    (as ``SuffixProposer.propose`` does: a context tail while its output is short, its
    stored sequence after), accepts the longest draft path matching its real
    continuation, and advances by that plus the bonus token; then the new tokens go
    into the tree. ``stage`` is the fraction of the group's siblings finished at the
    step's start. ``history``: responses of the same prompt from an earlier iteration,
    in the tree from the start (a history-seeded drafter).
    """
    trees = GroupSuffixTrees(max_depth=max_depth, min_prob=min_prob)
    gid = group.group_id
    prompt = list(group.prompt_token_ids)
    responses = group.response_token_ids
    trees.append(gid, PROMPT_KEY, prompt)
    for j, earlier in enumerate(history):
        trees.append(gid, HISTORY_KEY_BASE + j, list(earlier))
    cap = max_depth // 2
    prompt_tail = prompt[-cap:] if cap else []
    size = len(responses)
    pos = [0] * size
    live = [k for k, r in enumerate(responses) if r]
    records: list[tuple[float, int, int]] = []
    while live:
        stage = (size - len(live)) / size
        drafts = []
        for k in live:
            p = pos[k]
            if p >= cap:  # its own output is context enough: no walk from the root
                drafts.append(trees.speculate_sequence(gid, k, budget, multi_path))
            else:
                tail = (prompt_tail + responses[k][:p])[-cap:]
                drafts.append(trees.speculate(gid, tail, budget, multi_path))
        for k, draft in zip(live, drafts):
            r, p = responses[k], pos[k]
            accepted = accepted_len(draft, r[p : p + len(draft)])
            new = min(len(r), p + accepted + 1)
            trees.append(gid, k, r[p:new])
            pos[k] = new
            records.append((stage, accepted, len(draft)))
        live = [k for k in live if pos[k] < len(responses[k])]
    trees.free(gid)
    return records


def fit_acceptance(
    groups: Sequence[ReplayGroup],
    budgets: Sequence[int] = DEFAULT_BUDGETS,
    stage_edges: Sequence[float] = DEFAULT_STAGE_EDGES,
    multi_path: bool = True,
    max_depth: int = DEFAULT_MAX_DEPTH,
    min_prob: float = DEFAULT_MIN_PROB,
    progress: bool = True,
    history: Sequence[Sequence[Sequence[int]]] | None = None,
) -> AcceptanceModel:
    """Replay every group at every budget (a fresh tree each) and average accepted tokens
    per request-step by stage bin. Bins no step fell into copy the nearest bin with data
    (``measured["filled_bins"]`` says which). ``history``: per group, earlier responses
    that seed its tree (see ``replay_group``)."""
    if not groups:
        raise ValueError("fit_acceptance: no groups to replay")
    budgets, edges = tuple(budgets), tuple(float(e) for e in stage_edges)
    AcceptanceModel(budgets, edges, tuple((0.0,) * len(budgets) for _ in edges[1:]))  # validate early
    bins = len(edges) - 1
    sums = [[0] * len(budgets) for _ in range(bins)]
    nodes = [[0] * len(budgets) for _ in range(bins)]
    steps = [[0] * len(budgets) for _ in range(bins)]
    start = time.perf_counter()
    every = max(1, len(groups) // 10)
    for gi, group in enumerate(groups, 1):
        for bi, budget in enumerate(budgets):
            seeded = history[gi - 1] if history is not None else ()
            for stage, accepted, drafted in replay_group(
                group, budget, multi_path, max_depth, min_prob, seeded
            ):
                row = _stage_bin(edges, stage)
                sums[row][bi] += accepted
                nodes[row][bi] += drafted
                steps[row][bi] += 1
        if progress and (gi % every == 0 or gi == len(groups)):
            overall = sum(s[-1] for s in sums) / max(1, sum(n[-1] for n in steps))
            print(
                f"[acceptance] {gi}/{len(groups)} groups, {time.perf_counter() - start:.1f}s, "
                f"budget {budgets[-1]}: {overall:.3f} accepted/step",
                flush=True,
            )
    if not any(steps[b][0] for b in range(bins)):
        raise ValueError("fit_acceptance: the groups produced no steps (empty responses?)")
    table = [[0.0] * len(budgets) for _ in range(bins)]
    drafted_table = [[0.0] * len(budgets) for _ in range(bins)]
    filled: dict[str, str] = {}
    for i in range(len(budgets)):
        have = [b for b in range(bins) if steps[b][i]]
        for b in range(bins):
            src = min(have, key=lambda h: (abs(h - b), h))
            table[b][i] = sums[src][i] / steps[src][i]
            drafted_table[b][i] = nodes[src][i] / steps[src][i]
            if src != b:
                filled.setdefault(str(b), f"no steps; copied from bin {src}")
    totals = [sum(steps[b][i] for b in range(bins)) for i in range(len(budgets))]
    measured: dict[str, Any] = {
        "groups": len(groups),
        "samples_per_group": sorted({len(g.response_token_ids) for g in groups}),
        "history_per_group": sorted({len(h) for h in history}) if history is not None else [0],
        "multi_path": multi_path,
        "max_depth": max_depth,
        "min_prob": min_prob,
        "steps": steps,
        "overall_accepted_per_step": [
            sum(sums[b][i] for b in range(bins)) / totals[i] for i in range(len(budgets))
        ],
        "filled_bins": filled,
        "fit_seconds": round(time.perf_counter() - start, 1),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    return AcceptanceModel(
        budgets, edges, tuple(map(tuple, table)), tuple(map(tuple, drafted_table)), measured=measured
    )


# --------------------------------------------------------------------------- CLI


def _numbers(text: str, kind: type) -> tuple:
    return tuple(kind(v) for v in text.split(",") if v.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Fit on a trace and write the model (``python -m seer_engine.sim.acceptance``)."""
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
    parser.add_argument("--single-path", action="store_true", help="drafts are single paths, not trees")
    parser.add_argument("--max-depth", type=int, default=DEFAULT_MAX_DEPTH)
    parser.add_argument("--min-prob", type=float, default=DEFAULT_MIN_PROB)
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
    model = fit_acceptance(
        groups,
        _numbers(args.budgets, int),
        _numbers(args.stage_edges, float),
        multi_path=not args.single_path,
        max_depth=args.max_depth,
        min_prob=args.min_prob,
        history=history,
    )
    command = " ".join(["python -m seer_engine.sim.acceptance", *argv])
    derivation = (
        f"`{command}`: exact-match lock-step replay of {len(groups)} groups (--groups {args.groups}) x "
        f"{args.samples} responses of {Path(args.trace).name} through the engine's C++ GroupSuffixTrees "
        f"(max_depth {args.max_depth}, min_prob {args.min_prob}, multi_path {not args.single_path}); "
        "per group and budget a fresh tree holding the prompt"
        + (
            f" and {args.history_samples} other responses of the trace group (a drafter seeded from an "
            "earlier iteration; same policy, so an upper bound of what history gives)"
            if args.history_samples
            else ""
        )
        + "; every step each live response drafts "
        "(context tail, or its stored sequence once it has max_depth // 2 tokens), accepts the longest "
        "draft path matching its real continuation and advances by that + 1 bonus token. Stage = fraction "
        "of the group's responses finished at the step's start; values are mean accepted draft tokens "
        "(accepted) and draft nodes (drafted) per request-step."
    )
    model = AcceptanceModel(
        model.budgets,
        model.stage_edges,
        model.accepted,
        model.drafted,
        derivation,
        {"trace": Path(args.trace).name, "command": command, **model.measured},
    )
    out = model.save(args.output)
    print(f"wrote {out} in {model.measured['fit_seconds']}s")
    for lo, hi, row in zip(model.stage_edges, model.stage_edges[1:], model.accepted):
        print(
            f"  stage [{lo:.1f}, {hi:.1f}): " + "  ".join(f"b{b}={v:.3f}" for b, v in zip(model.budgets, row))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
