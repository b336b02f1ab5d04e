"""One engine instance of a rollout, as the Request Buffer sees it, wherever it runs.

``InstanceWorker`` sits next to an ``LLMEngine``: it admits rollout chunks (pulling a
migrated response's KV from the pool first), steps the engine, and pushes a chunk's
KV to the pool when the chunk ends. The same worker runs in this process
(``LocalInstance``: instances step in turn, each on its own clock, so one machine
measures N instances side by side) or in a process of its own (``ProcessInstance``,
in ``process_instance.py``) or a Ray actor (``ray_instance.py``). The Request Buffer
keeps its own books on each instance (reservations, chunks in flight, the counters
of the last reply), so placing a chunk never waits for an instance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from seer_engine.core.scheduler import SchedulerStats
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.kv_connector.base import ConnectorStats, KVConnector, LoadResult
from seer_engine.outputs import RequestOutput
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode.drafter import SpecDecodeStats


class InstanceDied(RuntimeError):
    """An instance's process (or actor) is gone; its chunks go back to the buffer."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(f"engine instance {index} died: {why}")
        self.index = index


@dataclass
class ChunkRequest:
    """One dispatch of a response: run it from its tokens so far up to ``params.max_tokens``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    group_id: str
    sequence_id: str  # the response's key: its pool entry and draft-tree sequence
    prior_output_token_ids: list[int]
    stream: bool = False
    load_kv: bool = False  # pull the context's KV from the pool before admitting it
    save_kv: bool = False  # push the context's KV to the pool if the chunk ends by length

    @property
    def context(self) -> list[int]:
        return self.prompt_token_ids + self.prior_output_token_ids


@dataclass
class InstanceInfo:
    """What the Request Buffer needs to know of an instance to place chunks on it."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int

    @classmethod
    def of(cls, engine: LLMEngine) -> InstanceInfo:
        return cls(
            engine.kv_manager.pool.num_blocks,
            engine.kv_manager.block_size,
            engine.config.max_num_seqs,
            engine.max_model_len,
        )


@dataclass
class StepReply:
    outputs: list[RequestOutput]
    elapsed_s: float  # the step plus the pool loads and saves it carried
    running: int
    waiting: int
    kv_usage: float
    stats: SchedulerStats  # cumulative
    drafter: SpecDecodeStats | None
    connector: ConnectorStats
    loads: list[tuple[str, int, LoadResult]] = field(default_factory=list)  # (request id, context, result)
    draft_updates: list = field(default_factory=list)  # new tokens for the draft server (processes)


class InstanceWorker:
    """The engine side of an instance: chunks in, step replies out."""

    def __init__(self, engine: LLMEngine, connector: KVConnector, replica: Any = None) -> None:
        """``replica``: the engine's ``ReplicaProposer`` when its draft trees are
        synchronised through a draft server (instances in their own processes)."""
        self.engine = engine
        self.connector = connector
        self.replica = replica
        self._save: dict[str, ChunkRequest] = {}  # request id -> its chunk, saved when it ends
        self._loads: list[tuple[str, int, LoadResult]] = []
        self._carried_s = 0.0  # pool time since the last step, charged to the next one
        # Chunks the last step ended: an abort sent before the buffer read that step's
        # reply (instances in other processes) still gets their tokens.
        self._just_finished: dict[str, RequestOutput] = {}

    @property
    def info(self) -> InstanceInfo:
        return InstanceInfo.of(self.engine)

    def submit(self, chunk: ChunkRequest) -> None:
        if chunk.load_kv:
            start = time.perf_counter()
            context = chunk.context
            result = self.connector.load(chunk.sequence_id, self.engine, context)
            self._loads.append((chunk.request_id, len(context), result))
            self._carried_s += time.perf_counter() - start
        if chunk.save_kv:
            self._save[chunk.request_id] = chunk
        if self.replica is not None:
            self.replica.reopen(chunk.group_id)  # a group id may come back in a later iteration
        self.engine.add_request(
            chunk.request_id,
            chunk.prompt_token_ids,
            chunk.params,
            group_id=chunk.group_id,
            stream=chunk.stream,
            prior_output_token_ids=chunk.prior_output_token_ids,
            sequence_id=chunk.sequence_id,
        )

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        for rid in request_ids:
            self._save.pop(rid, None)
        outputs = self.engine.abort_request(request_ids)
        aborted = {out.request_id for out in outputs}
        ended = [self._just_finished[r] for r in request_ids if r not in aborted and r in self._just_finished]
        return outputs + ended

    def step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> StepReply:
        """``draft_updates``: siblings' new tokens from the draft server, applied before
        drafting; ``finished_groups``: groups whose drafts can go."""
        if self.replica is not None:
            for gid in finished_groups or ():
                self.replica.finish_group(gid)
            if draft_updates:
                self.replica.apply(draft_updates)
        start = time.perf_counter()
        outputs = self.engine.step()
        self._just_finished = {out.request_id: out for out in outputs if out.finished}
        for out in outputs:
            chunk = self._save.pop(out.request_id, None) if out.finished else None
            if chunk is not None and out.outputs[0].finish_reason == "length":
                context = chunk.prompt_token_ids + list(out.outputs[0].token_ids)
                self.connector.save(chunk.sequence_id, self.engine, context)
        elapsed = time.perf_counter() - start + self._carried_s
        self._carried_s = 0.0
        sched = self.engine.scheduler
        loads, self._loads = self._loads, []
        return StepReply(
            outputs=outputs,
            elapsed_s=elapsed,
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_usage=self.engine.kv_manager.stats().usage,
            stats=sched.stats,
            drafter=self.engine.drafter.stats if self.engine.drafter else None,
            connector=self.connector.stats,
            loads=loads,
            draft_updates=self.replica.take_updates() if self.replica is not None else [],
        )

    def call(self, method: str, *args: Any) -> Any:
        """Serving primitives on the engine (sleep, wake_up, update_weights,
        reset_prefix_cache, snapshot)."""
        if method not in ENGINE_CALLS:
            raise ValueError(f"instances do not forward {method!r}")
        return getattr(self.engine, method)(*args)


