"""Rollout policies: in which order buffered responses are dispatched, whether they
run in chunks, whether whole groups are pinned to instances up front.

One interface for the real engines' dispatcher and the simulator (which runs the same
dispatcher over modeled instances).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seer_engine.rollout.context_manager import ContextManager
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.types import RolloutSample


class RolloutPolicy:
    name = "abstract"
    chunked = True  # divided rollout: at most chunk_tokens per dispatch
    pin_groups_up_front = False  # veRL-style: every group sent to one instance at the start
    speculative: dict | None = None  # the speculative decoding the engines need (a --speculative-config)
    starvation_s: float | None = None  # a sample waiting longer goes first (None: no guard)

    def __init__(self, context: ContextManager | None = None) -> None:
        self.context = context or ContextManager()

    def rank_key(self, sample: RolloutSample) -> Any:
        """The policy's own order among buffered samples (smaller first). It may change
        only as ``take_changes`` says; a policy defines its order here."""
        return (sample.group.order, sample.sample_index)

    def starving(self, enqueued_at: float, now: float) -> bool:
        """Whether a sample buffered since ``enqueued_at`` has waited past the guard."""
        guard = self.starvation_s
        return guard is not None and now - enqueued_at > guard

    def priority(self, sample: RolloutSample, now: float) -> tuple:
        """Dispatch order (smaller first): samples past the starvation guard, oldest
        first (equals in the order they arrived), ahead of everything else in
        ``rank_key`` order. The one statement of the rule: the Request Buffer's
        ``PriorityIndex`` keys samples with it."""
        if self.starving(sample.enqueued_at, now):
            return (0, sample.enqueued_at)
        return (1, self.rank_key(sample))

    def order(self, samples: list[RolloutSample], now: float) -> list[RolloutSample]:
        """``samples`` in dispatch order."""
        return sorted(samples, key=lambda s: self.priority(s, now))

    def take_changes(self) -> tuple[bool, set[str]]:
        """(every rank key may have changed, groups whose samples' keys changed) since the
        last call (the buffer's priority index re-keys only those)."""
        return False, set()

    def high_priority(self, sample: RolloutSample) -> bool:
        """Whether the chunk's drafts weigh more in its engine's draft budget."""
        return False


class BaselinePolicy(RolloutPolicy):
    """veRL-style: whole groups to instances up front, FCFS, no chunks, preempt by recompute."""

    name = "baseline"
    chunked = False
    pin_groups_up_front = True


class DividedPolicy(RolloutPolicy):
    """Divided rollout alone: the Request Buffer is a FIFO queue. A response whose chunk
    ended joins the back, behind responses that have waited longer (fresh ones too), and
    each chunk goes to any instance with free KV."""

    name = "divided"

    def rank_key(self, sample: RolloutSample) -> Any:
        return (sample.enqueued_at, sample.group.order, sample.sample_index)


class ContextAwarePolicy(RolloutPolicy):
    """Divided rollout + the Context Manager's order: probes first, then wait order, then
    the shortest estimated group first among equal waits."""

    name = "context"

    @property
    def starvation_s(self) -> float | None:  # type: ignore[override]
        return self.context.guard_s

    def rank_key(self, sample: RolloutSample) -> Any:
        return self.context.rank_key(sample)

    def take_changes(self) -> tuple[bool, set[str]]:
        return self.context.take_changes()

    def high_priority(self, sample: RolloutSample) -> bool:
        return self.context.long_tail(sample)


class SeerPolicy(ContextAwarePolicy):
    """Seer: divided rollout + context-aware order + adaptive grouped speculative decoding
    (one suffix tree per group, shared by every instance)."""

    name = "seer"
    speculative = {"method": "group_suffix"}


class OraclePolicy(RolloutPolicy):
    """Longest-first with the true lengths (benchmarks only: they must be handed in)."""

    name = "oracle"

    def __init__(self, true_lengths: dict[str, int], context: ContextManager | None = None) -> None:
        super().__init__(context)
        self.true_lengths = true_lengths

    def rank_key(self, sample: RolloutSample) -> Any:
        return (-self.true_lengths[sample.key], sample.group.order, sample.sample_index)


ROLLOUT_POLICIES: dict[str, type[RolloutPolicy]] = {
    p.name: p for p in (BaselinePolicy, DividedPolicy, ContextAwarePolicy, SeerPolicy, OraclePolicy)
}


HISTORY_SUFFIX = "+history"  # a context-aware policy whose Context Manager learns across iterations
HISTORY_POLICIES = tuple(
    name + HISTORY_SUFFIX for name, cls in ROLLOUT_POLICIES.items() if issubclass(cls, ContextAwarePolicy)
)


def policy_choices() -> list[str]:
    return sorted(ROLLOUT_POLICIES) + list(HISTORY_POLICIES)


def rollout_policy_names(names: str | Sequence[str]) -> list[str]:
    """Check policy names (``context+history``: a context-aware one with a history store)."""
    out = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    out = [n for n in out if n]
    for name in out:
        if name not in ROLLOUT_POLICIES and name not in HISTORY_POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {policy_choices()}")
    return out


def distinct_policies(policies: list[str]) -> list[str]:
    """A command's ``--policy`` list: at least one policy and none twice (results are kept
    per name, and a ``+history`` policy named twice would learn from its own duplicate)."""
    if not policies:
        raise ValueError("--policy names no policy")
    twice = sorted({name for name in policies if policies.count(name) > 1})
    if twice:
        raise ValueError(f"--policy names {', '.join(twice)} more than once")
    return policies


def make_rollout_policy(
    name: str, true_lengths: dict[str, int] | None = None, history: HistoryStore | None = None, **context_args
) -> RolloutPolicy:
    """``name`` may end in ``+history``: its Context Manager then uses ``history`` (a store
    kept across iterations; a fresh one if None) as each group's prior."""
    if name in HISTORY_POLICIES:
        base = name.removesuffix(HISTORY_SUFFIX)
        context = ContextManager(history=history if history is not None else HistoryStore(), **context_args)
        policy = ROLLOUT_POLICIES[base](context)
        policy.name = name
        return policy
    if name not in ROLLOUT_POLICIES:
        raise ValueError(f"unknown rollout policy {name!r}; choose from {policy_choices()}")
    context = ContextManager(**context_args)
    if name == "oracle":
        if true_lengths is None:
            raise ValueError("the oracle policy needs the true lengths (trace replay only)")
        return OraclePolicy(true_lengths, context)
    return ROLLOUT_POLICIES[name](context)


def check_context_flags(policies: Sequence[str], starvation_s: float | None, order: str) -> None:
    """``--starvation-s`` and ``--context-order`` (None and ``auto`` when not given) set the
    Context Manager's guard and order; where no policy runs one (baseline, divided, oracle)
    they would change nothing."""
    if any(
        issubclass(ROLLOUT_POLICIES[p.removesuffix(HISTORY_SUFFIX)], ContextAwarePolicy) for p in policies
    ):
        return
    given = [flag for flag, value in (("--starvation-s", starvation_s), ("--context-order", order))
             if value not in (None, "auto")]  # fmt: skip
    if given:
        raise ValueError(
            f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} the Context Manager's rules, which "
            f"none of the policies {list(policies)} runs (context and seer do)"
        )
