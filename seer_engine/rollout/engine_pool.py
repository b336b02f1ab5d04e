"""N engine instances in one rollout, each with its own clock and KV reservation.

In-process instances step one at a time on this machine; each keeps a clock that
advances by the measured duration of its own steps, so the rollout's makespan,
per-instance idle time and tail are those of N instances running side by side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine, TokenSource
from seer_engine.outputs import RequestOutput


@dataclass
class TimelinePoint:
    time: float
    running: int
    waiting: int
    kv_usage: float


@dataclass
class EngineInstance:
    index: int
    engine: LLMEngine
    clock: float = 0.0
    busy_s: float = 0.0
    reserved_blocks: int = 0  # KV blocks promised to dispatched chunks
    in_flight: dict[str, int] = field(default_factory=dict)  # engine request id -> reserved blocks
    timeline: list[TimelinePoint] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return self.engine.kv_manager.pool.num_blocks

    @property
    def free_reservable_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        self.clock += elapsed
        self.busy_s += elapsed
        sched = self.engine.scheduler
        self.timeline.append(
            TimelinePoint(
                self.clock, sched.num_running, sched.num_waiting, self.engine.kv_manager.stats().usage
            )
        )
        return outputs


class EnginePool:
    def __init__(
        self, config: EngineConfig, num_instances: int, token_source: TokenSource | None = None
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"--instances must be >= 1, got {num_instances}")
        self.instances = [EngineInstance(i, LLMEngine(config)) for i in range(num_instances)]
        for inst in self.instances:
            inst.engine.token_source = token_source

    def __iter__(self):
        return iter(self.instances)

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def first(self) -> LLMEngine:
        return self.instances[0].engine

    def reset_clocks(self) -> None:
        for inst in self.instances:
            inst.clock = inst.busy_s = 0.0
            inst.timeline.clear()