ENGINE_CALLS = frozenset({"sleep", "wake_up", "update_weights", "reset_prefix_cache", "snapshot"})


@dataclass
class TimelinePoint:
    time: float
    running: int
    waiting: int
    kv_usage: float
    # Cumulative counters of the instance, for figures over parts of the rollout.
    sampled_rows: int = 0
    draft_tokens_accepted: int = 0


class EngineInstance:
    """The Request Buffer's books on one instance, and how to talk to it."""

    backend = "abstract"

    def __init__(self, index: int, info: InstanceInfo) -> None:
        self.index = index
        self.info = info
        self.clock = 0.0  # the time of its last step's end (simulated or wall)
        self.busy_s = 0.0
        self.reserved_blocks = 0  # KV blocks promised to dispatched chunks
        self.in_flight: dict[str, int] = {}  # engine request id -> reserved blocks
        self.timeline: list[TimelinePoint] = []
        self.alive = True
        self.stats = SchedulerStats()
        self.drafter_stats: SpecDecodeStats | None = None
        self.connector_stats = ConnectorStats()

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks

    @property
    def free_reservable_blocks(self) -> int:
        return self.num_blocks - self.reserved_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.info.block_size)

    @property
    def has_work(self) -> bool:
        return bool(self.in_flight)

    def accepts_at(self, t: float) -> bool:
        """May a chunk enqueued at ``t`` start here? (In-process instances must not run
        work in their own past.)"""
        return True

    def wait_until(self, t: float) -> None:
        """An idle instance waits for work that arrives at ``t``."""

    def record(self, reply: StepReply, clock: float) -> None:
        """Take a step reply into the books."""
        self.clock = clock
        self.busy_s += reply.elapsed_s
        self.stats = reply.stats
        self.drafter_stats = reply.drafter
        self.connector_stats = reply.connector
        self.timeline.append(
            TimelinePoint(
                clock,
                reply.running,
                reply.waiting,
                reply.kv_usage,
                reply.stats.sampled_rows,
                reply.stats.draft_tokens_accepted,
            )
        )

    # -- talking to it (per backend) --------------------------------------------------

    def submit(self, chunk: ChunkRequest) -> None:
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        raise NotImplementedError

    def call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the instance (its process, if it has one)."""


class LocalInstance(EngineInstance):
    """An instance in this process; ``step`` runs it and advances its own clock by
    the measured step time."""

    backend = "inproc"

    def __init__(self, index: int, worker: InstanceWorker) -> None:
        super().__init__(index, worker.info)
        self.worker = worker
        self.engine = worker.engine

    def accepts_at(self, t: float) -> bool:
        return not (self.has_work and self.clock < t)

    def wait_until(self, t: float) -> None:
        if not self.has_work:
            self.clock = max(self.clock, t)

    def step(self) -> StepReply:
        reply = self.worker.step()
        self.record(reply, self.clock + reply.elapsed_s)
        return reply

    def submit(self, chunk: ChunkRequest) -> None:
        self.worker.submit(chunk)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.worker.abort(request_ids)

    def call(self, method: str, *args: Any) -> Any:
        return self.worker.call(method, *args)
