"""N engine instances in one rollout, each with its own clock and KV reservation.

In-process instances step one at a time on this machine; each keeps a clock that
advances by the measured duration of its own steps, so the rollout's makespan,
per-instance idle time and tail are those of N instances running side by side.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from seer_engine.core.policies import RolloutPolicy
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine, TokenSource
from seer_engine.outputs import RequestOutput
from seer_engine.spec_decode.proposers import Proposer, make_proposer


@dataclass
class TimelinePoint:
    time: float
    running: int
    waiting: int
    kv_usage: float
    # Cumulative counters of the instance, for figures over parts of the rollout.
    sampled_rows: int = 0
    draft_tokens_accepted: int = 0


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
                self.clock,
                sched.num_running,
                sched.num_waiting,
                self.engine.kv_manager.stats().usage,
                sched.stats.sampled_rows,
                sched.stats.draft_tokens_accepted,
            )
        )
        return outputs


class EnginePool:
    """The instances of one rollout. With speculative decoding they share one proposer
    (the draft server): a group's suffix tree holds the tokens of siblings on every
    instance, and a response resuming elsewhere finds its own tokens there."""

    def __init__(
        self, config: EngineConfig, num_instances: int, token_source: TokenSource | None = None
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"--instances must be >= 1, got {num_instances}")
        spec = config.speculative_config
        self.proposer: Proposer | None = make_proposer(spec) if spec is not None else None
        self.instances = [
            EngineInstance(i, LLMEngine(config, proposer=self.proposer)) for i in range(num_instances)
        ]
        for inst in self.instances:
            inst.engine.token_source = token_source

    @classmethod
    def for_policy(
        cls,
        config: EngineConfig,
        policy: RolloutPolicy,
        num_instances: int,
        token_source: TokenSource | None = None,
    ) -> EnginePool:
        """A pool with the speculative decoding the policy asks for (``seer``: grouped
        suffix trees), unless the config already names one."""
        if policy.speculative is not None and config.speculative_config is None:
            config = dataclasses.replace(config, speculative_config=policy.speculative)
        return cls(config, num_instances, token_source)

    def finish_group(self, group_id: str) -> None:
        """Every response of the group is done: free its drafts on the draft server."""
        if self.proposer is not None:
            self.proposer.finish_group(group_id)

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
