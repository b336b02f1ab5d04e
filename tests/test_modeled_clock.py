"""Real engines on a modeled clock: every step priced once by its shape, events taken
in modeled-time order, the report's figures read off those clocks."""

from __future__ import annotations

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams
from seer_engine.sim.profile import StepTimeModel

TIMER = StepTimeModel(a_s=0.02, b_s_per_token=1e-3, c_s_per_kv_token=1e-6)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _groups(max_tokens: int = 24) -> list[Group]:
    """Prompts of very different lengths, so prefills of unequal cost overlap decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, seed=11)
    prompts = [list(range(10, 10 + n)) for n in (7, 60, 40, 5)]
    return [Group(f"g{i}", p, params, 3, max_tokens) for i, p in enumerate(prompts)]


def _pool(model, instances: int = 3, **kw) -> EnginePool:
    cfg = EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=4, num_threads=1)
    return EnginePool.start(cfg, instances, step_timer=TIMER, **kw)


def test_step_replies_are_taken_in_modeled_time_order(model):
    """The Request Buffer sees each step's end at its modeled time, earliest first, as
    the simulator does: a step that ends later is not handled (its chunks re-queued,
    its finishes stamped, dispatches made) before another instance's earlier one."""
    policy = make_rollout_policy("context")
    with _pool(model) as pool:
        rollout = Dispatcher(pool, policy, chunk_tokens=8)
        samples = rollout.start(_groups())
        times = []
        while rollout.has_work:
            rollout.step()
            times.append(rollout.now)
    assert all(s.finished for group in samples.values() for s in group)
    assert times == sorted(times)


def test_grouped_drafts_give_the_same_modeled_rollout_on_either_backend(model):
    """Instance processes take siblings' tokens from the draft server, in-process ones
    from a shared tree: on a modeled clock both see a step's tokens from the same
    moment, so drafts, acceptance and times agree."""

    def run(backend: str):
        policy = make_rollout_policy("seer")
        policy.speculative = {**policy.speculative, "step_cost": [TIMER.a_s, TIMER.b_s_per_token]}
        with _pool(model, backend=backend, policy=policy) as pool:
            return Dispatcher(pool, policy, chunk_tokens=8).run(_groups(32)).metrics

    inproc, processes = run("inproc"), run("mp")
    assert inproc.draft_tokens_verified > 0
    for key in ("makespan_s", "steps", "draft_tokens_verified", "draft_tokens_accepted", "instance_busy_s"):
        assert getattr(inproc, key) == getattr(processes, key), key
