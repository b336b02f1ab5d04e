"""The Request Buffer and the rollout loop over an engine pool.

Divided policies keep every response in the buffer between chunks: a dispatch asks
for at most ``chunk_tokens`` more tokens and reserves KV for the whole chunk on the
chosen instance, so the engines never preempt. A response whose next chunk runs on
the instance of its previous chunk finds its KV in that instance's prefix cache;
moving to another instance goes through the KV connector; without a pool
(``RecomputeConnector``) it recomputes, counted as migrated tokens. The baseline
pins whole groups to instances at the start and lets each engine preempt by
recompute when KV runs out.

Instances step one at a time, the one with the earliest clock first, so events are
handled in time order and the clocks give the makespan of instances running side by
side.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from seer_engine.core.policies import RolloutPolicy
from seer_engine.core.request import Group, RolloutSample
from seer_engine.core.seeds import sample_seed
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.engine_pool import EnginePool
from seer_engine.rollout.instance import ChunkRequest, EngineInstance, InstanceDied, StepReply
from seer_engine.rollout.placement import Placement, SeerPlacement
from seer_engine.rollout.request_buffer import RequestBuffer
from seer_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def chunk_request_id(sample: RolloutSample, running: bool = False) -> str:
    """Engine request ids of rollout chunks: ``<group>/<sample>#<chunk>`` (the next
    chunk, or the one running now)."""
    return f"{sample.key}#{sample.chunks - 1 if running else sample.chunks}"


def sample_key_of(request_id: str) -> str:
    return request_id.rsplit("#", 1)[0]


@dataclass
class RolloutMetrics:
    policy: str
    output_tokens: int
    makespan_s: float
    throughput_tokens_per_s: float
    tail_s: float  # from the 90th-percentile response finish to the last
    preemptions: int
    recomputed_tokens: int
    migrations: int
    steps: int
    idle_fraction: float
    accepted_tokens_per_step: float  # draft tokens accepted per request-step (0: no speculation)
    accepted_tokens_per_step_thirds: list[float] = field(default_factory=list)  # early, middle, tail
    draft_tokens_verified: int = 0
    draft_tokens_accepted: int = 0
    drafter_s: float = 0.0  # CPU time feeding and querying the proposer
    verification_overhead: float = 0.0  # share of computed tokens spent on rejected draft nodes
    instance_busy_s: list[float] = field(default_factory=list)
    instance_idle_s: list[float] = field(default_factory=list)
    kv_connector: str = "none"
    backend: str = "inproc"
    pool_loads: int = 0  # migrations whose context came from the KV pool
    pool_loaded_tokens: int = 0
    pool_saved_blocks: int = 0
    pool_save_s: float = 0.0  # instance time spent saving and loading pool KV
    pool_load_s: float = 0.0
    pool_failures: int = 0  # pool calls that failed (those requests recomputed)
    instance_failures: int = 0  # instances lost mid-rollout (their responses finished elsewhere)


@dataclass
class RolloutResult:
    groups: list[Group]
    samples: dict[str, list[RolloutSample]]  # group id -> samples in index order
    metrics: RolloutMetrics
    timelines: list[list] = field(default_factory=list)  # per instance: TimelinePoint list


class Rollout:
    """The Request Buffer over an engine pool, driven one step at a time.

    ``add_samples`` may be called at any time (a server adds requests while the
    rollout runs; a request that shares its prompt with a live group joins it);
    ``run`` is the offline form: add every group, step until all are done.
    """

    def __init__(
        self,
        pool: EnginePool,
        policy: RolloutPolicy,
        chunk_tokens: int = 8192,
        on_sample_finished: Callable[[RolloutSample], None] | None = None,
        placement: Placement | None = None,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.pool = pool
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.on_sample_finished = on_sample_finished
        self.placement = placement or SeerPlacement()
        self.kv_connector = pool.kv_pool.connector  # this process's handle: frees finished entries
        self.pooled = self.kv_connector.name != "recompute"
        self.buffer = RequestBuffer(lambda s: self._blocks_for(self.pool.instances[0], s))
        self.now = 0.0  # the time of the latest event (the clock of the last instance stepped)
        self.migrations = 0
        self.migrated_tokens = 0  # context tokens recomputed because a response moved
        self.pool_loads = 0
        self.pool_loaded_tokens = 0
        self.instance_failures = 0
        self._chunk_start: dict[str, int] = {}  # key -> output tokens when its running chunk began
        self._group_instances: dict[str, set[int]] = {}  # group -> instances that ran a sibling
        self.dispatch_log: list[tuple[str, int]] = []  # (sample key, instance) in dispatch order
        self._live: dict[str, RolloutSample] = {}  # key -> unfinished sample
        self._live_per_group: dict[str, int] = {}
        self._finished_groups: list[str] = []  # groups whose last live response finished

    # -- the offline loop ------------------------------------------------------------

    def start(self, groups: Sequence[Group]) -> dict[str, list[RolloutSample]]:
        """Admit every group's responses (in this order); ``step`` then runs them."""
        for order, group in enumerate(groups):
            group.order = order
        samples = {g.group_id: self.new_samples(g) for g in groups}
        for group in groups:
            self.add_samples(samples[group.group_id])
        return samples

    def run(self, groups: Sequence[Group]) -> RolloutResult:
        samples = self.start(groups)
        while self.has_work:
            self.step()
        return RolloutResult(list(groups), samples, self._metrics(samples), [i.timeline for i in self.pool])

    def new_samples(self, group: Group) -> list[RolloutSample]:
        """The group's n responses with per-response seeds (independent of policy and chunking)."""
        max_tokens = self.resolve_max_tokens(group.prompt_token_ids, group.sampling_params)
        seed = group.sampling_params.seed
        return [
            RolloutSample(group, i, sample_seed(seed, group.order, i), max_tokens) for i in range(group.n)
        ]

    def resolve_max_tokens(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        room = self.pool.max_model_len - len(prompt_token_ids)
        return room if params.max_tokens is None else min(params.max_tokens, room)

    # -- the online interface -----------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.buffer) or any(inst.has_work for inst in self.pool)

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
        """Into the buffer (divided policies) or onto the group's instance (baseline)."""
        if self.policy.pin_groups_up_front:
            alive = self.pool.alive
            if not alive:
                raise RuntimeError("every engine instance of the rollout is gone")
            self._submit_or_recover(alive[sample.group.order % len(alive)], sample, sample.max_tokens, False)
        else:
            self.buffer.add(sample)

    def step(self) -> list[RolloutSample]:
        """Dispatch what fits, then step the instance with the earliest clock.

        Returns the responses that finished in this step, and those that made
        progress when they asked for a stream.
        """
        self._dispatch(self.now)
        try:
            stepped = self.pool.advance()
        except InstanceDied as died:
            self._recover(self.pool.instances[died.index], str(died))
            return []
        if stepped is None:
            if not self.buffer:
                return []
            raise RuntimeError(
                f"{len(self.buffer)} responses cannot be dispatched: a chunk needs more KV "
                "blocks than an instance has (raise the KV budget or lower chunk_tokens)"
            )
        inst, reply = stepped
        self.now = inst.clock
        self._count_loads(reply)
        updated = []
        for out in reply.outputs:
            if out.request_id not in inst.in_flight:
                continue  # aborted while this step ran
            sample = self._live[sample_key_of(out.request_id)]
            if out.finished:
                self._on_chunk_done(inst, out)
            else:  # streaming progress within a chunk
                result = out.outputs[0]
                sample.output_token_ids = list(result.token_ids)
                sample.text = result.text
                sample.chunk_logprobs = result.logprobs or []
            if sample.finished or sample.stream:
                updated.append(sample)
        return updated

    def abort(self, keys: Sequence[str]) -> list[RolloutSample]:
        """Stop responses where they are (buffered or mid-chunk); unknown keys are ignored.

        Aborted responses keep the tokens they generated, with finish_reason "abort".
        """
        aborted = []
        wanted = set(keys)
        buffered = {s.key for s in self.buffer if s.key in wanted}
        for sample in self.buffer:
            if sample.key in buffered:
                self.buffer.remove(sample)
        for key in keys:
            sample = self._live.get(key)
            if sample is None:
                continue
            if key not in buffered:
                inst = self.pool.instances[sample.instance]
                rid = chunk_request_id(sample, running=True)
                try:
                    for out in inst.abort([rid]):
                        self._take_chunk(inst, out)
                except InstanceDied as died:
                    self._recover(inst, str(died))
                if rid in inst.in_flight:  # it ended before the abort reached it
                    inst.reserved_blocks -= inst.in_flight.pop(rid)
            self._finish(sample, "abort", None, record=False)
            aborted.append(sample)
        return aborted

    # -- Request Buffer --------------------------------------------------------------

    def _chunk_limit(self, sample: RolloutSample) -> int:
        """Total output tokens the sample may have at the end of its next dispatch."""
        if not self.policy.chunked:
            return sample.max_tokens
        return sample.num_generated + min(self.chunk_tokens, sample.max_tokens - sample.num_generated)

    def _blocks_for(self, inst: EngineInstance, sample: RolloutSample) -> int:
        return inst.blocks_needed(len(sample.group.prompt_token_ids) + self._chunk_limit(sample))

    def _dispatch(self, now: float) -> None:
        """Send buffered samples, in policy order, to instances with room for a whole
        chunk (only those that fit the roomiest instance are ordered at all)."""
        room = self._room()
        if room is None or not self.buffer:
            return
        for sample in self.policy.order(self.buffer.fitting(room), now):
            if room is None:
                return
            if self.buffer.need(sample) > room:
                continue
            inst = self._place(sample)
            if inst is not None:
                self.buffer.remove(sample)  # a lost instance puts its samples back
                self._submit_or_recover(inst, sample, self._chunk_limit(sample), reserve=True)
                room = self._room()

    def _room(self) -> int | None:
        """The most free KV blocks on an instance with a free sequence slot (None: no slot)."""
        free = [
            inst.free_reservable_blocks
            for inst in self.pool.alive
            if len(inst.in_flight) < inst.info.max_num_seqs
        ]
        return max(free) if free else None

    def _place(self, sample: RolloutSample) -> EngineInstance | None:
        """An instance with room for the sample's whole chunk, chosen by the placement
        policy. An in-process instance busy in the past of this event is skipped."""
        alive = self.pool.alive
        fits = [
            inst
            for inst in alive
            if inst.accepts_at(sample.enqueued_at)
            and len(inst.in_flight) < inst.info.max_num_seqs
            and self._blocks_for(inst, sample) <= inst.free_reservable_blocks
        ]
        if not fits:
            return None
        loads = [len(inst.in_flight) for inst in alive]
        return self.placement.choose(fits, lambda inst: self._prefix_tokens(inst, sample), loads)

    def _prefix_tokens(self, inst: EngineInstance, sample: RolloutSample) -> int:
        """How much of the sample's context ``inst`` holds in its prefix cache: all of it
        where its last chunk ran, the prompt where a sibling ran (eviction aside)."""
        if inst.index == sample.instance:
            return len(sample.group.prompt_token_ids) + sample.num_generated
        if inst.index in self._group_instances.get(sample.group.group_id, ()):
            return len(sample.group.prompt_token_ids)
        return 0

    def _submit_or_recover(
        self, inst: EngineInstance, sample: RolloutSample, limit: int, reserve: bool
    ) -> None:
        try:
            self._submit(inst, sample, limit, reserve)
        except InstanceDied as died:
            self._recover(inst, str(died))

    def _submit(self, inst: EngineInstance, sample: RolloutSample, limit: int, reserve: bool) -> None:
        inst.wait_until(max(sample.enqueued_at, self.now))
        g = sample.group
        context = len(g.prompt_token_ids) + sample.num_generated
        load = False
        if sample.num_generated and sample.instance != inst.index:  # it moves
            self.migrations += 1
            missing = context - self._prefix_tokens(inst, sample)
            load = self.pooled and self.placement.should_pull(missing)
            if not load:
                self.migrated_tokens += missing
        remaining_min = max(0, (sample.params.min_tokens or 0) - sample.num_generated)
        params = sample.params.clone(
            n=1, seed=sample.seed, max_tokens=limit, min_tokens=min(remaining_min, limit)
        )
        rid = chunk_request_id(sample)
        blocks = self._blocks_for(inst, sample) if reserve else 0
        inst.in_flight[rid] = blocks
        inst.reserved_blocks += blocks
        sample.instance = inst.index
        sample.chunks += 1
        self._chunk_start[sample.key] = sample.num_generated
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
            )
        )

    def _count_loads(self, reply: StepReply) -> None:
        """Pool loads the instance made when it admitted migrated chunks: what the pool
        did not cover was recomputed."""
        for _rid, context, result in reply.loads:
            self.pool_loads += result.loaded_tokens > 0
            self.pool_loaded_tokens += result.loaded_tokens
            self.migrated_tokens += max(0, context - result.tokens)

    def _recover(self, inst: EngineInstance, why: str) -> None:
        """An instance is gone: its running chunks return to the buffer from their last
        chunk boundary (the pool still holds that KV), to finish on another instance."""
        inst.alive = False
        logger.warning("%s; its %d running responses go back to the buffer", why, len(inst.in_flight))
        self.instance_failures += 1
        lost = list(inst.in_flight)
        inst.in_flight.clear()
        inst.reserved_blocks = 0
        for gid in self._group_instances.values():
            gid.discard(inst.index)
        for rid in lost:
            sample = self._live.get(sample_key_of(rid))
            if sample is None:
                continue
            start = self._chunk_start.get(sample.key, sample.num_generated)
            sample.output_token_ids = sample.output_token_ids[:start]  # drop the lost chunk's progress
            sample.chunk_logprobs = []
            sample.instance = None
            sample.enqueued_at = self.now
            self._enqueue(sample)

    def _take_chunk(self, inst: EngineInstance, out: RequestOutput) -> RolloutSample:
        """Record a chunk's final output on its sample and release its reservation."""
        inst.reserved_blocks -= inst.in_flight.pop(out.request_id)
        sample = self._live[sample_key_of(out.request_id)]
        result = out.outputs[0]
        sample.output_token_ids = result.token_ids  # the instance's own copy
        sample.text = result.text
        sample.logprobs.extend(result.logprobs or [])
        sample.chunk_logprobs = []
        sample.cumulative_logprob += result.cumulative_logprob or 0.0
        sample.instance = inst.index
        return sample

    def _on_chunk_done(self, inst: EngineInstance, out: RequestOutput) -> None:
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
            sample.enqueued_at = self.now
            self.buffer.add(sample)
            return
        self._finish(sample, result.finish_reason, result.stop_reason, record=True)

    def _finish(self, sample: RolloutSample, reason: str | None, stop_reason, record: bool) -> None:
        """``record``: the length is real (not cut by an abort), so the Context Manager learns it."""
        if self.pooled:
            self.kv_connector.free(sample.key)
        self._chunk_start.pop(sample.key, None)
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.finished_at = self.now
        del self._live[sample.key]
        gid = sample.group.group_id
        if record:
            self.policy.context.on_finished(sample)
        self._live_per_group[gid] -= 1
        if self._live_per_group[gid] == 0:
            self._finished_groups.append(gid)
            self.pool.finish_group(gid)
        if self.on_sample_finished is not None:
            self.on_sample_finished(sample)

    def is_group_live(self, group_id: str) -> bool:
        return self._live_per_group.get(group_id, 0) > 0

    def forget_finished_groups(self) -> list[str]:
        """Drop what the Context Manager knows of groups with no live response, and
        return their ids (a long-running server calls this; an offline rollout does
        not need to)."""
        done = [gid for gid in self._finished_groups if self._live_per_group.get(gid) == 0]
        self._finished_groups.clear()
        for gid in done:
            del self._live_per_group[gid]
            self.policy.context.forget(gid)
        return done

    # -- report ----------------------------------------------------------------------

    def _metrics(self, samples: dict[str, list[RolloutSample]]) -> RolloutMetrics:
        flat = [s for group in samples.values() for s in group]
        finish = sorted(s.finished_at or 0.0 for s in flat)
        makespan = finish[-1] if finish else 0.0
        p90 = finish[max(0, math.ceil(0.9 * len(finish)) - 1)] if finish else 0.0
        tokens = sum(s.num_generated for s in flat)
        stats = [inst.stats for inst in self.pool]
        busy = [inst.busy_s for inst in self.pool]
        rows = sum(st.sampled_rows for st in stats)
        accepted = sum(st.draft_tokens_accepted for st in stats)
        drafters = [inst.drafter_stats for inst in self.pool if inst.drafter_stats is not None]
        pools = [inst.connector_stats for inst in self.pool]
        return RolloutMetrics(
            policy=self.policy.name,
            output_tokens=tokens,
            makespan_s=makespan,
            throughput_tokens_per_s=tokens / makespan if makespan else 0.0,
            tail_s=makespan - p90,
            preemptions=sum(st.preemptions for st in stats),
            recomputed_tokens=sum(st.recomputed_tokens for st in stats) + self.migrated_tokens,
            migrations=self.migrations,
            steps=sum(st.steps for st in stats),
            idle_fraction=1.0 - sum(busy) / (len(busy) * makespan) if makespan else 0.0,
            accepted_tokens_per_step=accepted / rows if rows else 0.0,
            accepted_tokens_per_step_thirds=_per_third(self.pool, makespan),
            draft_tokens_verified=sum(st.draft_tokens_scheduled for st in stats),
            draft_tokens_accepted=accepted,
            drafter_s=sum(d.observe_s + d.propose_s for d in drafters),
            verification_overhead=_rejected_share(stats),
            instance_busy_s=busy,
            instance_idle_s=[max(0.0, makespan - b) for b in busy],
            kv_connector=self.kv_connector.name if self.pooled else "none",
            backend=self.pool.backend,
            pool_loads=self.pool_loads,
            pool_loaded_tokens=self.pool_loaded_tokens,
            pool_saved_blocks=sum(p.saved_blocks for p in pools),
            pool_save_s=sum(p.save_s for p in pools),
            pool_load_s=sum(p.load_s for p in pools),
            pool_failures=sum(p.failures for p in pools) + self.kv_connector.stats.failures,
            instance_failures=self.instance_failures,
        )


