"""The N engine instances of one rollout, the KV pool they share, and their drafts.

Backends (``--distributed-backend``):

- ``inproc``: instances in this process step one at a time, the one with the earliest
  clock first; each clock advances by its own measured step time, so the makespan,
  idle time and tail are those of N instances side by side on one machine.
- ``mp``: an instance per process (the default for ``--instances N``); they compute in
  parallel and the clock is the wall clock.
- ``ray``: an instance per Ray actor, placed by Ray across nodes.

With speculative decoding, in-process instances share one proposer; instances in
processes or actors keep replicas of the group suffix trees that a ``DraftServer``
here keeps in sync (Seer's distributed grouped draft server): each step sends an
instance the siblings' new tokens of the groups it runs and brings back its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

from seer_engine.core.policies import RolloutPolicy
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.llm_engine import LLMEngine, TokenSource, resolve_model_path
from seer_engine.engine.request_checker import RequestChecker
from seer_engine.kv_connector.factory import KVPool
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.rollout.instance import EngineInstance, InstanceWorker, LocalInstance, StepReply
from seer_engine.spec_decode.proposers import Proposer, make_proposer

BACKENDS = ("inproc", "mp", "ray")


def group_of(request_id: str) -> str:
    """Group id of a chunk's request id ``<group>/<sample>#<chunk>``."""
    return request_id.rsplit("#", 1)[0].rsplit("/", 1)[0]


