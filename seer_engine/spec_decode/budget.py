"""How many draft nodes each request gets in a step: pluggable budget policies.

Seer's marginal-benefit rule (``AdaptiveBudget``): a step costs about
``fixed_s + per_token_s * tokens`` (profiled once at start-up), and a draft node at
depth k of a request whose drafts are accepted with probability a per token adds a^k
expected tokens. Nodes go, one at a time, to the request where the next node adds the
most, while it raises the step's expected tokens per second: a node worth g tokens
pays iff g / per_token_s > tokens / time of the step so far. So a large batch (time
already spent on many rows) gets few or no drafts and the tail (few requests left)
gets deep ones.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from seer_engine.core.request import Request


@dataclass(frozen=True)
class StepCostModel:
    """Step time as a line in the number of scheduled tokens."""

    fixed_s: float
    per_token_s: float

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> StepCostModel:
        """Theil-Sen line over (tokens, seconds): the median of pairwise slopes, then
        the median intercept. One step slowed by a busy machine moves a least-squares
        line a lot (to a zero intercept, and then nothing ever pays for a draft); it
        barely moves medians. Both coefficients are kept non-negative."""
        if not points:
            raise ValueError("a step cost model needs at least one (tokens, seconds) point")
        slopes = [
            (s2 - s1) / (t2 - t1)
            for i, (t1, s1) in enumerate(points)
            for t2, s2 in points[i + 1 :]
            if t2 != t1
        ]
        slope = max(statistics.median(slopes), 0.0) if slopes else 0.0
        intercept = statistics.median(s - slope * t for t, s in points)
        return cls(fixed_s=max(intercept, 1e-9), per_token_s=slope)


class BudgetPolicy:
    name = "abstract"

    def allocate(
        self, requests: Sequence[Request], acceptance: Callable[[Request], float], max_nodes: int
    ) -> list[int]:
        """Draft nodes per request (same order), each at most ``max_nodes``."""
        raise NotImplementedError


class FixedBudget(BudgetPolicy):
    """Every request drafts ``max_nodes`` (vLLM's num_speculative_tokens)."""

    name = "fixed"

    def allocate(self, requests, acceptance, max_nodes):
        return [max_nodes] * len(requests)


class AdaptiveBudget(BudgetPolicy):
    """Marginal benefit against the profiled step cost (see the module docstring)."""

    name = "adaptive"

    def __init__(self, cost: StepCostModel | Callable[[], StepCostModel]) -> None:
        self._cost = cost  # a model, or how to measure one the first time it is needed

    @property
    def cost(self) -> StepCostModel:
        if not isinstance(self._cost, StepCostModel):
            self._cost = self._cost()
        return self._cost

    def allocate(self, requests, acceptance, max_nodes):
        budgets = [0] * len(requests)
        if not requests:
            return budgets
        cost = self.cost
        tokens = float(len(requests))  # every request emits at least its bonus token
        seconds = cost.fixed_s + cost.per_token_s * len(requests)
        rates = [min(max(acceptance(r), 0.0), 0.999) for r in requests]
        heap = [(-a, i) for i, a in enumerate(rates) if a > 0.0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if gain * seconds <= cost.per_token_s * tokens:
                break  # the best node left no longer pays for its row
            budgets[i] += 1
            tokens += gain
            seconds += cost.per_token_s
            if budgets[i] < max_nodes:
                heapq.heappush(heap, (-gain * rates[i], i))
        return budgets


def make_budget(name: str, cost: StepCostModel | Callable[[], StepCostModel]) -> BudgetPolicy:
    if name == "fixed":
        return FixedBudget()
    if name == "adaptive":
        return AdaptiveBudget(cost)
    raise ValueError(f"unknown draft budget policy {name!r}")
