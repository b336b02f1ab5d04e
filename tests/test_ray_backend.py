"""Engine instances as Ray actors (``--distributed-backend ray``) on a real local Ray
cluster: rollouts give the outputs of one in-process instance, responses move between
actors through the local KV pool, and a killed actor costs nothing but time."""

from __future__ import annotations

import pytest
from pool_workload import BLOCK, outputs_of, pool_config, pool_groups, reference_outputs

from seer_engine.kv_connector.factory import kv_pool_for
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.instances.ray import RayInstance
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import ChunkRequest, InstanceDied
from seer_engine.sampling_params import SamplingParams

ray = pytest.importorskip("ray")  # CI installs it; elsewhere the module is skipped


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module (starting Ray takes seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def reference(model):
    return reference_outputs(model)


@pytest.fixture(scope="module")
def ray_pool(cluster, model):
    """Two actors over the local pool, shared by the tests (the last one kills an actor)."""
    cfg = pool_config(model, 10)
    with EnginePool.start(
        cfg, 2, backend="ray", kv_pool=kv_pool_for("local", cfg, capacity_gib=0.05)
    ) as pool:
        yield pool


def _rollout(pool: EnginePool) -> Dispatcher:
    placement = SeerPlacement(spread_threshold=32, pull_threshold_tokens=0)
    return Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8, placement=placement)


def test_an_engine_config_error_in_an_actor_is_the_callers_value_error(cluster, model):
    """A configuration error raised while an actor builds its engine reaches the caller as
    that ValueError (the CLIs' exit 2 naming it), not a RuntimeError around Ray's text."""
    cfg = pool_config(model, 10, max_model_len=100_000)
    with pytest.raises(ValueError, match=r"max_model_len 100000 exceeds what the model supports \(4096\)"):
        EnginePool.start(cfg, 1, backend="ray")


def test_actors_migrate_through_the_local_pool_and_keep_outputs(ray_pool, reference):
    assert all(isinstance(inst, RayInstance) and inst.backend == "ray" for inst in ray_pool)
    result = _rollout(ray_pool).run(pool_groups())
    assert ray_pool.kv_pool.connector.store.used_slots == 0, "every pool entry is freed at the end"
    m = result.metrics
    assert outputs_of(result.samples) == reference
    assert m.migrations > 0 and m.pool_loads > 0 and m.pool_failures == 0
    assert m.recomputed_tokens < m.migrations * BLOCK, "a restore computes at most a partial block"
    assert m.backend == "ray" and m.kv_connector == "local"
    assert [inst.call("reset_prefix_cache") for inst in ray_pool.alive] == [None, None]
    with pytest.raises(ValueError, match="do not forward"):
        ray_pool.instances[0].call("generate")  # the worker's ValueError, as it was raised


def test_a_failed_submit_is_not_lost(ray_pool):
    inst = ray_pool.instances[0]
    chunk = ChunkRequest("dup/0#0", [5, 6, 7], SamplingParams(max_tokens=4), "dup", "dup/0", [])
    inst.submit(chunk)
    inst.submit(chunk)  # the same request id again: the worker refuses it, and no one waits
    with pytest.raises(RuntimeError, match="failed in submit"):
        inst.abort([chunk.request_id])  # runs after both submits, then reports the refused one
    assert inst.alive and inst.poll_reply() is None


def test_a_killed_actor_requeues_its_responses(ray_pool, reference):
    pool = ray_pool
    rollout = _rollout(pool)
    samples = rollout.start(pool_groups())
    victim = pool.instances[1]
    # Run until the victim holds responses past their first chunk (their last boundary
    # is in the pool), then kill its actor.
    while not victim.books.in_flight or not any(
        s.instance == 1 and s.chunks >= 2 and s.num_generated for v in samples.values() for s in v
    ):
        rollout.step()
    ray.kill(victim.actor)
    while rollout.has_work:
        rollout.step()
    assert all(s.finished for v in samples.values() for s in v)
    assert not victim.alive and rollout.counters.instance_failures == 1
    assert rollout.counters.pool_loads > 0, "responses of the dead actor resumed from the pool"
    assert pool.kv_pool.connector.store.used_slots == 0
    assert outputs_of(samples) == reference
    with pytest.raises(InstanceDied):
        victim.abort(["nothing"])
