"""The dispatcher: the Request Buffer's loop over an instance pool.

Divided policies keep every response in the buffer between chunks: a dispatch asks
for at most ``chunk_tokens`` more tokens and reserves KV for the whole chunk on the
chosen instance, so the engines never preempt. A response whose next chunk runs on
the instance of its previous chunk finds its KV in that instance's prefix cache;
moving to another instance goes through the KV pool, or recomputes without one
(counted as migrated tokens). The baseline pins whole groups to instances at the
start and lets each engine preempt by recompute when KV runs out.

Which instance steps next is the pool's business (in-process instances: the earliest
clock; processes and actors: whichever answers first), so events are handled in
time order either way.
"""

from __future__ import annotations

import argparse
import logging
from collections import deque
from collections.abc import Callable, Container, Sequence

from seer_engine.core.seeds import sample_seed
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.admission import Admission, make_admission
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.metrics import RolloutCounters, RolloutMetrics, RolloutResult, rollout_metrics
from seer_engine.rollout.placement import Placement, SeerPlacement
from seer_engine.rollout.policies import RolloutPolicy
from seer_engine.rollout.pool import InstancePool
from seer_engine.rollout.request_buffer import RequestBuffer
from seer_engine.rollout.types import (
    ChunkRequest,
    Group,
    InstanceDied,
    RolloutSample,
    RolloutStalled,
    StepReply,
)

logger = logging.getLogger(__name__)

BACKFILL_RULES = ("none", "claim", "any")
DEFAULT_ADMISSION = "peak"


def add_dispatch_args(parser: argparse.ArgumentParser, more_admission: str = "") -> None:
    """``--admission`` and ``--backfill``, as every command that runs a Dispatcher takes
    them (``more_admission``: the command's own rules, for its help)."""
    parser.add_argument(
        "--admission", default=None,
        help="reserve | reserve-per-response | peak | peak:TOKENS (chunk cuts)"
        f"{more_admission}; default peak",
    )  # fmt: skip
    parser.add_argument(
        "--backfill", default="none",
        help="none (strict priority) | claim (a blocked sample holds the roomiest instance, "
        "the others backfill) | any",
    )  # fmt: skip


def check_dispatch_rules(admission: str | None, backfill: str, own_rules: Sequence[str] = ()) -> str:
    """The admission rule to use (``None``: the default), after naming a bad rule or a bad
    backfill value, so a command line fails before anything is loaded. ``own_rules``: the
    command's own admission rules (built where it runs them)."""
    rule = admission or DEFAULT_ADMISSION
    if rule not in own_rules:
        make_admission(rule, also_known=own_rules)
    _check_backfill(backfill)
    return rule


def _check_backfill(backfill: str) -> None:
    if backfill not in BACKFILL_RULES:
        raise ValueError(f"backfill must be one of {', '.join(BACKFILL_RULES)}, got {backfill!r}")


