"""The cluster simulator: the engine's own dispatcher over modeled instances.

``simulate`` builds N ``SimInstance``s, hands them to the same ``Dispatcher`` (Request
Buffer, rollout policy, Context Manager, placement) that drives real engines, and
returns the same ``RolloutResult``. Nothing about scheduling is re-implemented here:
the policy classes are imported from ``core`` and ``rollout``; the modeled engines
use the engine's scheduling policy (FCFS) to pick admission order and preemption
victims, and its draft budget policy to size drafts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from seer_engine.core.policies import make_policy
from seer_engine.kv_connector.base import KVConnector, RecomputeConnector
from seer_engine.rollout.dispatcher import DEFAULT_ADMISSION, Dispatcher
from seer_engine.rollout.metrics import RolloutResult
from seer_engine.rollout.placement import Placement, SeerPlacement
from seer_engine.rollout.policies import RolloutPolicy, make_rollout_policy
from seer_engine.rollout.types import Group, RolloutStalled, StepReply, sample_key
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.admission import KNOWN_ENDS, KnownEndsAdmission
from seer_engine.sim.instance import SimInstance
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.speculation import SimSpeculation
from seer_engine.sim.world import SimPrompt, SimWorld
from seer_engine.spec_decode.budget import StepCostModel
from seer_engine.spec_decode.config import SpeculativeConfig


@dataclass
class SimGroup:
    """A group as the simulator needs it: a prompt length and each response's length."""

    group_id: str
    prompt_len: int
    lengths: list[int]
    prompt_key: str = ""  # the prompt's identity across iterations (default: the group id)

    @property
    def prompt(self) -> SimPrompt:
        """The prompt as the engines and the history store see it: a length and an identity."""
        return SimPrompt(self.prompt_len, self.prompt_key or self.group_id)


class ModeledPool(KVConnector):
    """The global KV pool as the simulator sees it: always there, its transfer time
    charged by the instance that loads (``InstanceProfile.pool_load_s``)."""

    name = "modeled"

    def free(self, key: str) -> None:
        pass


