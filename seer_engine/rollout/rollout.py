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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from seer_engine.core.policies import RolloutPolicy
from seer_engine.core.request import Group, RolloutSample
from seer_engine.kv_connector.base import KVConnector, RecomputeConnector
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.engine_pool import EngineInstance, EnginePool
from seer_engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


def sample_seed(group: Group, index: int) -> int:
    """Per-response seed: the same whatever policy, chunking or instance runs it."""
    base = group.sampling_params.seed if group.sampling_params.seed is not None else group.order
    return (base * 1_000_003 + index * 0x9E3779B97F4A7C15) & _SEED_MASK


def chunk_request_id(sample: RolloutSample) -> str:
    """Engine request ids of rollout chunks: ``<group>/<sample>#<chunk>``."""
    return f"{sample.key}#{sample.chunks}"


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
    accepted_tokens_per_step: float
    instance_busy_s: list[float] = field(default_factory=list)
    instance_idle_s: list[float] = field(default_factory=list)


@dataclass
class RolloutResult:
    groups: list[Group]
    samples: dict[str, list[RolloutSample]]  # group id -> samples in index order
    metrics: RolloutMetrics
    timelines: list[list] = field(default_factory=list)  # per instance: TimelinePoint list


class Rollout:
    def __init__(
        self,
        pool: EnginePool,
        policy: RolloutPolicy,
        chunk_tokens: int = 8192,
        on_sample_finished: Callable[[RolloutSample], None] | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.pool = pool
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.on_sample_finished = on_sample_finished
        self.kv_connector = kv_connector or RecomputeConnector()
        self.buffer: list[RolloutSample] = []
        self.migrations = 0
        self.migrated_tokens = 0
        self.dispatch_log: list[tuple[str, int]] = []  # (sample key, instance) in dispatch order
        self._by_key: dict[str, RolloutSample] = {}

    # -- the loop ------------------------------------------------------------------

    def run(self, groups: Sequence[Group]) -> RolloutResult:
        samples = self._make_samples(groups)
        if self.policy.pin_groups_up_front:
            for gi, group in enumerate(groups):
                inst = self.pool.instances[gi % len(self.pool)]
                for sample in samples[group.group_id]:
                    self._submit(inst, sample, sample.max_tokens, reserve=False)
        else:
            self.buffer = [s for g in groups for s in samples[g.group_id]]
        remaining = sum(len(v) for v in samples.values())
        now = 0.0
        while remaining:
            self._dispatch(now)
            busy = [inst for inst in self.pool if inst.has_work]
            if not busy:
                raise RuntimeError(
                    f"{len(self.buffer)} responses cannot be dispatched: a chunk needs more KV "
                    "blocks than an instance has (raise the KV budget or lower chunk_tokens)"
                )
            inst = min(busy, key=lambda i: i.clock)
            outputs = inst.step()
            now = inst.clock
            for out in outputs:
                remaining -= self._on_chunk_done(inst, out, now)
        return RolloutResult(list(groups), samples, self._metrics(samples), [i.timeline for i in self.pool])

    def _make_samples(self, groups: Sequence[Group]) -> dict[str, list[RolloutSample]]:
        engine = self.pool.first
        samples: dict[str, list[RolloutSample]] = {}
        for order, group in enumerate(groups):
            group.order = order
            room = engine.max_model_len - len(group.prompt_token_ids)
            limit = group.sampling_params.max_tokens
            max_tokens = room if limit is None else min(limit, room)
            self.policy.context.register(group, max_tokens)
            samples[group.group_id] = [
                RolloutSample(group, i, sample_seed(group, i), max_tokens) for i in range(group.n)
            ]
            for s in samples[group.group_id]:
                self._by_key[s.key] = s
        return samples

    # -- Request Buffer --------------------------------------------------------------

    def _chunk_limit(self, sample: RolloutSample) -> int:
        """Total output tokens the sample may have at the end of its next dispatch."""
        if not self.policy.chunked:
            return sample.max_tokens
        return sample.num_generated + min(self.chunk_tokens, sample.max_tokens - sample.num_generated)

    def _blocks_for(self, inst: EngineInstance, sample: RolloutSample) -> int:
        tokens = len(sample.group.prompt_token_ids) + self._chunk_limit(sample)
        return inst.engine.kv_manager.blocks_needed(tokens)

    def _dispatch(self, now: float) -> None:
        """Send buffered samples, in policy order, to instances with room for a whole chunk."""
        if not self.buffer:
            return
        self.buffer.sort(key=lambda s: self.policy.priority(s, now))
        kept = []
        for sample in self.buffer:
            inst = self._place(sample)
            if inst is None:
                kept.append(sample)
                continue
            self._submit(inst, sample, self._chunk_limit(sample), reserve=True)
        self.buffer = kept

    def _place(self, sample: RolloutSample) -> EngineInstance | None:
        """The instance that already holds the sample's KV if it has room, else the one
        with the most free KV. An instance busy in the past of this event is skipped."""
        fits = []
        for inst in self.pool:
            if inst.has_work and inst.clock < sample.enqueued_at:
                continue
            if len(inst.in_flight) >= inst.engine.config.max_num_seqs:
                continue
            if self._blocks_for(inst, sample) <= inst.free_reservable_blocks:
                fits.append(inst)
        if not fits:
            return None
        home = next((i for i in fits if i.index == sample.instance), None)
        return home or max(fits, key=lambda i: (i.free_reservable_blocks, -i.index))

    def _submit(self, inst: EngineInstance, sample: RolloutSample, limit: int, reserve: bool) -> None:
        if not inst.has_work:
            inst.clock = max(inst.clock, sample.enqueued_at)  # an idle instance waits for work
        g = sample.group
        if sample.instance is not None and sample.instance != inst.index:
            context = g.prompt_token_ids + sample.output_token_ids
            loaded = self.kv_connector.load(sample.key, inst.engine, context).tokens
            self.migrations += 1
            self.migrated_tokens += max(0, sample.num_generated - max(0, loaded - len(g.prompt_token_ids)))
        remaining_min = max(0, (g.sampling_params.min_tokens or 0) - sample.num_generated)
        params = g.sampling_params.clone(
            n=1, seed=sample.seed, max_tokens=limit, min_tokens=min(remaining_min, limit)
        )
        rid = chunk_request_id(sample)
        inst.engine.add_request(
            rid,
            g.prompt_token_ids,
            params,
            group_id=g.group_id,
            prior_output_token_ids=sample.output_token_ids,
        )
        blocks = self._blocks_for(inst, sample) if reserve else 0
        inst.in_flight[rid] = blocks
        inst.reserved_blocks += blocks
        sample.chunks += 1
        self.dispatch_log.append((sample.key, inst.index))

    def _on_chunk_done(self, inst: EngineInstance, out: RequestOutput, now: float) -> int:
        """Take a finished chunk back; returns 1 when the whole response is done."""
        inst.reserved_blocks -= inst.in_flight.pop(out.request_id)
        sample = self._by_key[sample_key_of(out.request_id)]
        result = out.outputs[0]
        sample.output_token_ids = list(result.token_ids)
        sample.logprobs.extend(result.logprobs or [])
        sample.instance = inst.index
        engine = inst.engine
        at_context_limit = len(sample.group.prompt_token_ids) + sample.num_generated >= engine.max_model_len
        chunk_end = (
            result.finish_reason == "length"
            and sample.num_generated < sample.max_tokens
            and not at_context_limit
        )
        if chunk_end:
            sample.enqueued_at = now
            self.kv_connector.save(
                sample.key, engine, sample.group.prompt_token_ids + sample.output_token_ids
            )
            self.buffer.append(sample)
            return 0
        self.kv_connector.free(sample.key)
        sample.finish_reason = result.finish_reason
        sample.stop_reason = result.stop_reason
        sample.finished_at = now
        self.policy.context.on_finished(sample)
        if self.on_sample_finished is not None:
            self.on_sample_finished(sample)
        return 1

    # -- report ----------------------------------------------------------------------

    def _metrics(self, samples: dict[str, list[RolloutSample]]) -> RolloutMetrics:
        flat = [s for group in samples.values() for s in group]
        finish = sorted(s.finished_at or 0.0 for s in flat)
        makespan = finish[-1] if finish else 0.0
        p90 = finish[max(0, math.ceil(0.9 * len(finish)) - 1)] if finish else 0.0
        tokens = sum(s.num_generated for s in flat)
        stats = [inst.engine.scheduler.stats for inst in self.pool]
        busy = [inst.busy_s for inst in self.pool]
        rows = sum(st.sampled_rows for st in stats)
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
            accepted_tokens_per_step=sum(st.generated_tokens for st in stats) / rows if rows else 0.0,
            instance_busy_s=busy,
            instance_idle_s=[max(0.0, makespan - b) for b in busy],
        )


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