class Dispatcher:
    """The Request Buffer over an instance pool, driven one step at a time.

    ``add_samples`` may be called at any time (a server adds requests while the
    rollout runs); ``run`` is the offline form: add every group, step until all are done.
    """

    def __init__(
        self,
        pool: InstancePool,
        policy: RolloutPolicy,
        chunk_tokens: int = 8192,
        on_sample_finished: Callable[[RolloutSample], None] | None = None,
        placement: Placement | None = None,
        on_group_finished: Callable[[Group], None] | None = None,
        log_limit: int | None = None,
        admission: Admission | str = DEFAULT_ADMISSION,
        backfill: str = "none",
    ) -> None:
        """``log_limit``: keep only the most recent dispatches in ``dispatch_log`` (a
        server runs for days; an offline rollout keeps them all). ``admission``: the
        rule that decides a chunk fits an instance (``rollout/admission.py``).
        ``backfill``: when a sample fits no instance, ``none`` stops the dispatch there
        (strict priority: nothing passes a higher-priority sample); ``claim`` lets the
        blocked sample claim the instance with the most free KV and goes on with
        lower-priority samples on the other instances only (they take nothing the blocked
        sample waits for; the dispatch stops once every open instance is claimed);
        ``any`` goes on with lower-priority samples that fit anywhere."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        _check_backfill(backfill)
        self.admission = make_admission(admission) if isinstance(admission, str) else admission
        self.backfill = backfill
        self.pool = pool
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.on_sample_finished = on_sample_finished
        self.on_group_finished = on_group_finished
        self.placement = placement or SeerPlacement()
        self.kv_connector = pool.kv_connector  # this process's handle: frees finished entries
        self.pooled = self.kv_connector.name != "recompute"
        self.kv_epoch = 0  # weight updates so far: the pool serves a chunk only KV of its epoch
        self.buffer = RequestBuffer(lambda s: self._blocks_for(self.pool.instances[0], s), policy)
        self.now = 0.0  # the time of the latest event (the clock of the last reply)
        self.counters = RolloutCounters()
        self.dispatch_log: deque[tuple[str, int]] = deque(maxlen=log_limit)  # (sample key, instance)
        self._live: dict[str, RolloutSample] = {}  # key -> unfinished sample
        self._live_per_group: dict[str, int] = {}
        self._group_instances: dict[str, set[int]] = {}  # group -> instances that ran a sibling
        # Engine pools with a history store learn every finished response (the simulator's don't).
        self._record_finished = getattr(pool, "record_finished", None)

    # -- the offline loop ------------------------------------------------------------

    def start(self, groups: Sequence[Group]) -> dict[str, list[RolloutSample]]:
        """Admit every group's responses (in this order); ``step`` then runs them."""
        for order, group in enumerate(groups):
            group.order = order
        samples = {g.group_id: new_samples(g) for g in groups}
        for group in groups:
            self.add_samples(samples[group.group_id])
        return samples

    def run(self, groups: Sequence[Group]) -> RolloutResult:
        samples = self.start(groups)
        while self.has_work:
            self.step()
        timelines = [list(inst.books.timeline) for inst in self.pool.instances]
        return RolloutResult(list(groups), samples, self.metrics(samples), timelines)

    def metrics(self, samples: dict[str, list[RolloutSample]]) -> RolloutMetrics:
        """What the rollout of ``samples`` measured, as of now."""
        return rollout_metrics(self.policy.name, samples, self.pool, self.counters)

    # -- the online interface -----------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.buffer) or any(inst.books.has_work for inst in self.pool.alive)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def add_samples(self, samples: Sequence[RolloutSample]) -> None:
        """Admit responses: into the buffer (divided policies) or straight onto the
        group's instance (baseline). Their group is registered on first sight."""
        for sample in samples:
            if sample.key in self._live:
                raise ValueError(f"response {sample.key} is already in the rollout")
            gid = sample.group.group_id
            if gid not in self._live_per_group:
                self.policy.context.register(sample.group, sample.max_tokens)
            else:
                self.policy.context.raise_budget(gid, sample.max_tokens)
            self._live_per_group[gid] = self._live_per_group.get(gid, 0) + 1
            self._live[sample.key] = sample
            sample.enqueued_at = self.now
            self._enqueue(sample)

    def _enqueue(self, sample: RolloutSample) -> None:
        if self.policy.pin_groups_up_front:
            self.check_alive()
            alive = self.pool.alive
            self._submit_or_recover(alive[sample.group.order % len(alive)], sample, sample.max_tokens, False)
        else:
            self.buffer.add(sample)

    def step(self) -> list[RolloutSample]:
        """Dispatch what fits, then take the next step reply of an instance.

        Returns the responses that finished in this step, and those that made
        progress when they asked for a stream.
        """
        self._dispatch(self.now)
        try:
            stepped = self.pool.advance()
        except InstanceDied as died:
            self.lose_instance(self.pool.instances[died.index], str(died))
            return []
        if stepped is None:
            if not self.buffer or any(inst.books.has_work for inst in self.pool.alive):
                return []  # nothing to do, or no instance answered yet: come back
            self.check_alive()
            raise RolloutStalled(
                f"{len(self.buffer)} responses cannot be dispatched: a chunk needs more KV "
                "blocks than an instance has (raise the KV budget or lower chunk_tokens)"
            )
        inst, reply = stepped
        self.now = inst.books.clock
        self._count_loads(reply)
        updated = []
        for out in reply.outputs:
            chunk = inst.books.in_flight.get(out.request_id)
            if chunk is None:
                continue  # aborted while this step ran
            sample = chunk.sample
            sample.prompt_logprobs = out.prompt_logprobs or sample.prompt_logprobs  # from its first chunk
            if out.finished:
                self._on_chunk_done(inst, out)
            else:  # streaming progress within a chunk
                result = out.outputs[0]
                sample.output_token_ids = list(result.token_ids)
                sample.text = result.text
                sample.chunk_logprobs.extend(result.logprobs or [])  # the new entries (worker.py)
            if sample.finished or sample.stream:
                updated.append(sample)
        return updated

    def check_alive(self) -> None:
        """Raise ``RolloutStalled`` once every instance is gone: no response can run again."""
        if not self.pool.alive:
            raise RolloutStalled(
                f"every engine instance of the rollout is gone ({self.counters.instance_failures} lost); "
                f"{len(self._live)} responses cannot finish"
            )

    def abort(self, keys: Sequence[str]) -> list[RolloutSample]:
        """Stop responses where they are (buffered or mid-chunk); unknown keys are ignored.

        Aborted responses keep the tokens they generated, with finish_reason "abort".
        """
        aborted = []
        for key in keys:
            sample = self._live.get(key)
            if sample is None:
                continue
            if sample in self.buffer:
                self.buffer.remove(sample)
            else:
                inst = self.pool.instances[sample.instance]
                rid = sample.chunk_request_id()
                try:
                    for out in inst.abort([rid]):
                        self._take_chunk(inst, out)
                except InstanceDied as died:
                    inst.books.release(rid)  # aborted, not lost: it must not go back to the buffer
                    self.lose_instance(inst, str(died))
                inst.books.release(rid)  # it ended before the abort reached it
            self._finish(sample, "abort", None, record=False)
            aborted.append(sample)
        return aborted

    # -- Request Buffer --------------------------------------------------------------

    def _chunk_limit(self, sample: RolloutSample) -> int:
        """Total output tokens the sample may have at the end of its next dispatch."""
        if not self.policy.chunked:
            return sample.max_tokens
        return sample.num_generated + min(self.chunk_tokens, sample.max_tokens - sample.num_generated)

    def _blocks_for(self, inst: InstanceHandle, sample: RolloutSample) -> int:
        return inst.info.blocks_needed(len(sample.group.prompt_token_ids) + self._chunk_limit(sample))

    def _dispatch(self, now: float) -> None:
        """Send buffered samples, in policy order, to instances where the admission
        rule fits their chunk."""
        if not self.buffer or not self._open_instances():
            return
        ranked = self.buffer.ranked(now)
        try:
            failed: dict[int, int] = {}  # instance -> the smallest need it turned down in this dispatch
            claimed: set[int] = set()  # instances held for a blocked higher-priority sample
            for sample in ranked:
                inst = self._place(sample, failed, claimed)
                if inst is None:
                    if self.backfill == "none" or self._nothing_fits(failed) or not self._claim(claimed):
                        return
                    continue
                self.buffer.remove(sample)  # a lost instance puts its samples back
                self._submit_or_recover(inst, sample, self._chunk_limit(sample), reserve=True)
                if not self._open_instances():
                    return
        finally:
            ranked.close()

    def _open_instances(self) -> list[InstanceHandle]:
        return [inst for inst in self.pool.alive if inst.books.has_free_seq]

    def _claim(self, claimed: set[int]) -> bool:
        """Under ``claim``, hold the unclaimed open instance with the most free KV for the
        sample that just fit nowhere; whether any open instance is left to backfill."""
        if self.backfill != "claim":
            return True
        free = [inst for inst in self._open_instances() if inst.index not in claimed]
        if free:
            claimed.add(max(free, key=lambda inst: inst.books.free_blocks).index)
        return len(free) > 1

    def _nothing_fits(self, failed: dict[int, int]) -> bool:
        """Every open instance has turned down a chunk no larger than the buffer's smallest."""
        smallest = self.buffer.smallest_need
        return all(failed.get(inst.index, smallest + 1) <= smallest for inst in self._open_instances())

    def _place(
        self,
        sample: RolloutSample,
        failed: dict[int, int] | None = None,
        claimed: Container[int] = frozenset(),
    ) -> InstanceHandle | None:
        """An instance the sample's chunk fits, chosen by the placement policy. An
        in-process instance busy in the past of this event is skipped, and so are
        ``claimed`` ones. ``failed``: per instance, the smallest need that did not fit it
        in this dispatch (a larger one is not tried there again)."""
        alive = self.pool.alive
        need = self.buffer.need(sample) if sample in self.buffer else 0
        limit = self._chunk_limit(sample)
        fits = []
        for inst in alive:
            if inst.index in claimed:
                continue
            if not inst.books.has_free_seq or not self.pool.accepts_at(inst, sample.enqueued_at):
                continue
            if failed is not None and need >= failed.get(inst.index, need + 1):
                continue
            if self.admission.fits(inst.books, sample, sample.num_generated, limit):
                fits.append(inst)
            elif failed is not None:
                failed[inst.index] = need
        if not fits:
            return None
        loads = [len(inst.books.in_flight) for inst in alive]
        return self.placement.choose(fits, lambda inst: self._prefix_tokens(inst, sample), loads)

    def _prefix_tokens(self, inst: InstanceHandle, sample: RolloutSample) -> int:
        """How much of the sample's context ``inst`` holds in its prefix cache: all of it
        where its last chunk ran, the prompt where a sibling ran (eviction aside)."""
        if inst.index == sample.instance:
            return len(sample.group.prompt_token_ids) + sample.num_generated
        if inst.index in self._group_instances.get(sample.group.group_id, ()):
            return len(sample.group.prompt_token_ids)
        return 0

    def _submit_or_recover(
        self, inst: InstanceHandle, sample: RolloutSample, limit: int, reserve: bool
    ) -> None:
        try:
            self._submit(inst, sample, limit, reserve)
        except InstanceDied as died:
            self.lose_instance(inst, str(died))

    def _submit(self, inst: InstanceHandle, sample: RolloutSample, limit: int, reserve: bool) -> None:
        self.pool.wait_until(inst, max(sample.enqueued_at, self.now))
        g = sample.group
        context = len(g.prompt_token_ids) + sample.num_generated
        load = False
        if sample.num_generated and sample.instance != inst.index:  # it moves
            self.counters.migrations += 1
            missing = context - self._prefix_tokens(inst, sample)
            load = self.pooled and self.placement.should_pull(missing)
            if not load:
                self.counters.migrated_tokens += missing
        params = sample.chunk_params(limit)
        sample.chunks += 1
        sample.chunk_start = sample.num_generated
        rid = sample.chunk_request_id()
        inst.books.reserve(
            rid, sample, self._blocks_for(inst, sample) if reserve else 0, sample.num_generated, limit,
            self.admission.prompt_blocks(inst.books, sample) if reserve else 0,
        )  # fmt: skip
        sample.instance = inst.index
        self._group_instances.setdefault(g.group_id, set()).add(inst.index)
        self.dispatch_log.append((sample.key, inst.index))
        inst.submit(
            ChunkRequest(
                rid,
                g.prompt_token_ids,
                params,
                g.group_id,
                sample.key,
                sample.output_token_ids,  # replaced, never changed, when the chunk ends
                stream=sample.stream,
                load_kv=load,
                save_kv=self.pooled and limit < sample.max_tokens,
                cuttable=reserve and self.admission.may_overflow,
                high_priority=self.policy.high_priority(sample),
                kv_epoch=self.kv_epoch,
            )
        )

    def _count_loads(self, reply: StepReply) -> None:
        """Pool loads the instance made when it admitted migrated chunks: what the pool
        did not cover was recomputed."""
        for _rid, context, result in reply.loads:
            self.counters.pool_loads += result.loaded_tokens > 0
            self.counters.pool_loaded_tokens += result.loaded_tokens
            self.counters.migrated_tokens += max(0, context - result.tokens)

    def lose_instance(self, inst: InstanceHandle, why: str) -> None:
        """An instance is gone: its running chunks return to the buffer from their last
        chunk boundary (the pool still holds that KV), to finish on another instance."""
        inst.alive = False
        inst.close()
        lost = inst.books.lose()
        logger.warning("%s; its %d running responses go back to the buffer", why, len(lost))
        self.counters.instance_failures += 1
        for instances in self._group_instances.values():
            instances.discard(inst.index)
        for chunk in lost:
            sample = chunk.sample
            if sample.key not in self._live:
                continue
            sample.output_token_ids = sample.output_token_ids[: sample.chunk_start]  # drop the lost progress
            sample.chunk_logprobs = []
            sample.instance = None
            sample.enqueued_at = self.now
            self._enqueue(sample)

    def _take_chunk(self, inst: InstanceHandle, out: RequestOutput) -> RolloutSample:
        """Record a chunk's final output on its sample and release its reservation."""
        sample = inst.books.release(out.request_id).sample
        result = out.outputs[0]
        sample.output_token_ids = result.token_ids  # the instance's own copy
        sample.text = result.text
        sample.logprobs.extend(result.logprobs or [])
        sample.chunk_logprobs = []
        sample.cumulative_logprob += result.cumulative_logprob or 0.0
        sample.instance = inst.index
        return sample

    def _on_chunk_done(self, inst: InstanceHandle, out: RequestOutput) -> None:
        """A chunk ended: the response goes back to the buffer or is finished."""
        sample = self._take_chunk(inst, out)
        result = out.outputs[0]
        at_context_limit = (
            len(sample.group.prompt_token_ids) + sample.num_generated >= inst.info.max_model_len
        )
        chunk_end = (
            result.finish_reason == "length"
            and sample.num_generated < sample.max_tokens
            and not at_context_limit
        )
        if chunk_end:  # the instance saved its KV to the pool, if there is one
            self.policy.context.on_chunk_end(sample)
            sample.enqueued_at = self.now
            self.buffer.add(sample)
            return
        self._finish(sample, result.finish_reason, result.stop_reason, record=True)

    def _finish(self, sample: RolloutSample, reason: str | None, stop_reason, record: bool) -> None:
        """``record``: the length is real (not cut by an abort), so the Context Manager learns it."""
        if self.pooled:
            self.kv_connector.free(sample.key)
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.finished_at = self.now
        del self._live[sample.key]
        group = sample.group
        if record:
            self.policy.context.on_finished(sample)
            if self._record_finished is not None:
                self._record_finished(sample)
        self._live_per_group[group.group_id] -= 1
        if self._live_per_group[group.group_id] == 0:
            self._group_done(group)
        if self.on_sample_finished is not None:
            self.on_sample_finished(sample)

    def _group_done(self, group: Group) -> None:
        """The group's last live response finished: forget it (a later request with the
        same prompt starts a new group) and free its drafts."""
        del self._live_per_group[group.group_id]
        ran_on = self._group_instances.pop(group.group_id, set())
        self.policy.context.forget(group.group_id)
        self.pool.finish_group(group.group_id, ran_on)
        if self.on_group_finished is not None:
            self.on_group_finished(group)


def new_samples(group: Group) -> list[RolloutSample]:
    """The group's n responses with per-response seeds (independent of policy and chunking)."""
    seed, order = group.sampling_params.seed, group.order
    return [RolloutSample(group, i, sample_seed(seed, order, i), group.max_tokens) for i in range(group.n)]


def make_groups(checked: Sequence, n: int) -> list[Group]:
    """Groups ``g0, g1, ...`` of ``n`` responses from requests that passed the input
    processor (``CheckedRequest``)."""
    return [
        Group(f"g{i}", c.prompt_token_ids, c.params, n, c.max_tokens, prompt=c.prompt, order=i)
        for i, c in enumerate(checked)
    ]
