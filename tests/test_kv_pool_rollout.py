"""The global KV pool in a rollout: responses that move between instances load their
context instead of recomputing it, outputs do not change, pool entries are gone at
the end, and a lost instance process costs nothing but time."""

from __future__ import annotations

import pytest
from pool_workload import BLOCK, greedy, outputs_of, pool_config, pool_groups, reference_outputs

from seer_engine.kv_connector.factory import kv_pool_for
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.placement import SeerPlacement
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def reference(model):
    return reference_outputs(model)


def _pooled_rollout(model, backend: str, kv: str = "local", kv_blocks: int = 10):
    cfg = pool_config(model, kv_blocks)
    pool = EnginePool.start(cfg, 2, backend=backend, kv_pool=kv_pool_for(kv, cfg, capacity_gib=0.05))
    # (mooncake: a master on 127.0.0.1 started here, stopped when the pool closes)
    placement = SeerPlacement(spread_threshold=32, pull_threshold_tokens=0)
    return pool, Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8, placement=placement)


@pytest.mark.parametrize("backend,kv", [("inproc", "local"), ("mp", "local"), ("mp", "mooncake")])
def test_migration_through_the_pool_keeps_outputs_and_skips_prefill(model, reference, backend, kv):
    pool, rollout = _pooled_rollout(model, backend, kv)
    with pool:
        result = rollout.run(pool_groups())
        connector = pool.kv_pool.connector
        samples = [s for v in result.samples.values() for s in v]
        left = [connector.lookup(s.key, [*s.group.prompt_token_ids, *s.output_token_ids]) for s in samples]
        assert len(left) == 12 and left == [0] * 12, "every pool entry is freed when its response finishes"
    m = result.metrics
    assert outputs_of(result.samples) == reference
    assert m.migrations > 0 and m.pool_loads > 0 and m.pool_failures == 0, m
    # A restore computes at most the context's last partial block, never its prefix.
    assert m.recomputed_tokens < m.migrations * BLOCK
    assert m.pool_saved_blocks > 0 and m.kv_connector == kv and m.backend == backend


def test_a_modeled_clock_prices_pool_loads_as_the_simulator_does(model, reference):
    """On a modeled clock a pool load costs the instance that loads ``pool_load_s`` of
    the tokens it pulled, saves run in the background, and the pool time reported is
    that modeled time (never the CPU's seconds beside modeled ones)."""
    from seer_engine.sim.profile import StepTimeModel

    per_token = 1e-3
    cfg = pool_config(model, 10)
    step = StepTimeModel(a_s=0.01, b_s_per_token=1e-4, c_s_per_kv_token=1e-6, d_s_per_logit=0.0)
    kv_pool = kv_pool_for("local", cfg, capacity_gib=0.05)
    pool = EnginePool.start(cfg, 2, kv_pool=kv_pool, step_timer=step, pool_load_s=lambda n: n * per_token)
    placement = SeerPlacement(spread_threshold=32, pull_threshold_tokens=0)
    with pool:
        result = Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8, placement=placement).run(
            pool_groups()
        )
    m = result.metrics
    assert outputs_of(result.samples) == reference
    assert m.pool_loads > 0 and m.pool_save_s == 0.0
    assert m.pool_load_s == pytest.approx(m.pool_loaded_tokens * per_token)
    # every step costs at least the fixed term, and the loads come on top of the steps
    assert sum(m.instance_busy_s) >= m.steps * step.a_s + m.pool_load_s


def test_without_a_pool_moves_recompute(model, reference):
    pool, rollout = _pooled_rollout(model, "inproc", kv="none")
    with pool:
        result = rollout.run(pool_groups())
    m = result.metrics
    assert outputs_of(result.samples) == reference
    assert m.migrations > 0 and m.pool_loads == 0
    assert m.recomputed_tokens >= m.migrations * 8, "each move recomputes at least a chunk of output"


