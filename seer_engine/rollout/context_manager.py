"""Seer's Context Manager: what the rollout has learned about each group's length.

Two ranking rules, both online (they see finishes and progress at chunk ends, never
a true length):

- ``seer`` (the paper's rule): a group's estimate is its longest finished response,
  else the original max_tokens. The probe of each group runs first,
  shortest-generated-first, until its group has a finished response, so short groups
  finish early and reveal themselves; everything else runs longest-first by estimate.
- ``groupmax`` (the default): a group's estimate is the expected longest response given
  all its evidence (``GroupMaxEstimator``: finished siblings, lower bounds from
  responses in flight, the rollout's population of groups refitted on prompt length,
  and, with a history store, earlier iterations of the same prompt). Samples run in
  the order they (re-)entered the buffer, as under ``divided``; among those that
  entered together (a rollout's fresh samples, a batch of chunk ends) by estimated
  group maximum, shortest first. The probe runs its first chunk before everything
  else, unless the history store already knows the prompt.

Why the group maximum: a group is done when its longest response is, so it is what
longest-first must rank by; Seer's rule ties every group without a finished response
at max_tokens (FCFS until the first finishes) and drops a group below all unknown ones
as soon as its shortest response finishes. Why wait order first: a response that
rejoins the back of the queue after each chunk keeps every long response moving, and
longest-first across waits packs long contexts together, which leaves less KV for rows.
Why shortest first among equal waits: it is measured, not derived (moonlight and kimi-k2
in the simulator, iteration 2, several seeds: ``benchmarks/results/simulator``). Under
longest first, kimi-k2's rollout was ended by a capped response of a group ranked short,
started at 271 s; no estimate foresees such a response.
``order="estimate"`` ranks the groups the history store knows longest-estimate-first
across waits instead. It pays where prompts differ in length far more than one
prompt's responses do: the group estimate then says which responses are long. Where
most of the spread is within groups (the Qwen3 trace), the guesses start some long
responses late and lose throughput. ``order="auto"`` (the default) measures that ratio
on the history store's lengths and picks between the two.
In the simulator the FIFO rotation alone is within 2-4% of the oracle's throughput on
moonlight and kimi-k2 (``benchmarks/results/simulator/README.md``). A starvation guard
lets a request that waited too long go first (the probes and a server's mix of
budgets can hold requests back).
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from seer_engine.rollout.group_estimator import GroupMaxEstimator
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.types import Group, RolloutSample

PROBE_INDEX = 0  # the sample of each group that runs as its probe
RULES = ("seer", "groupmax")
# ``groupmax``'s order: "wait" (wait order first, shortest estimate among equal waits),
# "estimate" (groups the history store knows, longest estimate first across waits,
# ahead of the rest, which keep the wait order), or "auto": "estimate" once the history
# store shows prompts differing in length far more than one prompt's responses do.
ORDERS = ("auto", "wait", "estimate")
# "auto" ranks by estimate when the sd of known prompts' mean log lengths exceeds this
# many times the sd of log length within a prompt, over at least AUTO_MIN_PROMPTS known
# prompts. Measured regimes (simulator): ratio ~1.5 (the Qwen3 trace's spread: the
# estimate order loses 13-15%) and ~5 (qwen2vl-72b: it cuts the tail by 96%).
AUTO_SPREAD_RATIO = 2.0
AUTO_MIN_PROMPTS = 8
RECENT_LENGTHS = 4096  # finished lengths the long-tail test takes its median over


class LengthSpread:
    """How much prompts differ in length, against how much one prompt's responses do,
    from earlier iterations' lengths (log scale; a prompt needs two lengths to count)."""

    def __init__(self) -> None:
        self.prompts = 0
        self._sum = self._sumsq = self._within = 0.0

    def add(self, lengths: list[int]) -> None:
        logs = [math.log(x) for x in lengths if x > 0]
        if len(logs) < 2:
            return
        mean = sum(logs) / len(logs)
        self.prompts += 1
        self._sum += mean
        self._sumsq += mean * mean
        self._within += sum((x - mean) ** 2 for x in logs) / len(logs)

    def ratio(self) -> float:
        """sd across prompts' mean log lengths over the mean within-prompt sd (0: too few prompts)."""
        if self.prompts < AUTO_MIN_PROMPTS:
            return 0.0
        mean = self._sum / self.prompts
        between = math.sqrt(max(0.0, self._sumsq / self.prompts - mean * mean))
        return between / max(math.sqrt(self._within / self.prompts), 1e-9)


