"""Grouped speculative decoding in the modeled engines: the engine's own budget
policy sizes drafts, the acceptance model (fitted by trace replay) rewards them."""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import NamedTuple

import numpy as np

from seer_engine.sim.acceptance import COVERAGE_WINDOW
from seer_engine.spec_decode.budget import StepCostModel, make_budget
from seer_engine.spec_decode.drafter import estimate, learn

PARTICLES = 256  # modeled responses per chunk trajectory, whatever the batch
EXACT_ROWS = 32  # larger batches share trajectories with those of the same two leading digits
SHARE_STEPS = 16  # coverage shares to the nearest 1/16 name a trajectory
SETTLED_ROUNDS = 64  # past this many steps into a chunk (0.8^64: no prior left) its drafting settles
LOOKAHEAD_ROUNDS = 16  # steady rates are checked again after at most this many steps
TAIL_ROUNDS = 32  # a settled chunk drafts as it did on average over its last rounds
STEADY_NODES = 0.05  # draft rates within this (or 10%) of each other count as unchanged


class DraftRates(NamedTuple):
    """Per row and step: draft nodes verified, draft tokens accepted, and how many more
    tokens of its chunk a row writes before these rates change (inf: they no longer do)."""

    drafted: float
    accepted: float
    steady_tokens: float = math.inf


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
        a = acceptance
        model = (a.budgets, a.stage_edges, a.coverage_edges, a.accepted, a.drafted)
        # Trajectories repeat; every run in the process with these drafters shares them.
        self._chunks = _TRAJECTORIES.setdefault((model, budget, max_nodes), {})

    @property
    def coverage_bins(self) -> int:
        return len(self.acceptance.coverage_edges) - 1

    @property
    def uses_coverage(self) -> bool:
        """Whether the acceptance model reads how far siblings have written past a row."""
        return self.coverage_bins > 1

    def lead_bin(self, share: float) -> int:
        """The coverage bin of a row whose siblings' mean lead share is ``share``."""
        return self.acceptance.lead_bin(share)

    def rates(
        self,
        rows: int,
        stage: float,
        coverage: tuple[float, ...],
        step: StepCostModel,
        chunk_tokens: float = 0.0,
    ) -> DraftRates:
        """Draft nodes and accepted tokens per row and step for ``rows`` decoding rows at the
        rows' mean stage, ``coverage[b]`` of them in coverage bin ``b`` (``sim/acceptance.py``),
        that have written ``chunk_tokens`` of their current chunk on average.

        Each response sizes its drafts from what its own verdicts taught it since its
        chunk began (``ChunkDrafting``), so a batch drafts as its rows' estimates spread:
        rows whose first drafts fail stop drafting, rows whose drafts land go deeper."""
        step = self.pinned or step
        # The fixed cost moves with the batch's KV; two significant digits of its ratio
        # to the per-token cost decide the budget just as well and keep the cache small.
        ratio = float(f"{step.fixed_s / max(step.per_token_s, 1e-15):.2g}")
        shape = rows if rows <= EXACT_ROWS else int(float(f"{rows:.2g}"))
        total = sum(coverage)
        counts = tuple(_split(shape, tuple(round(SHARE_STEPS * c / total) for c in coverage)))
        key = (counts, ratio, self.acceptance.stage_bin(stage))
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = ChunkDrafting(self, counts, ratio, stage)
        return chunk.at(chunk_tokens)


