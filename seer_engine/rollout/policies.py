"""Rollout policies: in which order buffered responses are dispatched, whether they
run in chunks, whether whole groups are pinned to instances up front.

One interface for the real engines' dispatcher and the simulator (which runs the same
dispatcher over modeled instances).
"""

from __future__ import annotations

from typing import Any

from seer_engine.rollout.context_manager import ContextManager
from seer_engine.rollout.types import RolloutSample


class RolloutPolicy:
    name = "abstract"
    chunked = True  # divided rollout: at most chunk_tokens per dispatch
    pin_groups_up_front = False  # veRL-style: every group sent to one instance at the start
    speculative: dict | None = None  # the speculative decoding the engines need (a --speculative-config)

    def __init__(self, context: ContextManager | None = None) -> None:
        self.context = context or ContextManager()

    def priority(self, sample: RolloutSample, now: float) -> Any:
        """Dispatch order among buffered samples (smaller first)."""
        return (sample.group.order, sample.sample_index)

    def order(self, samples: list[RolloutSample], now: float) -> list[RolloutSample]:
        """``samples`` in dispatch order (a policy may compute many keys at once faster)."""
        return sorted(samples, key=lambda s: self.priority(s, now))


class BaselinePolicy(RolloutPolicy):
    """veRL-style: whole groups to instances up front, FCFS, no chunks, preempt by recompute."""

    name = "baseline"
    chunked = False
    pin_groups_up_front = True


class DividedPolicy(RolloutPolicy):
    """Divided rollout alone: chunks dispatched FCFS to any instance with free KV."""

    name = "divided"


class ContextAwarePolicy(RolloutPolicy):
    """Divided rollout + the Context Manager's probe-first, longest-first order."""

    name = "context"

    def priority(self, sample: RolloutSample, now: float) -> Any:
        return self.context.priority(sample, now)

    def order(self, samples: list[RolloutSample], now: float) -> list[RolloutSample]:
        if type(self).priority is not ContextAwarePolicy.priority:
            return super().order(samples, now)  # a subclass changed the key: use it
        keys = self.context.priorities(samples, now)
        return [samples[i] for i in sorted(range(len(samples)), key=keys.__getitem__)]


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

    def priority(self, sample: RolloutSample, now: float) -> Any:
        return (-self.true_lengths[sample.key], sample.group.order, sample.sample_index)


ROLLOUT_POLICIES: dict[str, type[RolloutPolicy]] = {
    p.name: p for p in (BaselinePolicy, DividedPolicy, ContextAwarePolicy, SeerPolicy, OraclePolicy)
}


def make_rollout_policy(
    name: str, true_lengths: dict[str, int] | None = None, **context_args
) -> RolloutPolicy:
    if name not in ROLLOUT_POLICIES:
        raise ValueError(f"unknown rollout policy {name!r}; choose from {sorted(ROLLOUT_POLICIES)}")
    context = ContextManager(**context_args)
    if name == "oracle":
        if true_lengths is None:
            raise ValueError("the oracle policy needs the true lengths (trace replay only)")
        return OraclePolicy(true_lengths, context)
    return ROLLOUT_POLICIES[name](context)
