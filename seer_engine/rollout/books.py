"""The Request Buffer's books on one instance: its chunks in flight, the KV blocks they
reserve, its clock and what its last reply reported.

The books live with the dispatcher, not the instance, so placing a chunk never waits
for an instance: the reservation is known here the moment the chunk is sent.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from seer_engine.engine.stats import EngineStats
from seer_engine.kv_connector.base import ConnectorStats
from seer_engine.rollout.types import InstanceInfo, RolloutSample, StepReply
from seer_engine.spec_decode.drafter import SpecDecodeStats


@dataclass
class InFlight:
    """A dispatched chunk: whose it is, the KV blocks of its end-of-chunk footprint, and
    the output tokens it starts from and stops at (admission rules read them)."""

    sample: RolloutSample
    blocks: int
    start: int = 0
    end: int = 0
    prompt_blocks: int = 0  # the prompt's full blocks, held once per group on the instance


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
        self.reserved_blocks = 0  # end-of-chunk footprints, a group's prompt blocks counted once
        self.group_chunks: dict[str, int] = {}  # group -> its chunks in flight here
        self.progress: dict[str, int] = {}  # engine request id -> output tokens, as of the last reply
        self.outlook: object | None = None  # an admission rule's cache; None whenever the books change
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

    def reserve(
        self, request_id: str, sample: RolloutSample, blocks: int, start: int = 0, end: int = 0,
        prompt_blocks: int = 0,
    ) -> None:  # fmt: skip
        """``blocks``: the chunk's end-of-chunk footprint; ``prompt_blocks`` of it are
        not held again while a sibling's chunk is in flight here (prefix-cached)."""
        gid = sample.group.group_id
        siblings = self.group_chunks.get(gid, 0)
        self.in_flight[request_id] = InFlight(sample, blocks, start, end, prompt_blocks)
        self.group_chunks[gid] = siblings + 1
        self.reserved_blocks += blocks - (prompt_blocks if siblings else 0)
        self.outlook = None

    def release(self, request_id: str) -> InFlight | None:
        """The chunk ended or was aborted; None if it was not in flight."""
        chunk = self.in_flight.pop(request_id, None)
        if chunk is not None:
            gid = chunk.sample.group.group_id
            left = self.group_chunks.pop(gid) - 1
            if left:
                self.group_chunks[gid] = left
            self.reserved_blocks -= chunk.blocks - (chunk.prompt_blocks if left else 0)
            self.progress.pop(request_id, None)
            self.outlook = None
        return chunk

    def lose(self) -> list[InFlight]:
        """The instance is gone: every chunk in flight, released."""
        lost = list(self.in_flight.values())
        self.in_flight.clear()
        self.group_chunks.clear()
        self.progress.clear()
        self.reserved_blocks = 0
        self.outlook = None
        return lost

    def group_ids(self) -> list[str]:
        """Groups with a chunk in flight here (their drafts ride on its next step)."""
        return sorted({c.sample.group.group_id for c in self.in_flight.values()})

    # -- what the instance reported ----------------------------------------------------

    def current_stats(self) -> EngineStats:
        """The last reply's figures, its samples counted as the books hold them now: a
        chunk sent since that reply waits at the instance, one released since is gone, and
        with none in flight the instance holds no KV (a reply computed before an abort,
        recorded after its answer, saw the KV the abort freed)."""
        chunks = len(self.in_flight)
        running = min(self.stats.running, chunks)
        used = self.stats.kv_used_blocks if chunks else 0
        return replace(self.stats, running=running, waiting=chunks - running, kv_used_blocks=used)

    def record(self, reply: StepReply, clock: float) -> None:
        self.clock = clock
        self.busy_s += reply.elapsed_s
        self.stats = reply.stats
        self.drafter_stats = reply.drafter
        self.connector_stats = reply.connector
        if reply.progress:
            # Only chunks still here: one released (aborted) while the step ran would stay.
            in_flight = self.in_flight
            self.progress.update((rid, n) for rid, n in reply.progress.items() if rid in in_flight)
            self.outlook = None
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
