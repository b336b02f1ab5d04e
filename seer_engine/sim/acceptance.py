"""How many draft tokens grouped speculative decoding gets accepted, for the simulator.

The simulator does not draft; it needs "accepted draft tokens per request-step" as a
function of the draft budget and of what the response's group has written. Two things
decide that, so the table has two axes besides the budget:

- the **stage**: the share of the group's responses already finished. Late in a group
  the stragglers draft from siblings that wrote their whole answer.
- the **coverage**: how far the other siblings have written past this response's
  position, each counting fully once it is a whole draft (``COVERAGE_WINDOW`` tokens)
  ahead. Siblings rarely run in lock-step in a rollout: chunks, the dispatch order and
  full instances stagger them, and a response that starts late drafts from siblings
  that already wrote the passage it is about to write. The table's axis is the square
  root of the siblings' mean lead share (``coverage_statistic`` "root_mean"): the first
  sibling ahead gives a draft most of what it can get, more add less. Seer's scheduler
  runs one probe per group a chunk ahead of its siblings; under the plain mean those
  seven rows read as one sibling in seven ahead, the same bin as lock-step rows with
  nothing to draft from, though they accept about three times as much.

The table is fitted by replaying real trace groups through the engine's own C++ group
suffix tree with exact-match acceptance (:func:`replay_group`), so it carries the
drafter's real behaviour (match caps, ``min_prob``, multi-path trees) rather than a
guess (``sim/acceptance_replay.py``). Each group is replayed in lock-step and with
staggered starts (``spreads``); the starts are drawn at random, so the coverage they
give is not a consequence of a response's own acceptance (in lock-step a response falls
behind because it accepts less).

The table holds for the group size it was fitted with: more siblings, more to draft
from. On the Qwen3 trace (90 groups, budget 16, multi-path) lock-step replay gives a
mean of 1.15 accepted tokens per request-step with 8 responses per group, 1.32 with 16
and 1.57 with 46 (whole groups; 1.89 while the last 10% run, 1.28 single-path), which
matches an earlier exact-match lock-step simulation of the whole trace (1.56, 1.86,
1.29).

    python -m seer_engine.sim.acceptance_replay --trace qwen3-8b-mcq-cot.jsonl.gz --groups all \
        --samples 8 --output seer_engine/sim/profiles/acceptance_qwen3.json
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from seer_engine.sim.profile import SavedAsJson

if TYPE_CHECKING:
    from seer_engine.rollout.history import HistoryStore

__all__ = [
    "DEFAULT_ACCEPTANCE_PATH",
    "AcceptanceModel",
    "default_acceptance",
    "history_acceptance",
]

DEFAULT_ACCEPTANCE_PATH = Path(__file__).parent / "profiles" / "acceptance_qwen3.json"
DEFAULT_STAGE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
COVERAGE_WINDOW = 16  # tokens a sibling must be ahead to cover a whole draft (the default budget)
# What the coverage axis reads, from the mean over siblings of min(lead, window) / window.
COVERAGE_STATISTICS = {"mean": lambda share: share, "root_mean": math.sqrt}


def lead_share(position: float, siblings: Iterable[float], window: int = COVERAGE_WINDOW) -> float:
    """The mean over ``siblings`` (their output lengths) of how far each has written past
    ``position``, a whole ``window`` or more counting 1 (0 without siblings)."""
    leads = [min(window, max(0.0, q - position)) for q in siblings]
    return sum(leads) / (window * len(leads)) if leads else 0.0


# The drafter's defaults: the fit must see the tree the engine uses.
def bin_index(edges: Sequence[float], value: float) -> int:
    """Index of the bin of ``edges`` holding ``value`` (clamped to [0, 1]; the last bin includes 1.0)."""
    value = min(1.0, max(0.0, value))
    return min(len(edges) - 2, max(0, bisect_right(edges, value) - 1))


def _table(data, name: str, stages: int, coverages: int, budgets: int) -> tuple:
    """``data`` as nested float tuples of the model's shape (2-D with one coverage bin)."""
    if coverages == 1:
        want = f"{stages} stage rows of {budgets} budgets"
    else:
        want = f"{stages} stage rows of {coverages} coverage rows of {budgets} budgets"
    try:
        if coverages == 1:
            table = tuple(tuple(float(v) for v in row) for row in data)
            shape_ok = len(table) == stages and all(len(row) == budgets for row in table)
        else:
            table = tuple(tuple(tuple(float(v) for v in row) for row in cell) for cell in data)
            shape_ok = len(table) == stages and all(
                len(cell) == coverages and all(len(row) == budgets for row in cell) for cell in table
            )
    except (TypeError, ValueError) as e:
        raise ValueError(f"acceptance model: {name} must be {want} (nested number lists): {e}") from None
    if not shape_ok:
        raise ValueError(f"acceptance model: {name} must be {want}")
    return table


def _values(table) -> list[float]:
    out: list[float] = []
    for item in table:
        if isinstance(item, tuple):
            out += _values(item)
        else:
            out.append(item)
    return out


