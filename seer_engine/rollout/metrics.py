"""What a rollout measured: one record per policy run, totalled from the instances'
own stats and the dispatcher's counters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from seer_engine.engine.stats import EngineStats, total
from seer_engine.rollout.types import Group, RolloutSample


@dataclass
class RolloutCounters:
    """What the dispatcher itself counts (the engines count the rest)."""

    migrations: int = 0
    migrated_tokens: int = 0  # context tokens recomputed because a response moved
    pool_loads: int = 0  # migrations whose context came from the KV pool
    pool_loaded_tokens: int = 0
    instance_failures: int = 0  # instances lost mid-rollout (their responses finished elsewhere)


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
    pool_loads: int = 0
    pool_loaded_tokens: int = 0
    pool_saved_blocks: int = 0
    pool_save_s: float = 0.0  # instance time spent saving and loading pool KV
    pool_load_s: float = 0.0
    pool_failures: int = 0  # pool calls that failed (those requests recomputed)
    instance_failures: int = 0
    chunk_cuts: int = 0  # chunks an engine ended early for KV (admission peak:N), not preempted


@dataclass
class RolloutResult:
    groups: list[Group]
    samples: dict[str, list[RolloutSample]]  # group id -> samples in index order
    metrics: RolloutMetrics
    timelines: list[list] = field(default_factory=list)  # per instance: TimelinePoint list
    # Sample key -> when an engine first / last admitted it (modeled engines report it).
    started_at: dict[str, float] = field(default_factory=dict)
    resumed_at: dict[str, float] = field(default_factory=dict)


def rollout_metrics(policy: str, samples: dict[str, list[RolloutSample]], pool, counters: RolloutCounters):
    """The metrics of a finished rollout over ``pool``'s instances."""
    flat = [s for group in samples.values() for s in group]
    finish = sorted(s.finished_at or 0.0 for s in flat)
    makespan = finish[-1] if finish else 0.0
    p90 = finish[max(0, math.ceil(0.9 * len(finish)) - 1)] if finish else 0.0
    tokens = sum(s.num_generated for s in flat)
    books = [inst.books for inst in pool.instances]
    stats = total([b.stats for b in books])
    busy = [b.busy_s for b in books]
    pools = [b.connector_stats for b in books]
    connector = pool.kv_connector
    pooled = connector.name != "recompute"
    return RolloutMetrics(
        policy=policy,
        output_tokens=tokens,
        makespan_s=makespan,
        throughput_tokens_per_s=tokens / makespan if makespan else 0.0,
        tail_s=makespan - p90,
        preemptions=stats.preemptions,
        recomputed_tokens=stats.recomputed_tokens + counters.migrated_tokens,
        migrations=counters.migrations,
        steps=stats.steps,
        idle_fraction=max(0.0, 1.0 - sum(busy) / (len(busy) * makespan)) if makespan else 0.0,
        accepted_tokens_per_step=stats.accepted_tokens_per_step,
        accepted_tokens_per_step_thirds=_per_third(books, makespan),
        draft_tokens_verified=stats.draft_tokens_verified,
        draft_tokens_accepted=stats.draft_tokens_accepted,
        drafter_s=stats.drafter_s,
        verification_overhead=_rejected_share(stats),
        instance_busy_s=busy,
        instance_idle_s=[max(0.0, makespan - b) for b in busy],
        kv_connector=connector.name if pooled else "none",
        backend=pool.backend,
        pool_loads=counters.pool_loads,
        pool_loaded_tokens=counters.pool_loaded_tokens,
        pool_saved_blocks=sum(p.saved_blocks for p in pools),
        pool_save_s=sum(p.save_s for p in pools),
        pool_load_s=sum(p.load_s for p in pools),
        pool_failures=sum(p.failures for p in pools) + connector.stats.failures,
        instance_failures=counters.instance_failures,
        chunk_cuts=stats.chunk_cuts,
    )


def _rejected_share(stats: EngineStats) -> float:
    rejected = stats.draft_tokens_verified - stats.draft_tokens_accepted
    return rejected / stats.scheduled_tokens if stats.scheduled_tokens else 0.0


def _per_third(books, makespan: float) -> list[float]:
    """Accepted draft tokens per request-step in the early, middle and tail thirds of
    the rollout's time, over all instances."""
    if not makespan:
        return [0.0, 0.0, 0.0]
    bounds = [0.0, makespan / 3, 2 * makespan / 3, float("inf")]
    rows, accepted = [0, 0, 0], [0, 0, 0]
    for b in books:
        prev_rows = prev_acc = 0
        for point in b.timeline:
            third = next(i for i in range(3) if point.time < bounds[i + 1]) if point.time < makespan else 2
            rows[third] += point.sampled_rows - prev_rows
            accepted[third] += point.draft_tokens_accepted - prev_acc
            prev_rows, prev_acc = point.sampled_rows, point.draft_tokens_accepted
    return [a / r if r else 0.0 for a, r in zip(accepted, rows)]
