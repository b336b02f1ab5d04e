"""Fidelity: the simulator against the real engine on the same small workload.

Each policy runs on the real engine (in-process instances, trace replay) with every
step recorded; a step-time model is fitted on those steps (the policies without
speculation: drafts make steps of unequal shape), and the simulator replays the same
workload with it. The fit comes from the compared runs themselves because a profile
taken minutes earlier on a shared 2-core machine differs from the runs by as much as
the tolerance: what is compared is the simulator's scheduling, not the machine's
noise.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from seer_engine.core.policies import make_rollout_policy
from seer_engine.core.request import Group
from seer_engine.engine.config import EngineConfig
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.rollout.engine_pool import EnginePool
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.replay import TraceReplay
from seer_engine.rollout.rollout import Rollout, RolloutMetrics
from seer_engine.rollout.workload import load_trace, select_groups
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.profiler import StepPoint, fit_step_time, recording_steps
from seer_engine.sim.simulator import bench_groups, policy_for, simulate

POLICIES = ("baseline", "divided", "context", "seer", "oracle")


@dataclass(frozen=True)
class Workload:
    trace: str
    groups: str = "4"  # bench rollout's --groups
    samples: int = 8
    max_tokens: int = 512
    chunk_tokens: int = 128
    kv_blocks: int = 128
    block_size: int = 16
    max_num_seqs: int = 16
    instances: int = 2
    starvation_s: float = 120.0


@dataclass
class Comparison:
    policy: str
    real: RolloutMetrics
    sim: RolloutMetrics

    @property
    def makespan_ratio(self) -> float:
        return self.sim.makespan_s / self.real.makespan_s

    @property
    def throughput_ratio(self) -> float:
        return self.sim.throughput_tokens_per_s / self.real.throughput_tokens_per_s

    def line(self) -> str:
        s, r = self.sim, self.real
        return (
            f"{self.policy}: makespan sim/real {self.makespan_ratio:.3f} ({s.makespan_s:.2f}/"
            f"{r.makespan_s:.2f}s), throughput {self.throughput_ratio:.3f}, steps {s.steps:.0f}/{r.steps}, "
            f"preemptions {s.preemptions}/{r.preemptions}, draft nodes {s.draft_tokens_verified:.0f}/"
            f"{r.draft_tokens_verified}"
        )


def real_rollouts(
    w: Workload, model: str | os.PathLike, policies=POLICIES
) -> tuple[dict[str, RolloutMetrics], list[StepPoint]]:
    """Every policy on the real engine; its metrics, and the steps of those without drafts."""
    trace = select_groups(load_trace(w.trace), w.groups, w.samples)
    max_len = max(len(g.prompt_token_ids) for g in trace) + w.max_tokens + 1
    cfg = EngineConfig(model=str(model), num_kv_blocks=w.kv_blocks, block_size=w.block_size,
                       max_num_seqs=w.max_num_seqs, num_threads=1, max_model_len=max_len)  # fmt: skip
    responses = {f"t{g.group_id}/{j}": list(r) for g in trace for j, r in enumerate(g.response_token_ids)}
    replay = TraceReplay(responses, min(ModelConfig.from_pretrained(Path(model)).eos_token_ids))
    lengths = {k: min(len(v) + 1, w.max_tokens) for k, v in responses.items()}
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens)
    metrics, points = {}, []
    for name in policies:
        policy = make_rollout_policy(name, true_lengths=lengths, starvation_s=w.starvation_s)
        groups = [Group(f"t{g.group_id}", list(g.prompt_token_ids), params, w.samples, order=k)
                  for k, g in enumerate(trace)]  # fmt: skip
        with EnginePool.for_policy(cfg, policy, w.instances, replay) as pool, ExitStack() as stack:
            steps = [stack.enter_context(recording_steps(inst.engine, kv_per_query=True)) for inst in pool]
            metrics[name] = (
                Rollout(pool, policy, w.chunk_tokens, placement=SeerPlacement()).run(groups).metrics
            )
            if policy.speculative is None:
                points += [p for s in steps for p in s]
    return metrics, points


def simulated(w: Workload, points: list[StepPoint], policies=POLICIES) -> dict[str, RolloutMetrics]:
    """The same workload in the simulator, on a step-time model fitted on ``points``."""
    profile = InstanceProfile(
        "fitted-on-the-real-rollouts", fit_step_time(points, kv_per_query=True),
        kv_capacity_tokens=w.kv_blocks * w.block_size, max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=EngineConfig.max_num_batched_tokens, block_size=w.block_size,
    )  # fmt: skip
    groups = bench_groups(w.trace, w.groups, w.samples, w.max_tokens)
    return {
        name: simulate(
            groups,
            policy_for(name, groups, w.max_tokens, w.starvation_s),
            profile,
            w.instances,
            w.max_tokens,
            w.chunk_tokens,
            SeerPlacement(),
            pooled=False,
        ).metrics  # fmt: skip
        for name in policies
    }


def compare(w: Workload, model: str | os.PathLike, policies=POLICIES) -> list[Comparison]:
    real, points = real_rollouts(w, model, policies)
    sim = simulated(w, points, policies)
    return [Comparison(name, real[name], sim[name]) for name in policies]
