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


class BandShape(NamedTuple):
    """One band of an instance's decoding rows (those whose drafts weigh alike): how many,
    their mean stage, and their shares in the acceptance model's coverage bins."""

    rows: int
    stage: float
    coverage: tuple[float, ...]


IDLE = DraftRates(0.0, 0.0)


class SimSpeculation:
    """Grouped speculative decoding as the engine's budget policy sizes it and the
    acceptance model (fitted by trace replay) rewards it."""

    def __init__(
        self,
        acceptance,
        budget: str,
        max_nodes: int,
        pinned: StepCostModel | None = None,
        priority_weight: float = 1.0,
    ) -> None:
        """``pinned``: the budget's step cost when the speculative config pins one
        (``step_cost``), as the engine then uses; else the modeled step's own.
        ``priority_weight``: what a high-priority row's tokens are worth (band 1)."""
        self.acceptance = acceptance
        self.budget = budget
        self.max_nodes = max_nodes
        self.pinned = pinned
        self.weights = (1.0, float(priority_weight))  # per band: normal, high priority
        self.coverage_window = COVERAGE_WINDOW
        a = acceptance
        model = (a.budgets, a.stage_edges, a.coverage_edges, a.accepted, a.drafted)
        # Trajectories repeat; every run in the process with these drafters shares them.
        self._chunks = _TRAJECTORIES.setdefault((model, budget, max_nodes, self.weights), {})

    def band(self, high_priority: bool) -> int:
        """The band a chunk decodes in: 1 if it is high-priority and that weighs more."""
        return int(high_priority and self.weights[1] > self.weights[0])

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

    def band_rates(
        self, bands: tuple[BandShape, ...], step: StepCostModel, chunk_tokens: float = 0.0
    ) -> tuple[DraftRates, ...]:
        """Draft nodes and accepted tokens per row and step in each band (``bands[b]``:
        normal priority, then high), for rows that have written ``chunk_tokens`` of their
        current chunk on average. Within a band, ``coverage[i]`` of the rows are in the
        acceptance model's coverage bin ``i`` (``sim/acceptance.py``). ``steady_tokens``
        is the same for every band: any band's change ends a stretch.

        Each response sizes its drafts from what its own verdicts taught it since its
        chunk began (``ChunkDrafting``), so a batch drafts as its rows' estimates spread:
        rows whose first drafts fail stop drafting, rows whose drafts land go deeper."""
        step = self.pinned or step
        # The fixed cost moves with the batch's KV; two significant digits of its ratio
        # to the per-token cost decide the budget just as well and keep the cache small.
        ratio = float(f"{step.fixed_s / max(step.per_token_s, 1e-15):.2g}")
        total = sum(b.rows for b in bands)
        shape = total if total <= EXACT_ROWS else int(float(f"{total:.2g}"))
        band_rows = _split(shape, tuple(b.rows for b in bands))
        counts, stages = [], []
        for band, n in zip(bands, band_rows):
            if n:
                share = sum(band.coverage)
                steps = tuple(round(SHARE_STEPS * c / share) for c in band.coverage)
                counts.append(tuple(_split(n, steps)))
                stages.append(self.acceptance.stage_bin(band.stage))
            else:
                counts.append(None)
                stages.append(None)
        key = (tuple(counts), ratio, tuple(stages))
        chunk = self._chunks.get(key)
        if chunk is None:
            live = [(c, band.stage, w) for c, band, w in zip(counts, bands, self.weights) if c is not None]
            chunk = self._chunks[key] = ChunkDrafting(self, tuple(live), ratio)
        live_rates = iter(chunk.at(chunk_tokens))
        return tuple(IDLE if c is None else next(live_rates) for c in counts)


