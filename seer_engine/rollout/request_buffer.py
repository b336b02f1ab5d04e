"""The Request Buffer: responses waiting for their next chunk, indexed by the KV blocks
that chunk needs.

A dispatch can only place a chunk that fits the roomiest instance, so the buffer
hands out exactly those (a prefix of its need order) and a long buffer that mostly
waits for KV costs little per step: the simulator's hold thousands of responses.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator

from seer_engine.rollout.priority_index import PriorityIndex, RankedPolicy
from seer_engine.rollout.types import RolloutSample


class RequestBuffer:
    def __init__(
        self, blocks_needed: Callable[[RolloutSample], int], policy: RankedPolicy | None = None
    ) -> None:
        """``policy``: keep the samples in its priority order too (``ranked``)."""
        self._blocks_needed = blocks_needed
        self.index = PriorityIndex(policy) if policy is not None else None
        self._needs: list[int] = []  # ascending
        self._samples: list[RolloutSample] = []  # in the order of _needs
        self._need_of: dict[RolloutSample, int] = {}

    def add(self, sample: RolloutSample) -> None:
        """Buffer ``sample``; its next chunk's need is fixed while it waits."""
        need = self._blocks_needed(sample)
        i = bisect_right(self._needs, need)
        self._needs.insert(i, need)
        self._samples.insert(i, sample)
        self._need_of[sample] = need
        if self.index is not None:
            self.index.add(sample)

    def remove(self, sample: RolloutSample) -> None:
        need = self._need_of.pop(sample)
        i = bisect_left(self._needs, need)
        while self._samples[i] is not sample:
            i += 1
        del self._needs[i], self._samples[i]
        if self.index is not None:
            self.index.remove(sample)

    def ranked(self, now: float) -> Iterator[RolloutSample]:
        """The samples in the policy's priority order (``PriorityIndex.ranked``)."""
        if self.index is None:
            raise RuntimeError("this buffer keeps no priority order")
        return self.index.ranked(now)

    @property
    def smallest_need(self) -> int:
        return self._needs[0] if self._needs else 0

    def need(self, sample: RolloutSample) -> int:
        return self._need_of[sample]

    def fitting(self, blocks: int) -> list[RolloutSample]:
        """The samples whose next chunk needs at most ``blocks`` KV blocks."""
        return self._samples[: bisect_right(self._needs, blocks)]

    def __contains__(self, sample: object) -> bool:
        return sample in self._need_of

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(list(self._samples))

    def __len__(self) -> int:
        return len(self._samples)

    def __bool__(self) -> bool:
        return bool(self._samples)