def test_a_dead_instance_process_requeues_its_responses(model, reference):
    pool, rollout = _pooled_rollout(model, "mp", kv_blocks=64)
    with pool:
        samples = rollout.start(pool_groups())
        victim = pool.instances[1]
        # Run until the victim holds responses past their first chunk (their last
        # boundary is in the pool), then kill its process.
        while not any(
            s.instance == 1 and s.chunks >= 2 and s.num_generated for v in samples.values() for s in v
        ):
            rollout.step()
        victim.process.kill()
        while rollout.has_work:
            rollout.step()
        outputs = outputs_of(samples)
        assert all(s.finished for v in samples.values() for s in v)
        assert not victim.alive and rollout.counters.instance_failures == 1
        assert rollout.counters.pool_loads > 0, "responses of the dead instance resumed from the pool"
        assert pool.kv_pool.connector.store.used_slots == 0
    assert outputs == reference


def test_draft_server_keeps_instance_processes_drafting_from_siblings(model):
    """Group suffix trees replicated in each instance process, kept in sync by the
    draft server: siblings on other instances feed the drafts (greedy siblings agree,
    so their drafts are accepted), outputs do not change."""
    spec = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
    cfg = pool_config(model, 64, speculative_config=spec)
    with EnginePool.start(cfg, 2, backend="mp") as pool:
        result = Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8).run(pool_groups(0.0))
        served = pool.draft_server.stats.served_tokens
        assert pool.draft_server.num_groups == 0, "finished groups leave the draft server"
    assert outputs_of(result.samples) == reference_outputs(model, 0.0)
    assert served > 0 and result.metrics.draft_tokens_accepted > 0


def test_an_abort_racing_the_step_that_ended_the_chunk_gets_its_tokens(model):
    """The instance process ends a chunk, then an abort arrives before the buffer has
    read that step's reply: the abort still answers with the chunk's tokens."""
    from seer_engine.rollout.types import ChunkRequest
    from seer_engine.sampling_params import SamplingParams

    with EnginePool.start(pool_config(model, 16), 1, backend="mp") as pool:
        inst = pool.instances[0]
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        inst.submit(ChunkRequest("g/0#0", [5, 6, 7], params, "g", "g/0", []))
        inst.start_step()
        type(inst).wait_any([inst], timeout=60)  # the step's reply is in the pipe, unread
        (out,) = inst.abort(["g/0#0"])
        assert out.finished and len(out.outputs[0].token_ids) == 1
        reply = inst.poll_reply()
        assert [o.request_id for o in reply.outputs] == ["g/0#0"]


def test_a_dead_mooncake_master_makes_moves_recompute(model, reference):
    """Kill the master mid-rollout: pool calls fail fast, moved responses recompute,
    the outputs stay the same."""
    pool, rollout = _pooled_rollout(model, "inproc", kv="mooncake")
    with pool:
        samples = rollout.start(pool_groups())
        while rollout.counters.pool_loads == 0 and rollout.has_work:
            rollout.step()
        assert rollout.counters.pool_loads > 0 and rollout.has_work, (
            "a move loaded from the pool before the kill"
        )
        pool.kv_pool.master.stop()
        while rollout.has_work:
            rollout.step()
        m = rollout.metrics(samples)
    assert outputs_of(samples) == reference
    assert m.pool_failures > 0 and m.migrations > m.pool_loads


