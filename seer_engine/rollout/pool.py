"""The N engine instances of one rollout, the KV pool they share, and their drafts.

Backends (``--distributed-backend``):

- ``inproc``: instances in this process step one at a time, in time order (the earliest
  step start or step end first); each clock advances by its own measured step time, so
  the makespan, idle time and tail are those of N instances side by side on one machine.
- ``mp``: an instance per process (the default for ``--instances N``); they compute in
  parallel and the clock is the wall clock.
- ``ray``: an instance per Ray actor, placed by Ray across nodes.

With speculative decoding, in-process instances share one proposer; instances in
processes or actors keep replicas of the group suffix trees that a ``DraftServer``
here keeps in sync (Seer's distributed grouped draft server): each step sends an
instance the siblings' new tokens of the groups it runs and brings back its own.

With a history store (a ``+history`` policy, or a server's ``--history``), a group's
tree is seeded with earlier iterations' responses to its prompt before the group's
first step anywhere: the shared proposer directly, replicas through the draft server.

``InstancePool`` is what the dispatcher drives; ``EnginePool`` (real engines) and the
simulator's pool both implement it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Protocol

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.engine.llm_engine import TokenSource, resolve_model_path
from seer_engine.kv_connector.base import KVConnector, SharedHandle
from seer_engine.kv_connector.factory import KVPool
from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.instances.local import LocalInstance
from seer_engine.rollout.instances.worker import build_worker
from seer_engine.rollout.policies import RolloutPolicy
from seer_engine.rollout.types import RolloutSample, StepReply
from seer_engine.spec_decode.draft_server import DraftServer
from seer_engine.spec_decode.proposers import Proposer, make_proposer

BACKENDS = ("inproc", "mp", "ray")
REPLY_WAIT_S = 1.0  # how long ``advance`` waits for a step reply before handing back control


class InstancePool(Protocol):
    """What the dispatcher needs of the instances it places chunks on."""

    backend: str
    instances: list[InstanceHandle]
    kv_connector: KVConnector  # this process's handle on the KV pool (frees finished entries)

    @property
    def alive(self) -> list[InstanceHandle]: ...

    @property
    def max_model_len(self) -> int: ...

    def advance(self) -> tuple[InstanceHandle, StepReply] | None:
        """The next step reply of a busy instance (None when none has work, or none
        answered within a short wait: the caller handles what arrived meanwhile and asks
        again); raises ``InstanceDied`` for a lost one."""
        ...

    def accepts_at(self, inst: InstanceHandle, t: float) -> bool:
        """May a chunk that entered the buffer at ``t`` start on ``inst`` now?"""
        ...

    def wait_until(self, inst: InstanceHandle, t: float) -> None:
        """``inst`` is about to get a chunk that arrived at ``t``."""
        ...

    def finish_group(self, group_id: str, ran_on: Collection[int] | None = None) -> None:
        """``ran_on``: the instances that ran a chunk of the group (None: any)."""
        ...

    def close(self) -> None: ...


class StepTimer(Protocol):
    """Prices a step by its shape (the simulator's ``StepTimeModel``)."""

    kv_per_query: bool

    def step_s(self, scheduled_tokens: float, kv_tokens_read: float, logit_tokens: float = 0.0) -> float: ...


class ClockProfile(Protocol):
    """What a modeled clock runs on: step times and pool transfers (the simulator's
    ``InstanceProfile``)."""

    step: StepTimer

    def pool_load_s(self, tokens: int) -> float: ...


class SimulatedClock:
    """Instances step one at a time, and each clock advances by its own step's duration:
    measured, or, with a ``timer``, what the timer says the step's shape costs (a CPU
    then shows what the policies do on a GPU). Events go in modeled-time order, as in
    the simulator: the next is the earliest of a step start (a busy instance's clock)
    and a computed step's end, whose reply is held until then, so no step's outcome
    reaches the Request Buffer before an earlier event of another instance. An
    instance must not run work in its own past, and an idle one waits for the work it
    gets; a chunk sent to an instance in mid-step joins its next step.

    On a modeled clock the KV pool is modeled too, as the simulator models it: the
    instance that loads a response's KV pays ``pool_load_s(tokens)`` (none without it),
    saves run in the background, and the pool time reported is that modeled time, not
    the CPU's."""

    def __init__(
        self, timer: StepTimer | None = None, pool_load_s: Callable[[int], float] | None = None
    ) -> None:
        self.timer = timer
        self.pool_load_s = pool_load_s
        self._pool_s: dict[int, float] = {}  # instance index -> modeled pool time so far
        self._held: dict[int, tuple[StepReply, float]] = {}  # instance -> a computed step's reply, its end

    def next_event(self, inst: InstanceHandle) -> tuple[float, int, int]:
        """When ``inst``'s next event is (a held step's end before a start at the same
        time, so the start sees what the end dispatched), then its index."""
        held = self._held.get(inst.index)
        return (held[1], 0, inst.index) if held is not None else (inst.books.clock, 1, inst.index)

    def holds(self, inst: InstanceHandle) -> bool:
        return inst.index in self._held

    def hold(self, inst: InstanceHandle, reply: StepReply) -> None:
        self._held[inst.index] = (reply, self.after(inst, reply))

    def take(self, inst: InstanceHandle) -> tuple[StepReply, float] | None:
        return self._held.pop(inst.index, None)

    def after(self, inst: InstanceHandle, reply: StepReply) -> float:
        if self.timer is not None:
            t = self.timer
            reply.elapsed_s = sum(
                t.step_s(s.scheduled_tokens, s.kv_pairs if t.kv_per_query else s.kv_tokens, s.logit_tokens)
                for s in reply.shapes
            )
            price = self.pool_load_s or (lambda tokens: 0.0)
            pulled = sum(price(r.loaded_tokens) for _, _, r in reply.loads if r.loaded_tokens)
            reply.elapsed_s += pulled
            pool_s = self._pool_s[inst.index] = self._pool_s.get(inst.index, 0.0) + pulled
            reply.connector = dataclasses.replace(reply.connector, save_s=0.0, load_s=pool_s)
        return inst.books.clock + reply.elapsed_s

    def accepts_at(self, inst: InstanceHandle, t: float) -> bool:
        return self.holds(inst) or not (inst.books.has_work and inst.books.clock < t)

    def wait_until(self, inst: InstanceHandle, t: float) -> None:
        if not inst.books.has_work:
            inst.books.clock = max(inst.books.clock, t)

    def reset(self) -> None:
        self._pool_s.clear()
        self._held.clear()


class WallClock:
    """Instances that run for real side by side: all busy ones step at once and the
    clock is the wall clock since the pool started."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def after(self, inst: InstanceHandle, reply: StepReply) -> float:
        return time.perf_counter() - self._t0

    def accepts_at(self, inst: InstanceHandle, t: float) -> bool:
        return True

    def wait_until(self, inst: InstanceHandle, t: float) -> None:
        pass

    def reset(self) -> None:
        self._t0 = time.perf_counter()


@dataclass
class SeedStats:
    """History seeds given to draft trees."""

    groups: int = 0
    responses: int = 0
    tokens: int = 0


class EnginePool:
    def __init__(
        self,
        config: EngineConfig,
        instances: list[InstanceHandle],
        kv_pool: KVPool,
        clock: SimulatedClock | WallClock,
        backend: str,
        draft_server: DraftServer | None = None,
        proposer: Proposer | None = None,
        timeline_points: int | None = None,
        history: HistoryStore | None = None,
        record_lengths: bool = True,
    ) -> None:
        """Use ``EnginePool.start`` to build one; this only puts the parts together.
        ``history``: filled from finished responses (``record_finished``; lengths too
        unless ``record_lengths`` is off, when the policy's Context Manager records
        them) and seeding each group's draft tree (grouped speculative decoding only)."""
        self.config = config  # the instances' own (with the policy's speculative decoding)
        self.instances = instances
        self.kv_pool = kv_pool
        # In-process instances share this process's handle: each one, and the dispatcher,
        # counts its own calls on it.
        self.kv_connector = SharedHandle(kv_pool.connector) if backend == "inproc" else kv_pool.connector
        self.clock = clock
        self.backend = backend
        self.draft_server = draft_server
        self.proposer = proposer  # the draft source in-process instances share
        spec = config.speculative_config
        seeds = spec is not None and spec.method == "group_suffix" and spec.history_sequences > 0
        self.history = history
        self.record_lengths = record_lengths
        self.history_sequences = spec.history_sequences if seeds and history is not None else 0
        self.seed_stats = SeedStats()
        self._seeded: set[str] = set()  # live groups whose trees were seeded (or had nothing to seed)
        self._finished_groups: dict[int, list[str]] = {i.index: [] for i in instances}
        for inst in instances:
            inst.books = InstanceBooks(inst.info, timeline_points)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        num_instances: int,
        token_source: TokenSource | None = None,
        backend: str = "inproc",
        kv_pool: KVPool | None = None,
        policy: RolloutPolicy | None = None,
        timeline_points: int | None = None,
        step_timer: StepTimer | None = None,
        history: HistoryStore | None = None,
        reply_timeout_s: float | None = None,
        load_timeout_s: float | None = None,
        pool_load_s: Callable[[int], float] | None = None,
    ) -> EnginePool:
        """Start ``num_instances`` engines on ``backend``, with the speculative decoding
        ``policy`` asks for (``seer``: grouped suffix trees) unless the config names one,
        and ``history`` (default: the policy's store, if any) kept up to date and
        seeding the draft trees.
        ``step_timer``: run the instances on a modeled clock (one step at a time, in
        modeled-time order, whatever the backend), with pool loads priced by
        ``pool_load_s`` (seconds for a number of tokens). ``reply_timeout_s``: an instance in a
        process or actor that answers no step in this long (no weight update or wake-up in
        ``load_timeout_s``) is killed and lost (None: wait forever). On failure everything
        started is stopped again."""
        if num_instances < 1:
            raise ValueError(f"--instances must be >= 1, got {num_instances}")
        if backend not in BACKENDS:
            raise ValueError(f"--distributed-backend must be one of {list(BACKENDS)}, got {backend!r}")
        if policy is not None and policy.speculative is not None and config.speculative_config is None:
            config = dataclasses.replace(config, speculative_config=policy.speculative)
        kv_pool = kv_pool or KVPool.recompute()
        instances: list[InstanceHandle] = []
        draft_server = proposer = None
        try:
            if backend == "inproc":
                spec = config.speculative_config
                proposer = make_proposer(spec) if spec is not None else None
                for i in range(num_instances):
                    handle = SharedHandle(kv_pool.connector)
                    worker = build_worker(config, token_source, handle, proposer=proposer)
                    instances.append(LocalInstance(i, worker))
                clock: SimulatedClock | WallClock = SimulatedClock(step_timer, pool_load_s)
            else:
                draft_server = _start_remote(config, num_instances, token_source, backend, kv_pool, instances)
                clock = WallClock() if step_timer is None else SimulatedClock(step_timer, pool_load_s)
        except BaseException:
            for inst in instances:
                inst.close()
            kv_pool.close()
            raise
        for inst in instances:
            inst.reply_timeout_s = reply_timeout_s
            inst.load_timeout_s = load_timeout_s
        own = getattr(policy.context, "history", None) if policy is not None else None
        history = history if history is not None else own
        return cls(
            config, instances, kv_pool, clock, backend, draft_server, proposer, timeline_points, history,
            record_lengths=history is not own,
        )  # fmt: skip

    # -- stepping ------------------------------------------------------------------------

    def advance(self) -> tuple[InstanceHandle, StepReply] | None:
        if isinstance(self.clock, SimulatedClock):
            return self._advance_in_time_order(self.clock)
        busy = [inst for inst in self.instances if inst.alive and inst.books.has_work]
        if not busy:
            return None
        for inst in busy:
            if not inst.stepping:
                self._start_step(inst)
        for waited in (False, True):
            # Bounded, so a hung instance (found out by its reply timeout) does not keep
            # the server from dispatching to the others and answering its callers meanwhile.
            if waited:
                type(busy[0]).wait_any(busy, timeout=REPLY_WAIT_S)
            for inst in busy:
                reply = inst.poll_reply()
                if reply is not None:
                    self._publish(inst, reply.draft_updates)
                    return self._hand_out(inst, reply, self.clock.after(inst, reply))
        return None

    def _advance_in_time_order(self, clock: SimulatedClock) -> tuple[InstanceHandle, StepReply] | None:
        """Run the earliest event: start (and compute) a step, or hand out a held reply."""
        while True:
            busy = [i for i in self.instances if i.alive and (i.books.has_work or clock.holds(i))]
            if not busy:
                return None
            inst = min(busy, key=clock.next_event)
            held = clock.take(inst)
            if held is not None:
                return self._hand_out(inst, *held)
            if not inst.stepping:
                self._start_step(inst)
            reply = inst.poll_reply()
            if reply is None:
                type(inst).wait_any([inst], timeout=REPLY_WAIT_S)
                reply = inst.poll_reply()
                if reply is None:
                    return None
            # Drafts go out as the step is computed, as an in-process shared tree takes
            # them, so both backends draft alike.
            self._publish(inst, reply.draft_updates)
            clock.hold(inst, reply)

    def _start_step(self, inst: InstanceHandle) -> None:
        if self.history_sequences:
            self._seed_new_groups(inst)
        inst.start_step(*self._draft_traffic(inst))

    def _hand_out(
        self, inst: InstanceHandle, reply: StepReply, end: float
    ) -> tuple[InstanceHandle, StepReply]:
        inst.books.record(reply, end)
        return inst, reply

    def _publish(self, inst: InstanceHandle, records: list) -> None:
        """A step's draft records, less those of groups with no chunk in flight: a reply
        read after an abort finished its group (the server dropped the group's log then)
        would make a log that nothing drops. A live group's records always have their
        own chunk still in flight (the reply's outputs are taken after this); an aborted
        response's records go only while a sibling's chunk runs somewhere."""
        if not records or self.draft_server is None:
            return
        running = [other.books.group_chunks for other in self.instances]
        kept = [r for r in records if any(r.group_id in chunks for chunks in running)]
        self.draft_server.publish(inst.index, kept)

    def _seed_new_groups(self, inst: InstanceHandle) -> None:
        """Seed the draft trees of groups about to take their first step (anywhere)."""
        for chunk in inst.books.in_flight.values():
            group = chunk.sample.group
            gid = group.group_id
            if gid in self._seeded:
                continue
            self._seeded.add(gid)
            responses = self.history.sequences(group.prompt_token_ids)[-self.history_sequences :]
            if not responses:
                continue
            self.seed_stats.groups += 1
            self.seed_stats.responses += len(responses)
            if self.proposer is not None:
                self.seed_stats.tokens += self.proposer.seed_group(gid, group.prompt_token_ids, responses)
            elif self.draft_server is not None:
                self.draft_server.seed(gid, group.prompt_token_ids, responses)
                self.seed_stats.tokens += sum(len(r) for r in responses)

    def _draft_traffic(self, inst: InstanceHandle) -> tuple[list | None, list[str] | None]:
        """The draft-server messages riding on an instance's next step."""
        finished = self._finished_groups.get(inst.index) or None
        self._finished_groups[inst.index] = []
        if self.draft_server is None:
            return None, finished
        return self.draft_server.updates_for(inst.index, inst.books.group_ids()), finished

    def accepts_at(self, inst: InstanceHandle, t: float) -> bool:
        return self.clock.accepts_at(inst, t)

    def wait_until(self, inst: InstanceHandle, t: float) -> None:
        self.clock.wait_until(inst, t)

    def record_finished(self, sample: RolloutSample) -> None:
        """A response finished for real (not aborted): the history store learns it."""
        if self.history is None:
            return
        prompt, tokens = sample.group.prompt_token_ids, sample.output_token_ids
        if self.record_lengths:
            self.history.record(prompt, sample.num_generated, tokens)
        else:
            self.history.add_sequence(prompt, tokens)

    def finish_group(self, group_id: str, ran_on: Collection[int] | None = None) -> None:
        """Every response of the group is done: free its drafts. ``ran_on``: the instances
        that ran a chunk of it (None: every one); only their replicas hold its tree, and an
        instance that takes no step would collect the ids of the groups run elsewhere."""
        self._seeded.discard(group_id)
        if self.proposer is not None:
            self.proposer.finish_group(group_id)
        if self.draft_server is not None:
            self.draft_server.finish_group(group_id)
            for inst in self.alive:  # a lost instance steps no more: it would hoard them
                if ran_on is None or inst.index in ran_on:
                    self._finished_groups[inst.index].append(group_id)

    # -- the instances -------------------------------------------------------------------

    def __iter__(self) -> Iterator[InstanceHandle]:
        return iter(self.instances)

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def alive(self) -> list[InstanceHandle]:
        return [inst for inst in self.instances if inst.alive]

    @property
    def max_model_len(self) -> int:
        return self.instances[0].info.max_model_len

    def make_input_processor(self) -> InputProcessor:
        """Request checks and a tokenizer of this process's own (the engines may be
        elsewhere): a request must fit one instance."""
        first = self.instances[0].info
        path = self.config.tokenizer or resolve_model_path(self.config.model, self.config.dtype)
        return InputProcessor(
            Detokenizer.from_pretrained(path), first.vocab_size, first.max_model_len, first.num_blocks,
            first.block_size,
        )  # fmt: skip

    def reset_clocks(self) -> None:
        self.clock.reset()
        for inst in self.instances:
            inst.books.reset_clock()

    def close(self) -> None:
        """Stop instance processes and release the KV pool (idempotent)."""
        for inst in self.instances:
            inst.close()
        self.kv_pool.close()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_remote(
    config: EngineConfig,
    n: int,
    token_source: TokenSource | None,
    backend: str,
    kv_pool: KVPool,
    out: list[InstanceHandle],
) -> DraftServer | None:
    """Start ``n`` instance processes or Ray actors into ``out``; returns the draft
    server that keeps their suffix trees in sync (None without grouped drafts)."""
    from seer_engine.spec_decode.draft_server import ReplicaSpec

    replica = ReplicaSpec.of(config.speculative_config)
    if backend == "mp":
        from seer_engine.rollout.instances.process import ProcessInstance as Remote
        from seer_engine.rollout.instances.process import worker_threads as threads
    else:
        from seer_engine.rollout.instances.ray import RayInstance as Remote
        from seer_engine.rollout.instances.ray import actor_threads as threads
    config = dataclasses.replace(config, num_threads=config.num_threads or threads(n))
    for i in range(n):
        out.append(Remote(i, config, token_source, kv_pool.spec, replica))
    for inst in out:
        inst.wait_ready()
    return DraftServer() if replica is not None else None
