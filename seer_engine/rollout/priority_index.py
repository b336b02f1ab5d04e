"""Buffered samples in the policy's order, kept up to date incrementally.

A dispatch that never lets a lower-priority sample pass a higher one must look at
the buffer in priority order, and the buffer holds thousands of responses between
their chunks. Keys change only when the policy learns something about a group (its
``take_changes``), or for everything at once (the Context Manager refitting its
prior), or when a sample starts to starve; so the index keeps a heap, re-keys only
the samples of groups that changed, and rebuilds only when everything did.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from seer_engine.rollout.types import RolloutSample


class RankedPolicy(Protocol):
    def priority(self, sample: RolloutSample, now: float) -> Any: ...

    def starving(self, enqueued_at: float, now: float) -> bool: ...

    def take_changes(self) -> tuple[bool, set[str]]: ...


class PriorityIndex:
    def __init__(self, policy: RankedPolicy) -> None:
        self.policy = policy
        # [key, arrival, seq, sample]: equal keys go in arrival order; entries of removed
        # or re-keyed samples linger (the live one is the sample's latest seq)
        self._heap: list[list] = []
        self._seq_of: dict[RolloutSample, int] = {}
        self._arrival_of: dict[RolloutSample, int] = {}
        self._by_group: dict[str, set[RolloutSample]] = {}
        self._arrivals: deque[tuple[float, RolloutSample]] = deque()  # enqueue order, for starvation
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._seq_of)

    def add(self, sample: RolloutSample) -> None:
        self._arrival_of[sample] = next(self._counter)
        self._push(sample, self.policy.priority(sample, sample.enqueued_at))
        self._by_group.setdefault(sample.group.group_id, set()).add(sample)
        self._arrivals.append((sample.enqueued_at, sample))
        if len(self._arrivals) > 2 * len(self._seq_of) + 64:
            # Entries leave from the front only as they starve, never without a guard (or
            # behind a live one that does not starve): drop those of samples that left.
            self._arrivals = deque(e for e in self._arrivals if self._waiting(*e))

    def _waiting(self, enqueued_at: float, sample: RolloutSample) -> bool:
        """Whether an arrival is the sample's current stay in the index."""
        return sample in self._seq_of and sample.enqueued_at == enqueued_at

    def remove(self, sample: RolloutSample) -> None:
        del self._seq_of[sample], self._arrival_of[sample]
        members = self._by_group[sample.group.group_id]
        members.discard(sample)
        if not members:
            del self._by_group[sample.group.group_id]

    def _push(self, sample: RolloutSample, key: Any) -> None:
        seq = next(self._counter)
        self._seq_of[sample] = seq
        heapq.heappush(self._heap, [key, self._arrival_of[sample], seq, sample])

    def _refresh(self, now: float) -> None:
        """Re-key what changed: samples that started to starve, then the policy's changes
        (a key taken at ``now`` is the starving one for a sample past the guard)."""
        everything, groups = self.policy.take_changes()
        while self._arrivals and self.policy.starving(self._arrivals[0][0], now):
            enqueued, sample = self._arrivals.popleft()
            if self._waiting(enqueued, sample):
                self._push(sample, self.policy.priority(sample, now))
        if everything:
            self._heap = [
                [self.policy.priority(s, now), self._arrival_of[s], seq, s] for s, seq in self._seq_of.items()
            ]
            heapq.heapify(self._heap)
            return
        for gid in groups:
            for sample in self._by_group.get(gid, ()):
                self._push(sample, self.policy.priority(sample, now))
        if len(self._heap) > 4 * len(self._seq_of) + 64:  # mostly dead entries: compact
            self._heap = [e for e in self._heap if self._seq_of.get(e[3]) == e[2]]
            heapq.heapify(self._heap)

    def ranked(self, now: float) -> Iterator[RolloutSample]:
        """Samples in priority order. The caller may remove the ones it dispatches while
        iterating, and must close the iterator (or run it out) when done."""
        self._refresh(now)
        taken: list[list] = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if self._seq_of.get(entry[3]) != entry[2]:
                    continue  # removed, or re-keyed since
                taken.append(entry)
                yield entry[3]
        finally:
            for entry in taken:
                if self._seq_of.get(entry[3]) == entry[2]:
                    heapq.heappush(self._heap, entry)