def test_a_pool_lock_held_by_a_stuck_process_fails_calls_instead_of_hanging(model, monkeypatch):
    """A process stopped while it holds the local pool's lock (a hung instance) must not
    hang the others: their calls fail after LOCK_TIMEOUT_S (then at once), they recompute,
    and a free that failed is done with a later one, so no entry is left behind."""
    import fcntl
    import os

    import seer_engine.kv_connector.local as local

    monkeypatch.setattr(local, "LOCK_TIMEOUT_S", 0.2)
    cfg = pool_config(model, 16)
    with EnginePool.start(cfg, 1, kv_pool=kv_pool_for("local", cfg, capacity_gib=0.05)) as pool:
        engine, connector = pool.instances[0].engine, pool.kv_connector
        prompt = list(range(2, 2 + 2 * BLOCK))
        context = prompt + greedy(engine, "r", prompt, BLOCK, [])
        saved = connector.save("a", engine, context)  # the full blocks (the last token has no KV yet)
        assert saved >= 2 * BLOCK
        holder = os.open(connector.store.spec.lock_path, os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: as if another process held it
        try:
            assert connector.lookup("a", context) == 0, "the pool reads as empty: the request recomputes"
            assert connector.save("b", engine, context) == 0
            connector.free("a")
            assert connector.stats.failures == 3
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
        assert connector.lookup("a", context) == saved, "a free that failed removed nothing"
        assert connector.save("b", engine, context) == saved
        connector.free("b")
        assert connector.store.used_slots == 0, "the failed free of 'a' was done with the next one"


def test_a_weight_update_drops_the_pools_kv_with_the_prefix_caches(model):
    """Instances drop their prefix caches at a weight update (that KV is stale); the pool
    holds the same KV of the responses between chunks and must drop it too, or a response
    that moves loads old-weight KV where one that stays recomputes."""
    from seer_engine.rollout.backend import RolloutBackend
    from seer_engine.rollout.config import RolloutConfig
    from seer_engine.sampling_params import SamplingParams

    rollout = RolloutConfig(policy="context", instances=2, chunk_tokens=8, distributed_backend="inproc",
                            kv_connector="local", kv_pool_gib=0.05, pool_pull_tokens=0)  # fmt: skip
    backend = RolloutBackend(pool_config(model, 16), rollout)
    try:
        params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0, seed=5, n=4)
        samples = backend.add_request("a", pool_groups()[2].prompt_token_ids, params)
        connector = backend.pool.kv_connector

        def pooled() -> list[int]:
            contexts = [(s.key, [*s.group.prompt_token_ids, *s.output_token_ids]) for s in samples]
            return [connector.lookup(key, context) for key, context in contexts]

        while backend.has_unfinished_requests() and not any(pooled()):
            backend.step()
        assert any(pooled()), "a chunk ended and saved its KV before the update"
        backend.update_weights(str(model))
        assert pooled() == [0] * 4
        while backend.has_unfinished_requests():
            backend.step()
        assert all(s.num_generated == 48 for s in samples)
    finally:
        backend.close()


def test_cli_names_an_unreachable_mooncake_master(tmp_path, capsys):
    from seer_engine.entrypoints.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "max_tokens": 4}\n')
    args = ["rollout", "--model", "tiny", "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
            "--instances", "2", "--kv-connector", "mooncake", "--mooncake-master", "127.0.0.1:1"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert "no Mooncake master answers at 127.0.0.1:1" in capsys.readouterr().err


def test_in_process_instances_count_each_pool_call_once(model):
    """In-process instances and their dispatcher share one pool handle: each reports the
    calls it made itself, so the rollout's totals are the handle's, not N times them."""
    pool, rollout = _pooled_rollout(model, "inproc")
    with pool:
        m = rollout.run(pool_groups()).metrics
        shared = pool.kv_pool.connector.stats
        assert m.pool_saved_blocks == shared.saved_blocks > 0
        assert m.pool_save_s + m.pool_load_s == pytest.approx(shared.save_s + shared.load_s)
        assert m.pool_failures == shared.failures
        own = [inst.books.connector_stats.loaded_blocks for inst in pool.instances]
        assert sum(own) == shared.loaded_blocks > 0


def test_a_weight_update_whose_pool_free_fails_never_lets_a_move_load_old_kv(model, monkeypatch):
    """The free of the pool's KV at a weight update can fail (the pool briefly locked or
    unreachable); once the pool serves again, a response that moves must still find
    nothing of the old weights there, not load the KV the failed free left behind."""
    import fcntl
    import os

    import seer_engine.kv_connector.local as local
    from seer_engine.rollout.backend import RolloutBackend
    from seer_engine.rollout.config import RolloutConfig
    from seer_engine.sampling_params import SamplingParams

    monkeypatch.setattr(local, "LOCK_TIMEOUT_S", 0.2)
    rollout = RolloutConfig(policy="context", instances=2, chunk_tokens=8, distributed_backend="inproc",
                            kv_connector="local", kv_pool_gib=0.05, pool_pull_tokens=0)  # fmt: skip
    backend = RolloutBackend(pool_config(model, 16), rollout)
    try:
        params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, seed=5)
        (sample,) = backend.add_request("a", pool_groups()[2].prompt_token_ids, params)
        dispatcher = backend.dispatcher
        connector = backend.pool.kv_connector.shared  # what every in-process instance calls
        while not (sample in dispatcher.buffer and sample.num_generated >= 8):
            backend.step()
        assert connector.stats.saved_blocks > 0, "the chunk that ended saved its KV"
        holder = os.open(connector.store.spec.lock_path, os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)  # the pool is locked through the update
        try:
            backend.update_weights(str(model))
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
        assert connector.stats.failures == 1, "the update's free of the pooled KV failed"
        loads = dispatcher.counters.pool_loads
        dispatcher.lose_instance(backend.pool.instances[sample.instance], "moved on purpose")
        while backend.has_unfinished_requests():
            backend.step()
        assert dispatcher.counters.migrations >= 1 and sample.num_generated == 32
        assert dispatcher.counters.pool_loads == loads, "a move loaded KV of the old weights"
    finally:
        backend.close()


