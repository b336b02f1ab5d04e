"""Rollout serving calls that fail on one instance leave the instances in one state."""

from __future__ import annotations

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.rollout.backend import RolloutBackend
from seer_engine.rollout.config import RolloutConfig
from seer_engine.sampling_params import SamplingParams


def _two_instances(model) -> RolloutBackend:
    config = EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=8)
    rollout = RolloutConfig(rollout_mode=True, instances=2, chunk_tokens=8, distributed_backend="inproc")
    return RolloutBackend(config, rollout)


def _fail_on_second(
    engine: RolloutBackend, monkeypatch, method: str, error: str, arg: str | None = None
) -> None:
    """Instance 1's ``method`` (with ``arg`` first, when given) raises ``error``."""
    second = engine.pool.instances[1]
    real_call = second.call

    def call(name, *args):
        if name == method and (arg is None or args[0] == arg):
            raise RuntimeError(error)
        return real_call(name, *args)

    monkeypatch.setattr(second, "call", call)


def _serves(engine: RolloutBackend, max_tokens: int, n: int) -> list[int]:
    """The output lengths of one seeded group run to its end."""
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, seed=0))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [len(c.token_ids) for c in done["r"].outputs]


def test_a_sleep_that_fails_on_one_instance_leaves_none_asleep(tiny_model, monkeypatch):
    """Instance 0 slept (its KV cache freed), instance 1 failed: the backend said awake and
    went on dispatching chunks to an instance with no KV cache."""
    engine = _two_instances(tiny_model())
    try:
        _fail_on_second(engine, monkeypatch, "sleep", "the device failed")
        with pytest.raises(RuntimeError, match="device failed"):
            engine.sleep()
        assert not engine.is_sleeping
        assert not any(inst.engine.is_sleeping for inst in engine.pool.instances)
        assert _serves(engine, 20, 4) == [20] * 4
    finally:
        engine.close()


def test_a_wake_up_that_fails_on_one_instance_leaves_all_asleep(tiny_model, monkeypatch):
    """Instance 0 woke (its KV cache allocated again), instance 1 failed: the backend still
    says asleep, so instance 0 would hold memory the trainer was promised. It sleeps
    again; a retried wake-up wakes both, and they serve."""
    engine = _two_instances(tiny_model())
    try:
        engine.sleep()
        _fail_on_second(engine, monkeypatch, "wake_up", "out of memory")
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.wake_up()
        assert engine.is_sleeping and all(inst.engine.is_sleeping for inst in engine.pool.instances)
        monkeypatch.undo()
        engine.wake_up()
        assert not engine.is_sleeping and not any(inst.engine.is_sleeping for inst in engine.pool.instances)
        assert _serves(engine, 10, 2) == [10] * 2
    finally:
        engine.close()


def test_a_weight_update_that_fails_on_one_instance_leaves_every_instance_on_the_old_weights(
    tiny_model, monkeypatch
):
    """Instance 0 took the new weights, instance 1 failed (out of memory, say): the call
    failed and the version stayed, but the rollout went on sampling from two models."""
    old, new = tiny_model(), tiny_model(seed=1)
    engine = _two_instances(old)
    try:
        _fail_on_second(engine, monkeypatch, "update_weights", "out of memory", str(new))
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.update_weights(new)
        assert [inst.engine.model_config.path for inst in engine.pool.instances] == [old, old]
        monkeypatch.undo()
        engine.update_weights(new)  # a later update applies everywhere
        assert [inst.engine.model_config.path for inst in engine.pool.instances] == [new, new]
    finally:
        engine.close()


def test_a_rollback_that_fails_too_is_named_and_reported_until_an_update_succeeds(
    tiny_model, monkeypatch, tmp_path
):
    """The update failed on instance 1 and instance 0 could not go back (its old weights'
    folder was deleted, as RL runs do with old checkpoints): the error says the instances
    now hold different weights, /health says so, and the next good update clears it."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_model(), old)
    new = tiny_model(seed=1)
    engine = _two_instances(old)
    try:
        shutil.rmtree(old)
        _fail_on_second(engine, monkeypatch, "update_weights", "out of memory", str(new))
        assert engine.health().degraded is None
        with pytest.raises(RuntimeError, match="out of memory; and a failed weight update left the"):
            engine.update_weights(new)
        assert "different weights" in engine.health().degraded and str(old) in engine.health().degraded
        monkeypatch.undo()
        engine.update_weights(new)
        assert [inst.engine.model_config.path for inst in engine.pool.instances] == [new, new]
        assert engine.health().degraded is None
    finally:
        engine.close()
