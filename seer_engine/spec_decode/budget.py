"""How many draft nodes each request gets in a step: pluggable budget policies.

Seer's marginal-benefit rule (``AdaptiveBudget``): a step costs about
``fixed_s + per_token_s * tokens`` (profiled once at start-up), and the k-th draft node
of a request whose drafts are accepted with probability a per token adds a^k expected
tokens on a single path. A token tree spends its nodes on the likeliest branches at
every depth, so its later nodes are worth far more: its accepted tokens grow by about
the same amount each time its budget doubles (``TREE_DOUBLING``), and its k-th node
adds a * TREE_DOUBLING * log2(k / (k - 1)), or a^k where a path would gain more (a
tree holds at least its best path). Nodes go, one at a time, to the request where the
next node adds the most, while it raises the step's expected tokens per second: a node
worth g tokens pays iff g / per_token_s > tokens / time of the step so far. So a large batch (time
already spent on many rows) gets few or no drafts and the tail (few requests left)
gets deep ones.

A row may weigh more (``weights``: Seer's λ for its high-priority requests, the long
responses that decide when the rollout ends): its tokens count that many times in the
step's worth, so its nodes pay at lower acceptance and it drafts deeper.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from seer_engine.core.request import Request

# A token tree of k nodes accepts about a * (1 + TREE_DOUBLING * log2 k) tokens per step,
# a its first node's rate: fitted on the acceptance replay of the Qwen3 trace's groups
# of 8 with backed-off drafts (sim/profiles, budgets 1-16, every stage past the first
# fifth of a group: 0.58-0.66 a per doubling).
TREE_DOUBLING = 0.63


def node_worth(rates: np.ndarray, max_nodes: int, tree: bool) -> np.ndarray:
    """Expected tokens the k-th draft node adds (column k - 1) for requests accepted at
    ``rates`` per node: a^k on a single path, the tree curve's increments on a tree."""
    path = np.cumprod(np.repeat(rates[:, None], max_nodes, axis=1), axis=1)
    if not tree:
        return path
    k = np.arange(1, max_nodes + 1)
    curve = np.concatenate(([1.0], TREE_DOUBLING * np.log2(k[1:] / (k[1:] - 1))))
    return np.maximum(path, rates[:, None] * curve[None, :])


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
        self,
        requests: Sequence[Request],
        acceptance: Callable[[Request], float],
        max_nodes: int,
        weight: Callable[[Request], float] | None = None,
    ) -> list[int]:
        """Draft nodes per request (same order), each at most ``max_nodes``."""
        weights = None if weight is None else [weight(r) for r in requests]
        return self.allocate_rates([acceptance(r) for r in requests], max_nodes, weights)

    def allocate_rates(
        self, rates: Sequence[float], max_nodes: int, weights: Sequence[float] | None = None
    ) -> list[int]:
        """Draft nodes for requests whose drafts are accepted at ``rates`` per node and
        whose tokens are worth ``weights`` (default 1 each). The simulator's modeled
        drafters call this with their own estimates."""
        raise NotImplementedError


class FixedBudget(BudgetPolicy):
    """Every request drafts ``max_nodes`` (vLLM's num_speculative_tokens)."""

    name = "fixed"

    def allocate_rates(self, rates, max_nodes, weights=None):
        return [max_nodes] * len(rates)


class AdaptiveBudget(BudgetPolicy):
    """Marginal benefit against the profiled step cost (see the module docstring)."""

    name = "adaptive"

    def __init__(self, cost: StepCostModel | Callable[[], StepCostModel], tree: bool = False) -> None:
        """``tree``: drafts are token trees (``node_worth``)."""
        self._cost = cost  # a model, or how to measure one the first time it is needed
        self.tree = tree

    @property
    def cost(self) -> StepCostModel:
        if not isinstance(self._cost, StepCostModel):
            self._cost = self._cost()
        return self._cost

    def allocate_rates(self, rates, max_nodes, weights=None):
        """Nodes in order of worth (a request's k-th node is worth w times ``node_worth``;
        on equal worth the earlier request first), taken while each pays for its row: at
        the first node that does not, the step's worth per second would fall, and every
        later one is worth less."""
        n = len(rates)
        if not n or max_nodes <= 0:
            return [0] * n
        cost = self.cost
        a = np.clip(np.asarray(rates, dtype=float), 0.0, 0.999)
        w = np.ones(n) if weights is None else np.asarray(weights, dtype=float)
        gains = (w[:, None] * node_worth(a, max_nodes, self.tree)).ravel()
        rows = np.repeat(np.arange(n), max_nodes)
        # Worth per second only rises while nodes are taken, so one worth no more than
        # the step without drafts gives never pays: leave those out of the sort.
        start = cost.per_token_s * w.sum() / (cost.fixed_s + cost.per_token_s * n)
        worth = np.flatnonzero(gains > start)
        order = worth[np.argsort(-gains[worth], kind="stable")]
        g = gains[order]
        taken = np.arange(g.size)  # nodes already in the step when each is considered
        tokens = w.sum() + np.concatenate(([0.0], np.cumsum(g)[:-1]))  # every row emits its bonus token
        seconds = cost.fixed_s + cost.per_token_s * (n + taken)
        pays = g * seconds > cost.per_token_s * tokens
        stop = g.size if pays.all() else int(np.argmin(pays))
        return np.bincount(rows[order[:stop]], minlength=n).tolist()


def make_budget(
    name: str, cost: StepCostModel | Callable[[], StepCostModel], tree: bool = False
) -> BudgetPolicy:
    if name == "fixed":
        return FixedBudget()
    if name == "adaptive":
        return AdaptiveBudget(cost, tree)
    raise ValueError(f"unknown draft budget policy {name!r}")