class SimPool:
    """Modeled instances as the dispatcher's instance pool (``InstancePool``): the next
    event is the earliest one of any instance."""

    backend = "sim"

    def __init__(self, instances: Sequence[SimInstance], pooled: bool) -> None:
        self.instances = list(instances)
        self.kv_connector = ModeledPool() if pooled else RecomputeConnector()

    @property
    def alive(self) -> list[SimInstance]:
        return [inst for inst in self.instances if inst.alive]

    @property
    def max_model_len(self) -> int:
        return self.instances[0].info.max_model_len

    def advance(self) -> tuple[SimInstance, StepReply] | None:
        busy = [inst for inst in self.instances if inst.alive and inst.books.has_work]
        if not busy:
            return None
        times = [inst.next_event_at() for inst in busy]
        first = min(range(len(busy)), key=lambda i: (times[i], busy[i].index))
        if math.isinf(times[first]):
            raise RolloutStalled(
                "simulated instances hold chunks they can never run: a chunk needs more KV "
                "than an instance has (raise kv_capacity_tokens or lower chunk_tokens)"
            )
        horizon = min((t for i, t in enumerate(times) if i != first), default=math.inf)
        inst = busy[first]
        reply = inst.step(horizon)
        inst.books.record(reply, inst.clock)
        return inst, reply

    def accepts_at(self, inst: SimInstance, t: float) -> bool:
        return True  # a modeled instance catches up to the arrival (``wait_until``)

    def wait_until(self, inst: SimInstance, t: float) -> None:
        inst.wait_until(t)

    def finish_group(self, group_id: str, ran_on: Collection[int] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def simulate(
    groups: Sequence[SimGroup],
    policy: RolloutPolicy,
    profile: InstanceProfile,
    instances: int,
    max_tokens: int,
    chunk_tokens: int = 8192,
    placement: Placement | None = None,
    acceptance=None,
    pooled: bool = True,
    on_sample_finished: Callable | None = None,
    admission: str = DEFAULT_ADMISSION,
    backfill: str = "none",
) -> RolloutResult:
    """One rollout iteration of ``groups`` under ``policy`` on ``instances`` modeled instances.

    ``pooled``: a global KV pool (Seer) lets moved responses pull their context; without
    one they recompute it. ``acceptance``: the speculative acceptance model (policies
    with speculative decoding only; default: the one fitted on the Qwen3 trace).
    ``admission``: a rule of ``rollout/admission.py``, or ``peak-known`` (``sim/admission.py``).
    """
    _check_kv_holds(groups, max_tokens, profile)
    max_prompt = max(g.prompt_len for g in groups)
    world = SimWorld(
        lengths=true_lengths(groups, max_tokens),
        max_tokens=max_tokens,
        group_sizes={g.group_id: len(g.lengths) for g in groups},
        members={g.group_id: [sample_key(g.group_id, i) for i in range(len(g.lengths))] for g in groups},
    )
    speculation = _speculation(policy, acceptance, max(len(g.lengths) for g in groups))
    sims = [
        SimInstance(
            i, profile, world, make_policy("fcfs"), speculation, max_model_len=max_prompt + max_tokens
        )
        for i in range(instances)
    ]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    rollout_groups = [
        Group(
            g.group_id,
            g.prompt,
            params,
            len(g.lengths),
            max_tokens,
            order=k,
        )  # fmt: skip
        for k, g in enumerate(groups)
    ]
    if admission == KNOWN_ENDS:
        admission = KnownEndsAdmission(world.lengths)
    pool = SimPool(sims, pooled)
    dispatcher = Dispatcher(
        pool, policy, chunk_tokens, on_sample_finished, placement or SeerPlacement(),
        admission=admission, backfill=backfill,
    )  # fmt: skip
    result = dispatcher.run(rollout_groups)
    for sim in sims:
        for key, t in sim.started_at.items():
            result.started_at[key] = min(t, result.started_at.get(key, t))
        for key, t in sim.resumed_at.items():
            result.resumed_at[key] = max(t, result.resumed_at.get(key, t))
    return result


def simulated_speculation(config: dict) -> SpeculativeConfig:
    """A policy's speculative config, if the simulator can model it."""
    spec = SpeculativeConfig.parse(config)
    if spec.method != "group_suffix" or not spec.trees:
        raise ValueError(
            f"the simulator models grouped multi-path drafts (seer) only, not {spec.method!r} "
            f"(multi_path={spec.multi_path})"
        )
    return spec


def _speculation(policy: RolloutPolicy, acceptance, samples: int) -> SimSpeculation | None:
    if policy.speculative is None:
        return None
    spec = simulated_speculation(policy.speculative)
    if acceptance is None:
        from seer_engine.sim.acceptance import default_acceptance

        acceptance = default_acceptance(samples)
    pinned = StepCostModel(*spec.step_cost) if spec.step_cost else None
    return SimSpeculation(acceptance, spec.budget, spec.num_speculative_tokens, pinned, spec.priority_weight)


def _check_kv_holds(groups: Sequence[SimGroup], max_tokens: int, profile: InstanceProfile) -> None:
    """Every response's prompt and tokens fit one instance's KV, as its rows hold it (whole
    blocks, the last one part-filled): one that does not can never finish, whatever the
    chunk size (its context alone outgrows the instance)."""
    capacity = profile.kv_capacity_tokens
    room = profile.num_blocks * profile.block_size - profile.partial_block_tokens
    for g in groups:
        longest = min(max(g.lengths, default=0), max_tokens)
        if g.prompt_len + longest > room:
            raise ValueError(
                f"group {g.group_id}: its {g.prompt_len}-token prompt and {longest}-token response need KV "
                f"for {g.prompt_len + longest} tokens but an instance holds {capacity} "
                f"(kv_capacity_tokens): raise it or lower max_tokens (a row holds whole "
                f"{profile.block_size}-token blocks, its last part-filled: {room:g} tokens fit)"
            )


def true_lengths(groups: Sequence[SimGroup], max_tokens: int) -> dict[str, int]:
    """What the oracle policy is handed (sample key -> output tokens)."""
    return {sample_key(g.group_id, i): min(n, max_tokens) for g in groups for i, n in enumerate(g.lengths)}


def policy_for(
    name: str,
    groups: Sequence[SimGroup],
    max_tokens: int,
    starvation_s: float,
    history=None,
    context_order: str = "auto",
) -> RolloutPolicy:
    """``history``: the store a ``+history`` policy keeps across iterations;
    ``context_order``: the Context Manager's (``context_manager.ORDERS``)."""
    return make_rollout_policy(
        name, true_lengths=true_lengths(groups, max_tokens), history=history, starvation_s=starvation_s,
        order=context_order,
    )  # fmt: skip


def synthetic_groups(
    prompts: int,
    samples: int,
    max_tokens: int,
    prompt_len: int,
    seed: int,
    mean_tokens: int | None = None,
    iteration: int = 0,
    drift: float = 0.0,
    prompt_len_sigma: float = 0.0,
    prompt_len_corr: float = 0.0,
    across_sigma: float | None = None,
) -> list[SimGroup]:
    """The rollout issue's synthetic generator (fitted to the Qwen3 trace) at a setup's scale:
    its p99 at ``max_tokens``, or its mean at ``mean_tokens`` (a calibrated setup).
    ``iteration`` > 0 samples the same prompts again; prompts have ``prompt_len`` tokens,
    or with ``prompt_len_sigma`` log-normal lengths around it (see ``synthetic_workload``).
    ``across_sigma``: the spread of the groups' log mean lengths (default: the trace's fit)."""
    from seer_engine.workloads.synthetic import synthetic_workload

    shape = {} if across_sigma is None else {"across_sigma": across_sigma}
    workload = synthetic_workload(
        prompts, samples, max_tokens, seed=seed, mean_len=mean_tokens, iteration=iteration, drift=drift,
        prompt_len=prompt_len, prompt_len_sigma=prompt_len_sigma, prompt_len_corr=prompt_len_corr, **shape,
    )  # fmt: skip
    return [SimGroup(f"s{k}", g.prompt_len, g.lengths, g.group_id) for k, g in enumerate(workload)]


def setup_groups(setup, seed: int, iteration: int = 0, drift: float = 0.0) -> list[SimGroup]:
    """A setup's calibrated synthetic workload (``synthetic_groups`` at its scale, prompt
    lengths and spread of group lengths)."""
    return synthetic_groups(
        setup.prompts, setup.samples, setup.max_tokens, setup.prompt_len, seed, setup.mean_tokens,
        iteration=iteration, drift=drift, prompt_len_sigma=setup.prompt_len_sigma,
        prompt_len_corr=setup.prompt_len_corr, across_sigma=setup.across_sigma,
    )  # fmt: skip


def trace_groups(
    trace: str,
    prompts: int,
    samples: int,
    max_tokens: int,
    seed: int,
    iteration: int = 0,
    iterations: int = 1,
) -> list[SimGroup]:
    """Replay a trace's groups, cycled to ``prompts`` groups, with lengths scaled so the
    trace's p99 lands on ``max_tokens`` (``scale_lengths``). Pass ``k`` of a trace group
    takes the next ``samples`` of its responses (cyclically), shifted by ``seed``.
    ``iteration`` of ``iterations`` that repeat the prompts takes the next sibling set
    of every prompt: disjoint sets, so a trace group with fewer than ``samples x
    iterations`` responses is an error (a response met again would be a history seed
    drafting itself). A prompt's identity (the history store's key) carries the seed, as
    a synthetic one does: a fresh seed is a fresh workload, not the same prompts again."""
    from seer_engine.workloads.groups import scale_lengths
    from seer_engine.workloads.traces import load_trace

    source = load_trace(trace)
    if any(g.num_samples < samples for g in source):
        raise ValueError(f"trace {trace!r} has groups with fewer than {samples} responses")
    need = samples * iterations
    used = sorted({(k + seed) % len(source) for k in range(prompts)})
    short = next((source[j] for j in used if source[j].num_samples < need), None)
    if short is not None:
        raise ValueError(
            f"{iterations} iterations of {samples} responses per prompt take {need} different "
            f"responses of each trace group, but group {short.group_id!r} has only "
            f"{short.num_samples}; pass fewer --iterations or --samples"
        )
    scaled = scale_lengths([g.lengths for g in source], max_tokens)
    groups = []
    for k in range(prompts):
        j = (k + seed) % len(source)
        lengths = scaled[j]
        start = ((k // len(source) + seed) * iterations + iteration) * samples
        picked = [lengths[(start + i) % len(lengths)] for i in range(samples)]
        groups.append(SimGroup(f"t{k}", len(source[j].prompt_token_ids), picked, f"trace-{seed}-{k}"))
    return groups


def bench_groups(trace: str, spec: str, samples: int, max_tokens: int, iteration: int = 0) -> list[SimGroup]:
    """The workload ``bench rollout --trace T --groups SPEC --samples N`` replays: the
    same groups, real prompt lengths, and each response's tokens plus its EOS. Iteration
    ``k`` of a rollout that revisits its prompts takes responses ``k*N .. k*N+N-1`` of each
    group, as the benchmark's iterations do (disjoint sibling sets)."""
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.traces import load_trace

    chosen = select_groups(load_trace(trace), spec)
    first = iteration * samples
    short = [g for g in chosen if g.num_samples < first + samples]
    if short:
        raise ValueError(
            f"iteration {iteration + 1} takes responses {first}..{first + samples - 1} of each group, "
            f"but group {short[0].group_id!r} has only {short[0].num_samples}"
        )
    return [
        SimGroup(
            f"t{g.group_id}",
            len(g.prompt_token_ids),
            [min(n + 1, max_tokens) for n in g.lengths[first : first + samples]],
            f"trace-{g.group_id}",
        )
        for g in chosen
    ]
