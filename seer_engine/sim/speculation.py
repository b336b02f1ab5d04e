"""Grouped speculative decoding in the modeled engines: the engine's own budget
policy sizes drafts, the acceptance model (fitted by trace replay) rewards them."""

from __future__ import annotations

from functools import lru_cache

from seer_engine.sim.acceptance import COVERAGE_WINDOW
from seer_engine.spec_decode.budget import StepCostModel, make_budget
from seer_engine.spec_decode.drafter import learnt_acceptance


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
        self,
        rows: int,
        stage: float,
        coverage: tuple[float, ...],
        step: StepCostModel,
        chunk_tokens: float = 0.0,
    ) -> tuple[float, float]:
        """(draft nodes, accepted tokens) per row and step for ``rows`` decoding rows at the
        rows' mean stage, ``coverage[b]`` of them in coverage bin ``b`` (``sim/acceptance.py``),
        that have written ``chunk_tokens`` of their current chunk on average.

        The budget sizes each row's draft from the acceptance the engine's drafter would
        have learnt for it by then (``learnt_acceptance``: an even prior, decayed counts,
        restarted with each chunk's request), so rows that siblings cover get deeper
        drafts. What a row learns depends on what the drafts it was given accepted: a few
        rounds find the fixed point."""
        step = self.pinned or step
        edges = self.acceptance.coverage_edges
        bins = [(edges[b], n) for b, n in enumerate(_split(rows, coverage)) if n]
        # The fixed cost moves with the batch's KV; two significant digits of its ratio
        # to the per-token cost decide the budget just as well and keep the cache small.
        ratio = float(f"{step.fixed_s / max(step.per_token_s, 1e-15):.2g}")
        learnt = [learnt_acceptance(0.0, 0.0, 0.0)] * len(bins)  # before any verdict: the prior
        for _ in range(FIXED_POINT_ROUNDS):
            rated = tuple((round(rate, 3), n) for rate, (_, n) in zip(learnt, bins))
            per_bin = []
            for (c, n), nodes in zip(bins, _allocate(self.budget, rated, ratio, self.max_nodes)):
                drafted = sum(self.acceptance.drafted_per_step(k, stage, c) * m for k, m in nodes) / n
                accepted = min(
                    drafted, sum(self.acceptance.accepted_per_step(k, stage, c) * m for k, m in nodes) / n
                )
                per_bin.append((accepted, drafted))
            moved = [
                learnt_acceptance(a, min(a + 1.0, d), chunk_tokens / (1.0 + a) if d else 0.0)
                for a, d in per_bin
            ]
            settled = max(abs(x - y) for x, y in zip(moved, learnt)) < 0.005
            learnt = moved
            if settled:
                break
        accepted = sum(a * n for (a, _), (_, n) in zip(per_bin, bins)) / rows
        drafted = sum(d * n for (_, d), (_, n) in zip(per_bin, bins)) / rows
        return drafted, accepted


FIXED_POINT_ROUNDS = 6


def _split(rows: int, shares: tuple[float, ...]) -> list[int]:
    """``rows`` in whole rows by ``shares`` (largest remainders), summing to ``rows``."""
    exact = [rows * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda b: counts[b] - exact[b])
    for b in by_remainder[: rows - sum(counts)]:
        counts[b] += 1
    return counts


@lru_cache(maxsize=65536)
def _allocate(
    budget: str, rated: tuple[tuple[float, int], ...], ratio: float, max_nodes: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The engine's budget policy over rows that learnt ``rate`` in each (rate, how many
    rows) class: per class, (nodes, how many rows) pairs."""
    policy = make_budget(budget, StepCostModel(ratio, 1.0))
    rates = [rate for rate, n in rated for _ in range(n)]
    budgets = policy.allocate(range(len(rates)), rates.__getitem__, max_nodes)
    out, start = [], 0
    for _, n in rated:
        counts: dict[int, int] = {}
        for k in budgets[start : start + n]:
            counts[k] = counts.get(k, 0) + 1
        out.append(tuple(counts.items()))
        start += n
    return tuple(out)
