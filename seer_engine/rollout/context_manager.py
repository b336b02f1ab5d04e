"""Seer's Context Manager: what the rollout has learned about each group's length.

Siblings of a group have similar lengths, so the first finished response of a group
is a good hint for the rest. The estimate of a group is the longest finished
response so far, else the original max_tokens. One request per group (the probe)
runs first, shortest-generated-first, so short groups finish early and reveal
themselves; everything else runs approximately longest-first by estimate. A
starvation guard lets a request that waited too long go first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seer_engine.rollout.types import Group, RolloutSample

PROBE_INDEX = 0  # the sample of each group that runs as its probe


@dataclass
class _GroupState:
    max_tokens: int
    finished_lengths: list[int] = field(default_factory=list)


class ContextManager:
    def __init__(self, starvation_s: float = 120.0) -> None:
        self.starvation_s = starvation_s
        self._groups: dict[str, _GroupState] = {}

    def register(self, group: Group, max_tokens: int) -> None:
        self._groups[group.group_id] = _GroupState(max_tokens)

    def raise_budget(self, group_id: str, max_tokens: int) -> None:
        """A response with a larger budget joined the group (online serving)."""
        state = self._groups[group_id]
        state.max_tokens = max(state.max_tokens, max_tokens)

    def forget(self, group_id: str) -> None:
        self._groups.pop(group_id, None)

    def on_finished(self, sample: RolloutSample) -> None:
        self._groups[sample.group.group_id].finished_lengths.append(sample.num_generated)

    def estimate(self, group_id: str) -> int:
        state = self._groups[group_id]
        return max(state.finished_lengths) if state.finished_lengths else state.max_tokens

    def has_finished_sample(self, group_id: str) -> bool:
        return bool(self._groups[group_id].finished_lengths)

    def priorities(self, samples: list[RolloutSample], now: float) -> list[tuple]:
        """``priority`` of many samples: one pass over the group states (a dispatch
        orders thousands of buffered samples in the simulator)."""
        keys = []
        states, starvation = self._groups, self.starvation_s
        for sample in samples:
            waited = now - sample.enqueued_at
            if waited > starvation:
                keys.append((0, -waited))
                continue
            group = sample.group
            done = states[group.group_id].finished_lengths
            if sample.sample_index == PROBE_INDEX and not done:
                keys.append((1, len(sample.output_token_ids), group.order))
            else:
                estimate = max(done) if done else states[group.group_id].max_tokens
                keys.append((2, -estimate, group.order, sample.sample_index))
        return keys

    def priority(self, sample: RolloutSample, now: float) -> tuple:
        """Smaller runs first: starving requests, then probes, then longest-first."""
        waited = now - sample.enqueued_at
        if waited > self.starvation_s:
            return (0, -waited)
        gid = sample.group.group_id
        if sample.sample_index == PROBE_INDEX and not self.has_finished_sample(gid):
            return (1, sample.num_generated, sample.group.order)
        return (2, -self.estimate(gid), sample.group.order, sample.sample_index)