class ChunkDrafting:
    """A batch's drafting through one chunk, step by step: ``PARTICLES`` modeled responses,
    spread over the coverage classes as the batch's rows are, each with the decayed
    counts the engine's drafter keeps (``drafter.learn``), start at the prior. Every step
    the engine's budget policy sizes their drafts from their estimates, over copies of
    the batch (its fixed cost scaled alike, so the same nodes pay), and each draft
    accepts a random share drawn from the acceptance model (a fixed seed: runs repeat).

    The outcome of a draft of k nodes: it exists with the model's budget-1 drafted rate,
    and accepts at least j nodes with the model's increment from budget j - 1 to j."""

    def __init__(self, spec: SimSpeculation, counts: tuple[int, ...], ratio: float, stage: float) -> None:
        model, cap, edges = spec.acceptance, spec.max_nodes, spec.acceptance.coverage_edges
        rows = sum(counts)
        modeled = _split(rows * (PARTICLES // rows) if rows <= PARTICLES else PARTICLES, counts)
        # Each row stands for sum(modeled) / rows modeled responses; the fixed cost is
        # scaled alike, so the nodes that pay are those that would in the batch itself.
        self._policy = make_budget(spec.budget, StepCostModel(ratio * sum(modeled) / rows, 1.0))
        self._cap = cap
        self._classes = np.repeat(np.arange(len(counts)), modeled)
        self._accepted_counts = np.zeros(len(self._classes))  # each response's decayed counts
        self._tried_counts = np.zeros(len(self._classes))
        budgets = range(cap + 1)
        accepted = np.array(
            [[model.accepted_per_step(k, stage, edges[b]) for k in budgets] for b in range(len(counts))]
        )
        self._drafted = np.array(
            [[model.drafted_per_step(k, stage, edges[b]) for k in budgets] for b in range(len(counts))]
        )
        self._accepted = np.minimum(accepted, self._drafted)
        self._exists = np.minimum(1.0, self._drafted[:, 1])
        # P(at least j nodes accepted) for j >= 1: the increments, never rising, never above ``exists``.
        steps = np.maximum(0.0, np.diff(accepted, axis=1))
        self._survival = np.minimum.accumulate(np.minimum(steps, self._exists[:, None]), axis=1)
        self._depths = np.arange(1, cap + 1)
        self._rng = np.random.default_rng(0)
        self._progress: list[float] = []  # chunk tokens written before each round
        self._rounds: list[tuple[float, float]] = []  # (drafted, accepted) per row, each round
        self._frozen = False  # a round in which nobody drafted: nobody learns, all rounds alike

    def at(self, chunk_tokens: float) -> DraftRates:
        """The rates in the step after ``chunk_tokens``, and for how many tokens they hold."""
        i = self._round_at(chunk_tokens)
        if i is None:
            tail = self._rounds[-TAIL_ROUNDS:]
            return DraftRates(sum(d for d, _ in tail) / len(tail), sum(a for _, a in tail) / len(tail))
        drafted, accepted = self._rounds[i]
        j = i + 1
        while j <= i + LOOKAHEAD_ROUNDS:
            if j == len(self._rounds):
                if j == SETTLED_ROUNDS or self._frozen:
                    return DraftRates(drafted, accepted)
                self._round()
            d, a = self._rounds[j]
            if abs(d - drafted) > max(STEADY_NODES, 0.1 * drafted) or abs(a - accepted) > max(
                STEADY_NODES, 0.1 * accepted
            ):
                break
            j += 1
        return DraftRates(drafted, accepted, self._progress[min(j, i + LOOKAHEAD_ROUNDS)] - chunk_tokens)

    def _round_at(self, chunk_tokens: float) -> int | None:
        """The round a row is in after writing ``chunk_tokens`` (None: past the settled ones)."""
        while (
            len(self._rounds) < SETTLED_ROUNDS
            and not self._frozen
            and (not self._progress or self._progress[-1] <= chunk_tokens)
        ):
            self._round()
        i = max(bisect_right(self._progress, chunk_tokens) - 1, 0)
        if self._frozen and i == len(self._rounds) - 1:
            return i
        return None if i == SETTLED_ROUNDS - 1 and self._progress[-1] <= chunk_tokens else i

    def _round(self) -> None:
        budgets = np.asarray(
            self._policy.allocate_rates(estimate(self._accepted_counts, self._tried_counts), self._cap)
        )
        drafted = float(self._drafted[self._classes, budgets].mean())
        accepted = float(self._accepted[self._classes, budgets].mean())
        self._progress.append(self._progress[-1] + 1.0 + self._rounds[-1][1] if self._rounds else 0.0)
        self._rounds.append((drafted, accepted))
        self._frozen = not budgets.any()
        u = self._rng.random(len(budgets))
        verified = (budgets > 0) & (u < self._exists[self._classes])  # else nothing to draft from
        held = u[:, None] < self._survival[self._classes]
        nodes = (held & (self._depths[None, :] <= budgets[:, None])).sum(axis=1)
        accepted_counts, tried_counts = learn(self._accepted_counts, self._tried_counts, nodes, budgets)
        self._accepted_counts = np.where(verified, accepted_counts, self._accepted_counts)
        self._tried_counts = np.where(verified, tried_counts, self._tried_counts)


_TRAJECTORIES: dict[tuple, dict[tuple, ChunkDrafting]] = {}


def _split(rows: int, shares: tuple[float, ...]) -> list[int]:
    """``rows`` in whole rows by ``shares`` (largest remainders), summing to ``rows``."""
    exact = [rows * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda b: counts[b] - exact[b])
    for b in by_remainder[: rows - sum(counts)]:
        counts[b] += 1
    return counts