class EnginePool:
    def __init__(
        self,
        config: EngineConfig,
        num_instances: int,
        token_source: TokenSource | None = None,
        backend: str = "inproc",
        kv_pool: KVPool | None = None,
    ) -> None:
        if num_instances < 1:
            raise ValueError(f"--instances must be >= 1, got {num_instances}")
        if backend not in BACKENDS:
            raise ValueError(f"--distributed-backend must be one of {list(BACKENDS)}, got {backend!r}")
        self.config = config
        self.backend = backend
        self.kv_pool = kv_pool or KVPool.recompute()
        self.proposer: Proposer | None = None
        self.draft_server = None
        self._finished_groups: dict[int, list[str]] = {}  # instance -> groups to drop drafts of
        spec = config.speculative_config
        self.instances: list = []
        try:
            if backend == "inproc":
                self.proposer = make_proposer(spec) if spec is not None else None
                for i in range(num_instances):
                    engine = LLMEngine(config, proposer=self.proposer)
                    engine.token_source = token_source
                    self.instances.append(LocalInstance(i, InstanceWorker(engine, self.kv_pool.connector)))
            else:
                self._start_remote(config, num_instances, token_source, backend)
        except BaseException:
            self.close()
            raise
        self.front = self._make_front(config)
        self._t0 = time.perf_counter()

    def _make_front(self, config: EngineConfig) -> RequestChecker:
        """Request checks and the tokenizer in this process (the engines may be elsewhere)."""
        first = self.instances[0]
        if isinstance(first, LocalInstance):
            self.eos_token_ids = first.engine.eos_token_ids
            return first.engine.checker
        path = resolve_model_path(config.model)
        model_config = ModelConfig.from_pretrained(path)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        info = first.info
        detokenizer = Detokenizer.from_pretrained(config.tokenizer or path)
        return RequestChecker(
            detokenizer, model_config.vocab_size, info.max_model_len, info.num_blocks, info.block_size
        )

    def _start_remote(self, config: EngineConfig, n: int, token_source, backend: str) -> None:
        from seer_engine.rollout.process_instance import worker_threads
        from seer_engine.spec_decode.draft_server import DraftServer, ReplicaSpec

        replica = ReplicaSpec.of(config.speculative_config)
        if replica is not None:
            self.draft_server = DraftServer()
        if backend == "mp":
            from seer_engine.rollout.process_instance import ProcessInstance as Remote

            config = dataclasses.replace(config, num_threads=config.num_threads or worker_threads(n))
        else:
            from seer_engine.rollout.ray_instance import RayInstance as Remote
            from seer_engine.rollout.ray_instance import actor_threads

            config = dataclasses.replace(config, num_threads=config.num_threads or actor_threads(n))
        for i in range(n):
            self.instances.append(Remote(i, config, token_source, self.kv_pool.spec, replica))
        for inst in self.instances:
            inst.wait_ready()
            self._finished_groups[inst.index] = []

    @classmethod
    def for_policy(
        cls,
        config: EngineConfig,
        policy: RolloutPolicy,
        num_instances: int,
        token_source: TokenSource | None = None,
        backend: str = "inproc",
        kv_pool: KVPool | None = None,
    ) -> EnginePool:
        """A pool with the speculative decoding the policy asks for (``seer``: grouped
        suffix trees), unless the config already names one."""
        if policy.speculative is not None and config.speculative_config is None:
            config = dataclasses.replace(config, speculative_config=policy.speculative)
        return cls(config, num_instances, token_source, backend, kv_pool)

    # -- stepping ------------------------------------------------------------------------

    @property
    def simulated(self) -> bool:
        """Instances step in turn on simulated clocks (in this process)."""
        return self.backend == "inproc"

    def advance(self) -> tuple[EngineInstance, StepReply] | None:
        """The next step reply of a busy instance: the earliest clock's (in-process), or
        whichever instance answers first (processes and actors, all stepping at once).
        None when no instance has work. Raises ``InstanceDied`` for a lost instance."""
        busy = [inst for inst in self.instances if inst.alive and inst.has_work]
        if not busy:
            return None
        if self.simulated:
            inst = min(busy, key=lambda i: i.clock)
            return inst, inst.step()
        for inst in busy:
            if not inst.stepping:
                inst.start_step(*self._draft_traffic(inst))
        while True:
            for inst in busy:
                reply = inst.poll_reply()
                if reply is not None:
                    inst.record(reply, self.now())
                    if self.draft_server is not None:
                        self.draft_server.publish(inst.index, reply.draft_updates)
                    return inst, reply
            type(busy[0]).wait_any([i for i in busy if i.stepping], timeout=1.0)

    def _draft_traffic(self, inst) -> tuple[list | None, list[str] | None]:
        """The draft-server messages riding on an instance's next step."""
        finished = self._finished_groups.get(inst.index) or None
        self._finished_groups[inst.index] = []
        if self.draft_server is None:
            return None, finished
        groups = sorted({group_of(rid) for rid in inst.in_flight})
        return self.draft_server.updates_for(inst.index, groups), finished

    def now(self) -> float:
        """Wall seconds since the pool started (the clock of instances that run for real)."""
        return time.perf_counter() - self._t0

    def finish_group(self, group_id: str) -> None:
        """Every response of the group is done: free its drafts on the draft server."""
        if self.proposer is not None:
            self.proposer.finish_group(group_id)
        if self.draft_server is not None:
            self.draft_server.finish_group(group_id)
            for pending in self._finished_groups.values():
                pending.append(group_id)

    # -- the instances -------------------------------------------------------------------

    def __iter__(self) -> Iterator:
        return iter(self.instances)

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def alive(self) -> list:
        return [inst for inst in self.instances if inst.alive]

    @property
    def first(self) -> LLMEngine:
        """An engine of this process (in-process pools only; others have ``front``)."""
        inst = self.instances[0]
        if not isinstance(inst, LocalInstance):
            raise RuntimeError("instances run in other processes; use pool.front")
        return inst.engine

    @property
    def max_model_len(self) -> int:
        return self.front.max_model_len

    def call_all(self, method: str, *args) -> list:
        """A serving primitive on every live instance."""
        return [inst.call(method, *args) for inst in self.alive]

    def reset_clocks(self) -> None:
        self._t0 = time.perf_counter()
        for inst in self.instances:
            inst.clock = inst.busy_s = 0.0
            inst.timeline.clear()

    def close(self) -> None:
        """Stop instance processes and release the KV pool (idempotent)."""
        for inst in self.instances:
            inst.close()
        self.kv_pool.close()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