def test_instances_that_cannot_open_the_pool_recompute(model, reference):
    """An instance that cannot open the pool (a Ray actor on another host than the local
    pool's, a container without its /dev/shm, a master it cannot reach) runs without it:
    its moves recompute and /health's counts say so, instead of failing the rollout's start."""
    import dataclasses

    cfg = pool_config(model, 10)
    kv_pool = kv_pool_for("local", cfg, capacity_gib=0.05)
    elsewhere = dataclasses.replace(kv_pool.spec.store_spec, data_name="seer_kv_elsewhere_data",
                                    index_name="seer_kv_elsewhere_index")  # fmt: skip
    kv_pool.spec = dataclasses.replace(kv_pool.spec, store_spec=elsewhere)
    placement = SeerPlacement(spread_threshold=32, pull_threshold_tokens=0)
    with EnginePool.start(cfg, 2, backend="mp", kv_pool=kv_pool) as pool:
        result = Dispatcher(pool, make_rollout_policy("context"), chunk_tokens=8, placement=placement).run(
            pool_groups()
        )
        downs = [inst.books.connector_stats.down or "" for inst in pool.instances]
    m = result.metrics
    assert outputs_of(result.samples) == reference
    assert m.migrations > 0 and m.pool_loads == 0 and m.pool_failures >= 2
    assert all("seer_kv_elsewhere_data" in down for down in downs), downs


def test_entries_a_failed_free_left_are_freed_once_the_server_is_idle(model, monkeypatch):
    """The pool failed the frees of the last responses to finish (its lock briefly held):
    with nothing finishing after them no later free retries them, so an idle server must,
    or their blocks stay in the pool for good (a local pool never evicts)."""
    import fcntl
    import os

    import seer_engine.kv_connector.local as local
    from seer_engine.rollout.backend import RolloutBackend
    from seer_engine.rollout.config import RolloutConfig
    from seer_engine.sampling_params import SamplingParams

    monkeypatch.setattr(local, "LOCK_TIMEOUT_S", 0.2)
    rollout = RolloutConfig(policy="context", instances=1, chunk_tokens=8, distributed_backend="inproc",
                            kv_connector="local", kv_pool_gib=0.05)  # fmt: skip
    backend = RolloutBackend(pool_config(model, 16), rollout)
    try:
        params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, seed=5)
        (sample,) = backend.add_request("a", pool_groups()[2].prompt_token_ids, params)
        store = backend.pool.kv_connector.store
        while not (sample in backend.dispatcher.buffer and sample.num_generated >= 8):
            backend.step()
        assert store.used_slots > 0
        holder = os.open(store.spec.lock_path, os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            while backend.has_unfinished_requests():
                backend.step()
            failures = backend.health().kv_pool_failures
            backend.stats()  # what the idle engine thread asks every second: still locked
            assert backend.health().kv_pool_failures == failures, "a failed retry is no new failure"
        finally:
            fcntl.flock(holder, fcntl.LOCK_UN)
            os.close(holder)
        assert sample.num_generated == 32 and store.used_slots > 0, "the free at its finish failed"
        backend.stats()
        assert store.used_slots == 0
    finally:
        backend.close()
