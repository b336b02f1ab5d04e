"""The drafter of one engine: after every step it feeds the proposer the new tokens,
learns how well each response's drafts are accepted, and gives the requests that
decode next a draft sized by the budget policy.

Acceptance is estimated per response from its verified drafts (accepted nodes out of
the depths tried, decayed so that it follows the response as it changes), starting
from an even prior. A request drafts a token tree when its budget is wide enough to
branch and its single paths are often cut short; a single path otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from seer_engine.core.draft import Acceptance
from seer_engine.core.request import Request
from seer_engine.spec_decode.budget import BudgetPolicy
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.proposers import Proposer

PRIOR_ACCEPTED, PRIOR_TRIED = 1.0, 2.0  # an even prior: 1 accepted out of 2 tried
DECAY = 0.8  # weight of the past at each verified draft


def estimate(accepted: float, tried: float) -> float:
    """A response's acceptance estimate from its decayed counts (the prior added)."""
    return (accepted + PRIOR_ACCEPTED) / (tried + PRIOR_TRIED)


def learn(accepted: float, tried: float, verdict_accepted: int, draft_depth: int) -> tuple[float, float]:
    """The decayed counts after one verified draft of ``draft_depth`` that accepted
    ``verdict_accepted`` nodes: the depths tried are those accepted and the first miss.
    The simulator's modeled drafters learn by the same rule (on arrays of responses)."""
    return accepted * DECAY + verdict_accepted, tried * DECAY + np.minimum(verdict_accepted + 1, draft_depth)


@dataclass
class _Estimate:
    """A request's decayed acceptance counts, kept with the request they are learnt from
    (so they are dropped once it has finished, however it finished)."""

    request: Request
    accepted: float = 0.0
    tried: float = 0.0


TREE_MIN_BUDGET = 4  # narrower budgets go into a single path
TREE_MAX_ACCEPTANCE = 0.8  # above this a single path is rarely cut short


@dataclass
class SpecDecodeStats:
    draft_tokens_proposed: int = 0
    tree_drafts: int = 0  # drafts that branch (multi-path)
    moved_kv_slots: int = 0  # accepted tree nodes whose KV moved into sequence order
    speculate_calls: int = 0
    observe_s: float = 0.0  # feeding new tokens to the proposer
    propose_s: float = 0.0  # budgets and drafts
    observed_tokens: int = 0


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, budget: BudgetPolicy) -> None:
        self.config = config
        self.proposer = proposer
        self.budget = budget
        self.stats = SpecDecodeStats()
        self._estimates: dict[str, _Estimate] = {}  # by sequence id

    def acceptance(self, request: Request) -> float:
        e = self._estimates.get(request.sequence_id)
        return estimate(e.accepted, e.tried) if e is not None else estimate(0.0, 0.0)

    def weight(self, request: Request) -> float:
        """What the request's tokens are worth in the draft budget."""
        return self.config.priority_weight if request.high_priority else 1.0

    def after_step(
        self, updated: Sequence[Request], verdicts: dict[str, Acceptance], running: Sequence[Request]
    ) -> None:
        """Learn from this step's verdicts, then draft for the next step."""
        start = time.perf_counter()
        self._forget_finished()
        for req in updated:
            self.proposer.observe(req)
            verdict = verdicts.get(req.request_id)
            if verdict is None:
                continue
            self.stats.observed_tokens += len(verdict.tokens)
            if verdict.draft_depth:
                self._learn(req, verdict)
            if req.is_finished:
                self._estimates.pop(req.sequence_id, None)
        middle = time.perf_counter()
        self.propose(running)
        self.stats.observe_s += middle - start
        self.stats.propose_s += time.perf_counter() - middle

    def _forget_finished(self) -> None:
        """Drop the estimates of requests that finished outside a step (aborted, or a
        rollout chunk cut short): they never reach ``after_step`` as finished, and a
        reused request id would inherit their acceptance."""
        gone = [sid for sid, e in self._estimates.items() if e.request.is_finished]
        for sid in gone:
            del self._estimates[sid]

    def _learn(self, request: Request, verdict: Acceptance) -> None:
        e = self._estimates.get(request.sequence_id)
        if e is None:
            e = self._estimates[request.sequence_id] = _Estimate(request)
        e.request = request
        e.accepted, e.tried = learn(e.accepted, e.tried, len(verdict.nodes), verdict.draft_depth)

    def propose(self, running: Sequence[Request]) -> None:
        """Set ``request.draft`` on every request that decodes next step and gets a
        budget; the others get none, even one that a step's token budget left out still
        holding the draft it was given then (this step's budget decides, not that one)."""
        ready = [
            r
            for r in running
            if not r.is_finished
            and r.num_computed_tokens == r.num_tokens - 1
            and r.num_output_tokens + 1 < r.max_tokens
        ]
        cap = self.config.num_speculative_tokens
        for req, budget in zip(ready, self.budget.allocate(ready, self.acceptance, cap, self.weight)):
            req.draft = None
            budget = min(budget, req.max_tokens - req.num_output_tokens - 1)
            if budget <= 0:
                continue
            multi_path = (
                self.config.trees and budget >= TREE_MIN_BUDGET and self.acceptance(req) < TREE_MAX_ACCEPTANCE
            )
            draft = self.proposer.propose(req, budget, multi_path)
            self.stats.speculate_calls += 1
            if draft:
                req.draft = draft
                self.stats.draft_tokens_proposed += len(draft)
                self.stats.tree_drafts += not draft.is_path
