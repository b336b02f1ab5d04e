"""The modeled drafters size drafts from what the engine's drafter would have learnt:
the estimate itself against the Drafter's, and the budget that follows from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from seer_engine.core.draft import Acceptance
from seer_engine.sim.acceptance import AcceptanceModel
from seer_engine.sim.speculation import SimSpeculation
from seer_engine.spec_decode.budget import FixedBudget, StepCostModel
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.drafter import PRIOR_ACCEPTED, PRIOR_TRIED, Drafter, learnt_acceptance

STEP = StepCostModel(fixed_s=0.03, per_token_s=0.0005)  # a GPU-like step: drafts pay in small batches


@pytest.mark.parametrize("accepted, depth", [(0, 8), (2, 8), (8, 8), (3, 4)])
def test_learnt_acceptance_is_what_the_drafter_learns_from_alike_verdicts(accepted, depth):
    drafter = Drafter(SpeculativeConfig(), proposer=None, budget=FixedBudget())
    request = SimpleNamespace(sequence_id="g/0")
    tried = min(accepted + 1, depth)
    prior = PRIOR_ACCEPTED / PRIOR_TRIED
    assert drafter.acceptance(request) == learnt_acceptance(accepted, tried, 0) == prior
    for k in range(1, 12):
        verdict = Acceptance(list(range(accepted)), [0] * (accepted + 1), [0] * (accepted + 1), depth)
        drafter._learn(request, verdict)
        assert drafter.acceptance(request) == pytest.approx(learnt_acceptance(accepted, tried, k))


def _model(low: float, high: float) -> AcceptanceModel:
    """One stage; rows no sibling covers accept ``low`` per node, covered rows ``high``
    (geometrically along the draft)."""

    def row(p: float) -> tuple[float, ...]:
        return tuple(sum(p**d for d in range(1, b + 1)) for b in (1, 2, 4, 8, 16))

    budgets = (1, 2, 4, 8, 16)
    return AcceptanceModel(budgets, (0.0, 1.0), ((row(low), row(high)),), coverage_edges=(0.0, 0.5, 1.0))


def test_rows_start_each_chunk_at_the_prior_and_learn_their_own_rate():
    spec = SimSpeculation(_model(0.05, 0.9), "adaptive", 16)
    uncovered, covered, mixed = (1.0, 0.0), (0.0, 1.0), (0.5, 0.5)
    at_prior = spec.rates(8, 0.5, mixed, STEP, 0.0)[0]
    for coverage in (uncovered, covered):  # a fresh chunk: every row drafts at the prior
        assert spec.rates(8, 0.5, coverage, STEP, 0.0)[0] == pytest.approx(at_prior)
    # Rows that learnt their drafts fail draft less, rows that learnt they land draft more.
    fresh = spec.rates(8, 0.5, uncovered, STEP, 0.0)[0]
    assert spec.rates(8, 0.5, uncovered, STEP, 200.0)[0] < fresh < spec.rates(8, 0.5, covered, STEP, 200.0)[0]
    # In a mixed batch the covered half gets the deeper drafts, so it accepts more per
    # node than a batch where every row drafted alike.
    drafted, accepted = spec.rates(8, 0.5, mixed, STEP, 200.0)
    alike_drafted, alike_accepted = spec.rates(8, 0.5, mixed, STEP, 0.0)
    assert accepted / drafted > alike_accepted / alike_drafted


def test_a_fixed_budget_drafts_in_full_whatever_was_learnt():
    spec = SimSpeculation(_model(0.05, 0.9), "fixed", 8)
    for chunk_tokens in (0.0, 500.0):
        assert spec.rates(4, 0.5, (0.5, 0.5), STEP, chunk_tokens)[0] == 8