class ChunkDrafting:
    """A batch's drafting through one chunk, step by step: ``PARTICLES`` modeled responses,
    spread over the bands and coverage classes as the batch's rows are, each with the
    decayed counts the engine's drafter keeps (``drafter.learn``), start at the prior.
    Every step the engine's budget policy sizes their drafts from their estimates (and
    their band's weight), over copies of the batch (its fixed cost scaled alike, so the
    same nodes pay), and each draft accepts a random share drawn from the acceptance
    model (a fixed seed: runs repeat).

    The outcome of a draft of k nodes: it exists with the model's budget-1 drafted rate,
    and accepts at least j nodes with the model's increment from budget j - 1 to j."""

    def __init__(
        self, spec: SimSpeculation, bands: tuple[tuple[tuple[int, ...], float, float], ...], ratio: float
    ) -> None:
        """``bands``: (rows per coverage bin, mean stage, weight) of each band with rows."""
        model, cap, edges = spec.acceptance, spec.max_nodes, spec.acceptance.coverage_edges
        counts = [n for band_counts, _, _ in bands for n in band_counts]  # classes: (band, bin)
        rows = sum(counts)
        modeled = _split(rows * (PARTICLES // rows) if rows <= PARTICLES else PARTICLES, tuple(counts))
        first = 0
        for band_counts, _, _ in bands:  # every band drafts: a few rows among many get a particle
            mine = slice(first, first + len(band_counts))
            if not sum(modeled[mine]):
                modeled[first + int(np.argmax(band_counts))] = 1
            first += len(band_counts)
        # Each row stands for sum(modeled) / rows modeled responses; the fixed cost is
        # scaled alike, so the nodes that pay are those that would in the batch itself.
        # The simulator models multi-path grouped drafts only: the budget values trees.
        cost = StepCostModel(ratio * sum(modeled) / rows, 1.0)
        self._policy = make_budget(spec.budget, cost, tree=True)
        self._cap = cap
        self._classes = np.repeat(np.arange(len(counts)), modeled)
        band_of_class = np.repeat(np.arange(len(bands)), [len(c) for c, _, _ in bands])
        self._band = band_of_class[self._classes]
        self._bands = len(bands)
        self._weights = np.array([w for _, _, w in bands])[self._band]
        self._accepted_counts = np.zeros(len(self._classes))  # each response's decayed counts
        self._tried_counts = np.zeros(len(self._classes))
        budgets = range(cap + 1)
        where = [(stage, edges[b]) for band_counts, stage, _ in bands for b in range(len(band_counts))]
        accepted = np.array([[model.accepted_per_step(k, *w) for k in budgets] for w in where])
        self._drafted = np.array([[model.drafted_per_step(k, *w) for k in budgets] for w in where])
        self._accepted = np.minimum(accepted, self._drafted)
        self._exists = np.minimum(1.0, self._drafted[:, 1])
        # P(at least j nodes accepted) for j >= 1: the increments, never rising, never above ``exists``.
        steps = np.maximum(0.0, np.diff(accepted, axis=1))
        self._survival = np.minimum.accumulate(np.minimum(steps, self._exists[:, None]), axis=1)
        self._depths = np.arange(1, cap + 1)
        self._rng = np.random.default_rng(0)
        self._progress: list[float] = []  # chunk tokens written before each round (the rows' mean)
        self._rounds: list[tuple[tuple[float, float], ...]] = []  # per band: (drafted, accepted) per row
        self._frozen = False  # a round in which nobody drafted: nobody learns, all rounds alike
        self._last_accepted = 0.0  # per response in the latest round, all bands together

    def at(self, chunk_tokens: float) -> tuple[DraftRates, ...]:
        """Each band's rates in the step after ``chunk_tokens``, and for how many tokens they hold."""
        i = self._round_at(chunk_tokens)
        if i is None:
            tail = self._rounds[-TAIL_ROUNDS:]
            return tuple(
                DraftRates(sum(r[b][0] for r in tail) / len(tail), sum(r[b][1] for r in tail) / len(tail))
                for b in range(self._bands)
            )
        now = self._rounds[i]
        j = i + 1
        while j <= i + LOOKAHEAD_ROUNDS:
            if j == len(self._rounds):
                if j == SETTLED_ROUNDS or self._frozen:
                    return tuple(DraftRates(d, a) for d, a in now)
                self._round()
            if any(_changed(later, first) for later, first in zip(self._rounds[j], now)):
                break
            j += 1
        steady = self._progress[min(j, i + LOOKAHEAD_ROUNDS)] - chunk_tokens
        return tuple(DraftRates(d, a, steady) for d, a in now)

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
        estimates = estimate(self._accepted_counts, self._tried_counts)
        budgets = np.asarray(self._policy.allocate_rates(estimates, self._cap, self._weights))
        drafted = self._drafted[self._classes, budgets]
        accepted = self._accepted[self._classes, budgets]
        per_band = tuple(
            (float(drafted[self._band == b].mean()), float(accepted[self._band == b].mean()))
            for b in range(self._bands)
        )
        self._progress.append(self._progress[-1] + 1.0 + self._last_accepted if self._rounds else 0.0)
        self._last_accepted = float(accepted.mean())
        self._rounds.append(per_band)
        self._frozen = not budgets.any()
        u = self._rng.random(len(budgets))
        verified = (budgets > 0) & (u < self._exists[self._classes])  # else nothing to draft from
        held = u[:, None] < self._survival[self._classes]
        nodes = (held & (self._depths[None, :] <= budgets[:, None])).sum(axis=1)
        accepted_counts, tried_counts = learn(self._accepted_counts, self._tried_counts, nodes, budgets)
        self._accepted_counts = np.where(verified, accepted_counts, self._accepted_counts)
        self._tried_counts = np.where(verified, tried_counts, self._tried_counts)


def _changed(later: tuple[float, float], first: tuple[float, float]) -> bool:
    """Whether a band's (drafted, accepted) moved past the steady tolerance."""
    return any(abs(x - y) > max(STEADY_NODES, 0.1 * y) for x, y in zip(later, first))


_TRAJECTORIES: dict[tuple, dict[tuple, ChunkDrafting]] = {}


def _split(rows: int, shares: tuple[float, ...]) -> list[int]:
    """``rows`` in whole rows by ``shares`` (largest remainders), summing to ``rows``."""
    exact = [rows * s / sum(shares) for s in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda b: counts[b] - exact[b])
    for b in by_remainder[: rows - sum(counts)]:
        counts[b] += 1
    return counts