@dataclass
class _GroupState:
    max_tokens: int
    finished_lengths: list[int] = field(default_factory=list)
    seen_before: bool = False  # the history store knows the prompt


# A response that has waited this long in the buffer goes first, oldest first. The wait
# order already serves responses in turn; the guard bounds how long the probes (and, in a
# server, responses of groups registered later) can hold one back.
DEFAULT_STARVATION_S = 120.0


def add_context_order_arg(parser: argparse.ArgumentParser) -> None:
    """``--context-order``, as every command that runs the Context Manager takes it."""
    parser.add_argument(
        "--context-order", choices=ORDERS, default="auto",
        help="the Context Manager's order: wait order first (wait), or, for prompts the history "
        "store knows, longest estimate first across waits (estimate); auto (default): estimate once "
        "the history shows prompts differing in length far more than their responses do",
    )  # fmt: skip


class ContextManager:
    def __init__(
        self,
        starvation_s: float = DEFAULT_STARVATION_S,
        rule: str = "groupmax",
        probes: bool = True,
        estimator: GroupMaxEstimator | None = None,
        history: HistoryStore | None = None,
        order: str = "auto",
    ) -> None:
        """``history``: earlier iterations' lengths per prompt, the prior of each group
        (``groupmax``), recorded into as responses finish. ``order``: see ``ORDERS``."""
        if rule not in RULES:
            raise ValueError(f"unknown context rule {rule!r}; choose from {RULES}")
        if order not in ORDERS:
            raise ValueError(f"unknown context order {order!r}; choose from {ORDERS}")
        self.order = order
        self.starvation_s = starvation_s
        self.rule = rule
        self.probes = probes
        self.history = history
        self.estimator = estimator or GroupMaxEstimator()
        self._groups: dict[str, _GroupState] = {}
        self._changed: set[str] = set()  # groups whose samples' rank keys changed (take_changes)
        self._epoch = self.estimator.epoch
        self.spread = LengthSpread()  # of the prompts the history store knows ("auto")
        self._by_estimate = order == "estimate"  # known prompts ranked across waits
        self._reorder = False  # "auto" switched: every known prompt's key changed
        self._recent: deque[int] = deque()  # the latest finished lengths, in finishing order
        self._recent_sorted: list[int] = []  # the same, sorted

    def register(self, group: Group, max_tokens: int) -> None:
        gid = group.group_id
        self._groups[gid] = _GroupState(max_tokens)
        if self.rule != "groupmax":
            return
        self.estimator.register(gid, group.n, max_tokens, len(group.prompt_token_ids))
        if self.history is not None:
            seen = self.history.lengths(group.prompt_token_ids)
            if seen:
                self.estimator.set_history(gid, seen)
                self._groups[gid].seen_before = True
                self._measure_spread([x for x, _ in seen])

    def _measure_spread(self, lengths: list[int]) -> None:
        self.spread.add(lengths)
        if self.order == "auto":
            by_estimate = self.spread.ratio() > AUTO_SPREAD_RATIO
            self._reorder |= by_estimate != self._by_estimate
            self._by_estimate = by_estimate

    @property
    def guard_s(self) -> float | None:
        """The starvation guard in force: none under the estimate order, which holds short
        known prompts back on purpose (the guard would serve the oldest first and undo it).
        So a server fed longer known prompts without pause can hold a short one back until
        they stop; ``order="wait"`` keeps the guard."""
        return None if self._by_estimate else self.starvation_s

    @property
    def effective_order(self) -> str:
        """The order now in force for prompts the history store knows ("wait" or "estimate")."""
        return "estimate" if self._by_estimate else "wait"

    def raise_budget(self, group_id: str, max_tokens: int) -> None:
        """A response with a larger budget joined the group (online serving)."""
        state = self._groups[group_id]
        state.max_tokens = max(state.max_tokens, max_tokens)
        self._changed.add(group_id)
        if self.rule == "groupmax":
            self.estimator.raise_budget(group_id, max_tokens)

    def take_changes(self) -> tuple[bool, set[str]]:
        """(every key may have changed, groups whose keys changed) since the last call."""
        everything = self.estimator.epoch != self._epoch or self._reorder
        self._epoch, self._reorder = self.estimator.epoch, False
        changed, self._changed = self._changed, set()
        return everything, changed

    def forget(self, group_id: str) -> None:
        self._groups.pop(group_id, None)
        self._changed.discard(group_id)  # nothing to re-key; baseline and divided never take them
        if self.rule == "groupmax":
            self.estimator.forget(group_id)

    def on_chunk_end(self, sample: RolloutSample) -> None:
        """A response's chunk ended and it runs on: its length is at least what it has."""
        gid = sample.group.group_id
        self._changed.add(gid)
        if self.rule == "groupmax":
            self.estimator.observe_progress(gid, sample.sample_index, sample.num_generated)

    def on_finished(self, sample: RolloutSample) -> None:
        gid = sample.group.group_id
        self._groups[gid].finished_lengths.append(sample.num_generated)
        self._changed.add(gid)
        self._note_length(sample.num_generated)
        if self.history is not None:
            self.history.record(sample.group.prompt_token_ids, sample.num_generated)
        if self.rule == "groupmax":
            self.estimator.observe_finished(gid, sample.sample_index, sample.num_generated)

    def _note_length(self, length: int) -> None:
        self._recent.append(length)
        bisect.insort(self._recent_sorted, length)
        if len(self._recent) > RECENT_LENGTHS:
            old = self._recent.popleft()
            del self._recent_sorted[bisect.bisect_left(self._recent_sorted, old)]

    def long_tail(self, sample: RolloutSample) -> bool:
        """Whether the response has already written more than half of the latest finished
        responses did in all: the long responses that decide when a rollout ends (Seer's
        high-priority requests, which draft deeper). False until one has finished."""
        done = self._recent_sorted
        return bool(done) and sample.num_generated > done[(len(done) - 1) // 2]

    def estimate(self, group_id: str) -> int:
        """The group's expected longest response (``seer``: longest finished, else max_tokens)."""
        if self.rule == "groupmax":
            return round(self.estimator.estimate(group_id))
        state = self._groups[group_id]
        return max(state.finished_lengths) if state.finished_lengths else state.max_tokens

    def has_finished_sample(self, group_id: str) -> bool:
        return bool(self._groups[group_id].finished_lengths)

    def _probing(self, sample: RolloutSample) -> bool:
        if not self.probes or sample.sample_index != PROBE_INDEX:
            return False
        state = self._groups[sample.group.group_id]
        if state.finished_lengths or state.seen_before:
            return False  # the group has shown (or an earlier iteration showed) its length
        return self.rule == "seer" or sample.chunks == 0

    def rank_key(self, sample: RolloutSample) -> tuple:
        """The sample's place in the Context Manager's order (smaller first; it changes
        only when its group's evidence does, which ``take_changes`` reports). The
        starvation guard (``guard_s``) is applied over it by ``RolloutPolicy.priority``."""
        gid = sample.group.group_id
        if self._probing(sample):
            return (1, sample.num_generated, sample.group.order)
        if self.rule == "groupmax":
            value = self.estimate(gid)
            if self._by_estimate and self._groups[gid].seen_before:
                return (2, 0, -value, -sample.num_generated, sample.group.order, sample.sample_index)
            return (2, 1, sample.enqueued_at, value, sample.group.order, sample.sample_index)
        return (2, -self.estimate(gid), sample.group.order, sample.sample_index)