def _rejected_share(stats) -> float:
    computed = sum(st.scheduled_tokens for st in stats)
    rejected = sum(st.draft_tokens_scheduled - st.draft_tokens_accepted for st in stats)
    return rejected / computed if computed else 0.0


def _per_third(pool: EnginePool, makespan: float) -> list[float]:
    """Accepted draft tokens per request-step in the early, middle and tail thirds of
    the rollout's time, over all instances."""
    if not makespan:
        return [0.0, 0.0, 0.0]
    bounds = [0.0, makespan / 3, 2 * makespan / 3, float("inf")]
    rows, accepted = [0, 0, 0], [0, 0, 0]
    for inst in pool:
        prev_rows = prev_acc = 0
        for point in inst.timeline:
            third = next(i for i in range(3) if point.time < bounds[i + 1]) if point.time < makespan else 2
            rows[third] += point.sampled_rows - prev_rows
            accepted[third] += point.draft_tokens_accepted - prev_acc
            prev_rows, prev_acc = point.sampled_rows, point.draft_tokens_accepted
    return [a / r if r else 0.0 for a, r in zip(accepted, rows)]


def make_groups(
    prompts: Sequence[str | Sequence[int]], n: int, params: SamplingParams | Sequence[SamplingParams], encode
) -> list[Group]:
    """Groups from prompts (text or token ids); ``encode`` turns text into ids."""
    param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    groups = []
    for i, (prompt, p) in enumerate(zip(prompts, param_list)):
        text, ids = encode(prompt)
        groups.append(Group(f"g{i}", ids, p, n, prompt=text, order=i))
    return groups
