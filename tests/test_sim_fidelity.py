"""Fidelity at small scale: the simulator, fed a step-time model fitted on this
machine, reproduces the real engine's rollout (2 instances, trace replay, every
policy) within 15% in makespan and throughput.

The step-time model is fitted on the real rollouts' own steps (``recording_steps``),
taken in this same test: a profile measured minutes earlier on a shared 2-core
machine differs from the run it is compared with by as much as the tolerance, and
what is tested here is the simulator's scheduling, not the machine's noise. The
fit uses the steps of the policies without speculation (drafts make steps of
unequal shape); ``seer`` is simulated with that model and the acceptance model
fitted from trace replay.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from seer_engine.core.policies import make_rollout_policy
from seer_engine.core.request import Group
from seer_engine.engine.config import EngineConfig
from seer_engine.model_executor.model_config import ModelConfig
from seer_engine.model_executor.tiny_model import make_tiny_model
from seer_engine.rollout.engine_pool import EnginePool
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.replay import TraceReplay
from seer_engine.rollout.rollout import Rollout
from seer_engine.rollout.workload import load_trace, select_groups, traces_dir
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.profiler import fit_step_time, recording_steps
from seer_engine.sim.simulator import bench_groups, policy_for, simulate

TRACE = traces_dir() / "qwen3-8b-mcq-cot.jsonl.gz"
GROUPS, SAMPLES, MAX_TOKENS, CHUNK, KV_BLOCKS, MAX_SEQS = "4", 8, 512, 128, 128, 16
POLICIES = ("baseline", "divided", "context", "seer", "oracle")
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """Each policy on the real engine (2 in-process instances), and the steps they took."""
    if not TRACE.is_file():
        pytest.skip(f"{TRACE} not found")
    model = make_tiny_model(
        tmp_path_factory.mktemp("fidelity"), tokenizer=TRACE.parent / "bpe32k-tokenizer.json"
    )
    trace = select_groups(load_trace(TRACE), GROUPS, SAMPLES)
    max_len = max(len(g.prompt_token_ids) for g in trace) + MAX_TOKENS + 1
    cfg = EngineConfig(model=str(model), num_kv_blocks=KV_BLOCKS, max_num_seqs=MAX_SEQS, num_threads=1,
                       max_model_len=max_len)  # fmt: skip
    responses = {f"t{g.group_id}/{j}": list(r) for g in trace for j, r in enumerate(g.response_token_ids)}
    replay = TraceReplay(responses, min(ModelConfig.from_pretrained(model).eos_token_ids))
    lengths = {k: min(len(v) + 1, MAX_TOKENS) for k, v in responses.items()}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results, points = {}, []
    for name in POLICIES:
        policy = make_rollout_policy(name, true_lengths=lengths, starvation_s=120.0)
        groups = [Group(f"t{g.group_id}", list(g.prompt_token_ids), params, SAMPLES, order=k)
                  for k, g in enumerate(trace)]  # fmt: skip
        with EnginePool.for_policy(cfg, policy, 2, replay) as pool, ExitStack() as stack:
            steps = [stack.enter_context(recording_steps(inst.engine, kv_per_query=True)) for inst in pool]
            results[name] = Rollout(pool, policy, CHUNK, placement=SeerPlacement()).run(groups)
            if policy.speculative is None:
                points += [p for s in steps for p in s]
    return results, points


def test_simulated_makespan_and_throughput_within_15_percent_of_the_real_engine(real_runs):
    results, points = real_runs
    profile = InstanceProfile(
        "fitted-on-the-real-rollouts", fit_step_time(points, kv_per_query=True),
        kv_capacity_tokens=KV_BLOCKS * 16, max_num_seqs=MAX_SEQS, max_num_batched_tokens=2048,
    )  # fmt: skip
    groups = bench_groups(str(TRACE), GROUPS, SAMPLES, MAX_TOKENS)
    report = []
    for name in POLICIES:
        real = results[name].metrics
        sim = simulate(groups, policy_for(name, groups, MAX_TOKENS, 120.0), profile, 2, MAX_TOKENS, CHUNK,
                       SeerPlacement(), pooled=False).metrics  # fmt: skip
        assert sim.output_tokens == real.output_tokens, "the same responses, to the token"
        ratio = sim.makespan_s / real.makespan_s
        speed = sim.throughput_tokens_per_s / real.throughput_tokens_per_s
        report.append(f"{name}: makespan sim/real {ratio:.3f}, throughput {speed:.3f} (steps {sim.steps:.0f}/"
                      f"{real.steps}, drafts {sim.draft_tokens_verified:.0f}/{real.draft_tokens_verified}, "
                      f"busy {sum(sim.instance_busy_s):.2f}/{sum(real.instance_busy_s):.2f}s)")  # fmt: skip
    print("\n".join(report))
    for line in report:
        name = line.split(":")[0]
        sim_over_real = float(line.split("makespan sim/real ")[1].split(",")[0])
        assert abs(sim_over_real - 1) <= TOLERANCE, "\n".join(report)
