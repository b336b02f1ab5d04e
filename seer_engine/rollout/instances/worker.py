"""The engine side of an instance: rollout chunks in, step replies out.

``InstanceWorker`` sits next to an ``LLMEngine`` in whatever process runs it (this
one, an instance process, a Ray actor). It admits chunks (pulling a migrated
response's KV from the pool first), steps the engine, and pushes a chunk's KV to the
pool when the chunk ends by length.
"""

from __future__ import annotations

import os
import time
from typing import Any

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.input_processor import CheckedRequest
from seer_engine.engine.llm_engine import LLMEngine, TokenSource
from seer_engine.engine.stats import EngineStats
from seer_engine.kv_connector.base import KVConnector, LoadResult
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.types import ChunkRequest, InstanceInfo, StepReply

ENGINE_CALLS = frozenset({"sleep", "wake_up", "update_weights", "reset_prefix_cache", "stats"})


class InstanceWorker:
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
        # Logprob entries sent so far of each streaming chunk: a progress output carries
        # only the new ones, which the buffer appends (the whole list at every step made
        # a long stream quadratic in pickling, and on the thread that serves everyone).
        self._logprobs_sent: dict[str, int] = {}

    @property
    def info(self) -> InstanceInfo:
        e = self.engine
        kv = e.kv_manager
        return InstanceInfo(kv.pool.num_blocks, kv.block_size, e.config.max_num_seqs, e.max_model_len,
                            e.vocab_size, os.getpid())  # fmt: skip

    def submit(self, chunk: ChunkRequest) -> None:
        if chunk.load_kv:
            start = time.perf_counter()
            context = chunk.context
            result = self.connector.load(chunk.sequence_id, self.engine, context, chunk.kv_epoch)
            self._loads.append((chunk.request_id, len(context), result))
            self._carried_s += time.perf_counter() - start
        if chunk.save_kv:
            self._save[chunk.request_id] = chunk
        if self.replica is not None:
            self.replica.reopen(chunk.group_id)  # a group id may come back in a later iteration
        checked = CheckedRequest(
            None,
            list(chunk.prompt_token_ids),
            chunk.params,
            chunk.params.max_tokens,
            chunk.prior_output_token_ids,
        )
        self.engine.add_checked(
            chunk.request_id,
            checked,
            group_id=chunk.group_id,
            stream=chunk.stream,
            sequence_id=chunk.sequence_id,
            cuttable=chunk.cuttable,
            high_priority=chunk.high_priority,
        )

    def abort(self, request_ids: list[str]) -> tuple[list[RequestOutput], EngineStats]:
        """The aborted chunks' outputs (a chunk the last step ended answers with its
        final output), and the engine's stats after the abort."""
        for rid in request_ids:
            self._save.pop(rid, None)
            self._logprobs_sent.pop(rid, None)
        outputs = self.engine.abort_request(request_ids)
        aborted = {out.request_id for out in outputs}
        ended = [self._just_finished[r] for r in request_ids if r not in aborted and r in self._just_finished]
        return outputs + ended, self.engine.stats()

    def step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> StepReply:
        if self.replica is not None:
            for gid in finished_groups or ():
                self.replica.finish_group(gid)
            if draft_updates:
                self.replica.apply(draft_updates)
        start = time.perf_counter()
        outputs = self.engine.step()
        self._just_finished = {out.request_id: out for out in outputs if out.finished}
        self._only_new_logprobs(outputs)
        for out in outputs:
            chunk = self._save.pop(out.request_id, None) if out.finished else None
            if chunk is not None and out.outputs[0].finish_reason == "length":
                context = list(chunk.prompt_token_ids) + list(out.outputs[0].token_ids)
                self.connector.save(chunk.sequence_id, self.engine, context, chunk.kv_epoch)
        elapsed = time.perf_counter() - start + self._carried_s
        self._carried_s = 0.0
        loads, self._loads = self._loads, []
        return StepReply(
            outputs=outputs,
            elapsed_s=elapsed,
            stats=self.engine.stats(),
            drafter=self.engine.drafter.stats if self.engine.drafter else None,
            connector=self.connector.stats,
            loads=loads,
            shapes=[self.engine.last_step_shape] if self.engine.last_step_shape is not None else [],
            draft_updates=self.replica.take_updates() if self.replica is not None else [],
            progress=self._progress(),
        )

    def _only_new_logprobs(self, outputs: list[RequestOutput]) -> None:
        """Cut each streaming chunk's progress output to the logprob entries not sent
        before; a chunk's final output keeps them all (the buffer takes it whole)."""
        for out in outputs:
            result = out.outputs[0]
            if out.finished or result.logprobs is None:
                self._logprobs_sent.pop(out.request_id, None)
                continue
            sent = self._logprobs_sent.get(out.request_id, 0)
            self._logprobs_sent[out.request_id] = len(result.logprobs)
            result.logprobs = result.logprobs[sent:]

    def _progress(self) -> dict[str, int]:
        """Output tokens of every request the engine holds (admission rules read them)."""
        sched = self.engine.scheduler
        return {r.request_id: r.num_output_tokens for r in (*sched.running, *sched.waiting)}

    def call(self, method: str, *args: Any) -> Any:
        """Serving primitives on the engine (``ENGINE_CALLS``)."""
        if method not in ENGINE_CALLS:
            raise ValueError(f"instances do not forward {method!r}")
        return getattr(self.engine, method)(*args)


def build_worker(
    config: EngineConfig,
    token_source: TokenSource | None,
    connector: KVConnector,
    replica: Any = None,
    proposer: Any = None,
) -> InstanceWorker:
    """The engine side of an instance, built in the process that runs it. ``replica``:
    this instance's copy of the draft server's trees; ``proposer``: a draft source
    shared with the other instances of this process."""
    engine = LLMEngine(config, proposer=replica or proposer)
    engine.token_source = token_source
    return InstanceWorker(engine, connector, replica)
