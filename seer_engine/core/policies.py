"""Engine scheduling policies: they decide order and victims, never how tokens are computed.

A policy is a small class behind one interface. The scheduler sorts its waiting
queue by ``sort_key`` (smaller first) and, when KV blocks run out, preempts the
running request that ``select_victim`` names. The simulator's modeled engines use
the same classes. Rollout policies (which response runs next, across instances)
are in ``rollout/policies.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seer_engine.core.request import Request


class SchedulingPolicy:
    name = "abstract"

    def sort_key(self, request: Request) -> Any:
        raise NotImplementedError

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt: by default the one this policy would run last."""
        return max(running, key=self.sort_key)


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (vLLM's default)."""

    name = "fcfs"

    def sort_key(self, request: Request) -> Any:
        return request.arrival_order


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first, arrival order among equals."""

    name = "priority"

    def sort_key(self, request: Request) -> Any:
        return (request.priority, request.arrival_order)


SCHEDULING_POLICIES: dict[str, type[SchedulingPolicy]] = {
    FCFSPolicy.name: FCFSPolicy,
    PriorityPolicy.name: PriorityPolicy,
}


def make_policy(name: str | SchedulingPolicy) -> SchedulingPolicy:
    if isinstance(name, SchedulingPolicy):
        return name
    if name not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(SCHEDULING_POLICIES)}")
    return SCHEDULING_POLICIES[name]()
