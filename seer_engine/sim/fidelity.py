"""Fidelity: the simulator against the real engine on the same small workload.

Each policy runs on the real engine (in-process instances, trace replay) with every
step recorded; a step-time model is fitted on those steps (draft nodes count as
logit tokens), and the simulator replays the same workload with it. The fit comes
from the compared runs themselves because a profile taken minutes earlier on a
shared 2-core machine differs from the runs by as much as the tolerance.

Two comparisons: against the wall-clock runs (what ``bench rollout`` reports; a
single slow run on a shared machine moves it by 10-40%), and against the same real
engines re-run with the fitted model as their clock (``modeled_clock``): the engines
still schedule, batch, preempt and draft for real, only the clocks lose the noise,
so what is left to differ is the simulator's model of the engine.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from seer_engine.engine.config import EngineConfig
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.rollout.context_manager import DEFAULT_STARVATION_S
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.metrics import RolloutMetrics
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import RolloutPolicy, make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.profiler import StepPoint, fit_step_time, recording_steps
from seer_engine.sim.simulator import bench_groups, policy_for, simulate
from seer_engine.workloads.groups import select_groups
from seer_engine.workloads.replay import ReplayWorkload
from seer_engine.workloads.traces import load_trace

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
    starvation_s: float = DEFAULT_STARVATION_S
    # [fixed_s, per_token_s] of the draft budget (an engine's start-up profile of this
    # model on this machine, rounded): pinned, as Seer pins an offline profile, so the
    # comparison does not hang on a start-up measurement taken while the machine is busy.
    draft_step_cost: tuple[float, float] = (7e-4, 1e-4)


def pin_step_cost(policy: RolloutPolicy, w: Workload) -> RolloutPolicy:
    """Speculating policies get the workload's pinned draft-budget cost, so the real
    drafter and the modeled one size drafts from the same line."""
    if policy.speculative is not None:
        policy.speculative = {**policy.speculative, "step_cost": list(w.draft_step_cost)}
    return policy


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
    w: Workload,
    model: str | os.PathLike,
    policies=POLICIES,
    repeats: int = 1,
    clock: InstanceProfile | None = None,
) -> tuple[dict[str, RolloutMetrics], list[StepPoint]]:
    """Every policy on the real engine, the fastest of ``repeats`` runs (a run slowed by
    other work on the machine says nothing about scheduling); their metrics and steps.

    ``clock``: charge each step (and pool load) what this profile says its shape costs
    instead of its wall time. The engines still run for real and decide everything as before; only
    the instance clocks become free of the machine's noise."""
    trace = select_groups(load_trace(w.trace), w.groups)
    max_len = max(len(g.prompt_token_ids) for g in trace) + w.max_tokens + 1
    cfg = EngineConfig(model=str(model), num_kv_blocks=w.kv_blocks, block_size=w.block_size,
                       max_num_seqs=w.max_num_seqs, num_threads=1, max_model_len=max_len)  # fmt: skip
    workload = ReplayWorkload(trace, w.samples, w.max_tokens)
    replay = workload.replay(ModelConfig.from_pretrained(Path(model)).replay_eos())
    metrics, points = {}, []
    for name in policies:
        runs = []
        for _ in range(repeats):
            policy = pin_step_cost(
                make_rollout_policy(name, true_lengths=workload.true_lengths, starvation_s=w.starvation_s), w
            )
            with (
                EnginePool.start(
                    cfg,
                    w.instances,
                    replay,
                    policy=policy,
                    step_timer=clock.step if clock else None,
                    pool_load_s=clock.pool_load_s if clock else None,
                ) as pool,
                ExitStack() as stack,
            ):
                steps = [
                    stack.enter_context(recording_steps(inst.engine, kv_per_query=True)) for inst in pool
                ]
                result = Dispatcher(pool, policy, w.chunk_tokens, placement=SeerPlacement()).run(
                    workload.groups()
                )
            runs.append((result.metrics, [p for s in steps for p in s]))
        metrics[name], fastest_steps = min(runs, key=lambda r: r[0].makespan_s)
        points += fastest_steps
    return metrics, points


def fitted_profile(w: Workload, points: list[StepPoint]) -> InstanceProfile:
    return InstanceProfile(
        "fitted-on-the-real-rollouts", fit_step_time(points, kv_per_query=True),
        kv_capacity_tokens=w.kv_blocks * w.block_size, max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=EngineConfig.max_num_batched_tokens, block_size=w.block_size,
    )  # fmt: skip


def simulated(w: Workload, profile: InstanceProfile, policies=POLICIES) -> dict[str, RolloutMetrics]:
    """The same workload in the simulator."""
    groups = bench_groups(w.trace, w.groups, w.samples, w.max_tokens)
    return {
        name: simulate(
            groups,
            pin_step_cost(policy_for(name, groups, w.max_tokens, w.starvation_s), w),
            profile,
            w.instances,
            w.max_tokens,
            w.chunk_tokens,
            SeerPlacement(),
            pooled=False,
        ).metrics  # fmt: skip
        for name in policies
    }


def compare(
    w: Workload, model: str | os.PathLike, policies=POLICIES, modeled_clock: bool = True, repeats: int = 1
) -> tuple[list[Comparison], InstanceProfile]:
    """The real runs against the simulator. Wall-clock runs give the steps the model is
    fitted on; with ``modeled_clock`` the real engines run again with that model as
    their clock, so what differs is the scheduling alone (see ``real_rollouts``)."""
    real, points = real_rollouts(w, model, policies, repeats)
    profile = fitted_profile(w, points)
    if modeled_clock:
        real, _ = real_rollouts(w, model, policies, clock=profile)
    sim = simulated(w, profile, policies)
    return [Comparison(name, real[name], sim[name]) for name in policies], profile
