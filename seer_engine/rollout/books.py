"""The Request Buffer's books on one instance: its chunks in flight, the KV blocks they
reserve, its clock and what its last reply reported.

The books live with the dispatcher, not the instance, so placing a chunk never waits
for an instance: the reservation is known here the moment the chunk is sent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from seer_engine.engine.stats import EngineStats
from seer_engine.kv_connector.base import ConnectorStats
from seer_engine.rollout.types import InstanceInfo, RolloutSample, StepReply
from seer_engine.spec_decode.drafter import SpecDecodeStats


@dataclass
class InFlight:
    """A dispatched chunk: whose it is and the KV blocks reserved for it."""

    sample: RolloutSample
    blocks: int


@dataclass
class TimelinePoint:
    time: float
    running: int
    waiting: int
    kv_usage: float
    # Cumulative counters of the instance, for figures over parts of the rollout.
    sampled_rows: int = 0
    draft_tokens_accepted: int = 0
    kv_reserved: float = 0.0  # share of blocks promised to chunks in flight (divided rollout)


class InstanceBooks:
    def __init__(self, info: InstanceInfo, timeline_points: int | None = None) -> None:
        """``timeline_points``: keep only the most recent steps (a server runs for days;
        an offline rollout keeps them all for its report)."""
        self.info = info
        self.in_flight: dict[str, InFlight] = {}  # engine request id -> its chunk
        self.reserved_blocks = 0
        self.clock = 0.0  # the time of its last step's end (simulated or wall)
        self.busy_s = 0.0
        self.timeline: deque[TimelinePoint] = deque(maxlen=timeline_points)
        self.stats = EngineStats(kv_total_blocks=info.num_blocks)  # as of its last answer
        self.drafter_stats: SpecDecodeStats | None = None
        self.connector_stats = ConnectorStats()

    # -- reservations ------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks not promised to a chunk in flight."""
        return self.info.num_blocks - self.reserved_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.in_flight)

    @property
    def has_free_seq(self) -> bool:
        return len(self.in_flight) < self.info.max_num_seqs

    def reserve(self, request_id: str, sample: RolloutSample, blocks: int) -> None:
        self.in_flight[request_id] = InFlight(sample, blocks)
        self.reserved_blocks += blocks

    def release(self, request_id: str) -> InFlight | None:
        """The chunk ended or was aborted; None if it was not in flight."""
        chunk = self.in_flight.pop(request_id, None)
        if chunk is not None:
            self.reserved_blocks -= chunk.blocks
        return chunk

    def lose(self) -> list[InFlight]:
        """The instance is gone: every chunk in flight, released."""
        lost = list(self.in_flight.values())
        self.in_flight.clear()
        self.reserved_blocks = 0
        return lost

    def group_ids(self) -> list[str]:
        """Groups with a chunk in flight here (their drafts ride on its next step)."""
        return sorted({c.sample.group.group_id for c in self.in_flight.values()})

    # -- what the instance reported ----------------------------------------------------

    def record(self, reply: StepReply, clock: float) -> None:
        self.clock = clock
        self.busy_s += reply.elapsed_s
        self.stats = reply.stats
        self.drafter_stats = reply.drafter
        self.connector_stats = reply.connector
        s = reply.stats
        reserved = self.reserved_blocks / self.info.num_blocks
        self.timeline.append(
            TimelinePoint(
                clock, s.running, s.waiting, s.kv_usage, s.sampled_rows, s.draft_tokens_accepted, reserved
            )
        )

    def reset_clock(self) -> None:
        self.clock = self.busy_s = 0.0
        self.timeline.clear()