@dataclass(frozen=True)
class AcceptanceModel(SavedAsJson):
    """Mean accepted draft tokens per request-step, by stage bin, coverage bin and budget.

    ``accepted[stage][budget]`` while there is one coverage bin (``coverage_edges`` =
    ``(0.0, 1.0)``, the table ignores coverage), else ``accepted[stage][coverage][budget]``."""

    budgets: tuple[int, ...]
    stage_edges: tuple[float, ...]
    accepted: tuple  # [stage bin][budget index], or [stage bin][coverage bin][budget index]
    # Mean draft nodes per request-step, same shape: the tree often has less to offer
    # than the budget allows, and only drafted nodes are verified (and paid for).
    # Empty: every budget is drafted in full.
    drafted: tuple = ()
    derivation: str = ""  # how the table was fitted (command, groups, samples, multi_path)
    measured: dict = field(default_factory=dict)  # trace, steps per bin, fit seconds, date
    coverage_edges: tuple[float, ...] = (0.0, 1.0)
    coverage_statistic: str = "mean"  # a key of COVERAGE_STATISTICS; files from before it say nothing

    def __post_init__(self) -> None:
        try:
            budgets = tuple(self.budgets)
            edges = tuple(float(e) for e in self.stage_edges)
            cover = tuple(float(e) for e in self.coverage_edges)
        except (TypeError, ValueError) as e:
            raise ValueError(f"acceptance model: budgets and edges must be number lists: {e}") from None
        if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
            raise ValueError(f"acceptance model: budgets must be positive integers, got {list(budgets)}")
        if any(a >= b for a, b in zip(budgets, budgets[1:])):
            raise ValueError(f"acceptance model: budgets must increase, got {list(budgets)}")
        for name, bins in (("stage_edges", edges), ("coverage_edges", cover)):
            if (
                len(bins) < 2
                or bins[0] != 0.0
                or bins[-1] != 1.0
                or any(a >= b for a, b in zip(bins, bins[1:]))
            ):
                raise ValueError(
                    f"acceptance model: {name} must increase from 0.0 to 1.0 (>= 2 edges), got {list(bins)}"
                )
        if self.coverage_statistic not in COVERAGE_STATISTICS:
            raise ValueError(
                f"acceptance model: coverage_statistic must be one of {list(COVERAGE_STATISTICS)}, "
                f"got {self.coverage_statistic!r}"
            )
        table = _table(self.accepted, "accepted", len(edges) - 1, len(cover) - 1, len(budgets))
        if any(not math.isfinite(v) or v < 0 for v in _values(table)):
            raise ValueError("acceptance model: accepted values must be finite and >= 0")
        drafted = (
            _table(self.drafted, "drafted", len(edges) - 1, len(cover) - 1, len(budgets))
            if self.drafted
            else ()
        )
        object.__setattr__(self, "budgets", budgets)
        object.__setattr__(self, "stage_edges", edges)
        object.__setattr__(self, "coverage_edges", cover)
        object.__setattr__(self, "accepted", table)
        object.__setattr__(self, "drafted", drafted)

    def stage_bin(self, stage: float) -> int:
        return bin_index(self.stage_edges, stage)

    def coverage(self, share: float) -> float:
        """The coverage axis's value for a row whose siblings' mean lead share is ``share``
        (``lead_share``)."""
        return COVERAGE_STATISTICS[self.coverage_statistic](min(1.0, max(0.0, share)))

    def coverage_bin(self, coverage: float) -> int:
        return bin_index(self.coverage_edges, coverage)

    def lead_bin(self, share: float) -> int:
        """The coverage bin of a row whose siblings' mean lead share is ``share``."""
        return self.coverage_bin(self.coverage(share))

    def accepted_per_step(self, budget: float, stage: float, coverage: float = 0.0) -> float:
        """Piecewise linear in budget through (0, 0) and the table points, flat past the last."""
        return self._interpolate(self._row(self.accepted, stage, coverage), budget)

    def drafted_per_step(self, budget: float, stage: float, coverage: float = 0.0) -> float:
        """Draft nodes a request verifies per step with this budget (at most the budget)."""
        if not self.drafted:
            return max(0.0, budget)
        return min(max(0.0, budget), self._interpolate(self._row(self.drafted, stage, coverage), budget))

    def _row(self, table, stage: float, coverage: float) -> tuple[float, ...]:
        row = table[self.stage_bin(stage)]
        return row if len(self.coverage_edges) == 2 else row[self.coverage_bin(coverage)]

    def _interpolate(self, row: tuple[float, ...], budget: float) -> float:
        if budget <= 0:
            return 0.0
        budgets = self.budgets
        if budget >= budgets[-1]:
            return row[-1]
        i = bisect_left(budgets, budget)
        x0, y0 = (0, 0.0) if i == 0 else (budgets[i - 1], row[i - 1])
        return y0 + (row[i] - y0) * (budget - x0) / (budgets[i] - x0)

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
                f"acceptance model {str(p)!r} not found "
                "(fit one with `python -m seer_engine.sim.acceptance_replay`)"
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


def acceptance_for(
    history: HistoryStore | None,
    samples: int,
    plain: AcceptanceModel | None = None,
    seeded: AcceptanceModel | None = None,
    prompts: Iterable | None = None,
) -> AcceptanceModel | None:
    """The acceptance model for one iteration of a policy: with a history store that
    holds earlier iterations of the iteration's ``prompts`` (``SimPrompt``s; None: take
    it that it does), ``seeded`` (default: the committed history fit), as the store then
    seeds their groups' suffix trees; else ``plain`` (None: the simulator's default). One
    model runs the whole iteration: the seeded one where the store knows at least half
    of the prompts (fresh prompts have nothing to seed their trees with)."""
    if history is None or not history.iteration or not len(history):
        return plain
    if prompts is not None:
        prompts = list(prompts)
        if 2 * sum(p in history for p in prompts) < len(prompts):
            return plain
    return seeded if seeded is not None else history_acceptance(samples)


@cache
def _load_default(samples: int, variant: str = "") -> AcceptanceModel:
    path = (
        DEFAULT_ACCEPTANCE_PATH
        if samples == 8
        else DEFAULT_ACCEPTANCE_PATH.with_name(f"acceptance_qwen3_{samples}.json")
    )
    return AcceptanceModel.load(path.with_name(path.stem + variant + path.suffix))
