"""Grouped speculative decoding in the modeled engines: the engine's own budget
policy sizes drafts, the acceptance model (fitted by trace replay) rewards them."""

from __future__ import annotations

from functools import lru_cache

from seer_engine.sim.acceptance import COVERAGE_WINDOW
from seer_engine.spec_decode.budget import StepCostModel, make_budget


class SimSpeculation:
    """Grouped speculative decoding as the engine's budget policy sizes it and the
    acceptance model (fitted by trace replay) rewards it."""

    def __init__(self, acceptance, budget: str, max_nodes: int, pinned: StepCostModel | None = None) -> None:
        """``pinned``: the budget's step cost when the speculative config pins one
        (``step_cost``), as the engine then uses; else the modeled step's own."""
        self.acceptance = acceptance
        self.budget = budget
        self.max_nodes = max_nodes
        self.pinned = pinned
        self.coverage_window = COVERAGE_WINDOW

    @property
    def coverage_bins(self) -> int:
        return len(self.acceptance.coverage_edges) - 1

    @property
    def uses_coverage(self) -> bool:
        """Whether the acceptance model reads how far siblings have written past a row."""
        return self.coverage_bins > 1

    def coverage_bin(self, coverage: float) -> int:
        return self.acceptance.coverage_bin(coverage)

    def rates(
        self, rows: int, stage: float, coverage: tuple[float, ...], step: StepCostModel
    ) -> tuple[float, float]:
        """(draft nodes, accepted tokens) per row and step for ``rows`` decoding rows at the
        rows' mean stage, ``coverage[b]`` of them in coverage bin ``b`` (``sim/acceptance.py``).
        The budget sizes drafts from the rows' mean acceptance, as for alike rows."""
        step = self.pinned or step
        bins = [(share, self.acceptance.coverage_edges[b]) for b, share in enumerate(coverage) if share]
        rate = round(sum(w * self.acceptance.per_token_rate(stage, c) for w, c in bins), 3)
        # The fixed cost moves with the batch's KV; two significant digits of its ratio
        # to the per-token cost decide the budget just as well and keep the cache small.
        ratio = float(f"{step.fixed_s / max(step.per_token_s, 1e-15):.2g}")
        nodes = _allocate(self.budget, rows, rate, ratio, self.max_nodes)
        accepted = sum(
            w * self.acceptance.accepted_per_step(n, stage, c) * k for n, k in nodes for w, c in bins
        )
        drafted = sum(
            w * self.acceptance.drafted_per_step(n, stage, c) * k for n, k in nodes for w, c in bins
        )
        accepted, drafted = accepted / rows, drafted / rows
        return drafted, min(accepted, drafted)


@lru_cache(maxsize=65536)
def _allocate(
    budget: str, rows: int, rate: float, ratio: float, max_nodes: int
) -> tuple[tuple[int, int], ...]:
    """The engine's budget policy over ``rows`` alike rows: (nodes, how many rows) pairs."""
    policy = make_budget(budget, StepCostModel(ratio, 1.0))
    counts: dict[int, int] = {}
    for n in policy.allocate([None] * rows, lambda _: rate, max_nodes):
        counts[n] = counts.get(n, 0) + 1
    return tuple(counts.items())
