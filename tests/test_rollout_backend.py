"""The rollout-mode backend the server drives: user requests become responses in the
Request Buffer, requests sharing a prompt form one group, outputs equal the plain
engine's, aborts keep partial tokens and leave nothing behind."""

from __future__ import annotations

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.backend import RolloutBackend
from seer_engine.rollout.config import RolloutConfig
from seer_engine.sampling_params import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _config(model, **kw) -> EngineConfig:
    return EngineConfig(model=str(model), **{"num_kv_blocks": 64, "max_num_seqs": 8, **kw})


def _backend(model, instances: int = 2, chunk: int = 8, backend: str = "inproc", **kw):
    """In-process instances by default; ``mp`` puts each in its own process with the
    local shared-memory KV pool, and placement that moves responses when loads differ
    (spread 0: the least-loaded instance; pull threshold 0: moves load from the pool)."""
    moves = {"migration_spread": 0, "pool_pull_tokens": 0} if backend == "mp" else {}
    rollout = RolloutConfig(
        rollout_mode=True, instances=instances, chunk_tokens=chunk, distributed_backend=backend, **moves
    )
    return RolloutBackend(_config(model, **kw), rollout)


def _drain(engine) -> dict[str, RequestOutput]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _assert_idle(engine: RolloutBackend) -> None:
    assert not engine.dispatcher.buffer and engine.dispatcher.num_live == 0
    for inst in engine.pool:
        assert inst.books.reserved_blocks == 0 and not inst.books.in_flight
    for snap in [inst.call("stats") for inst in engine.pool.alive]:
        assert snap.kv_used_blocks == 0 and snap.running == snap.waiting == 0
    store = getattr(engine.pool.kv_pool.connector, "store", None)
    if store is not None:
        assert store.used_slots == 0, "pool entries are freed when responses finish"


def test_requests_sharing_a_prompt_form_one_group(model):
    engine = _backend(model)
    p = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=1)
    singles = [engine.add_request(f"a{i}", [5, 6, 7, 8], p) for i in range(4)]
    pair = engine.add_request("b", [9, 9, 9], p.clone(n=2))
    named = [engine.add_request(rid, [1, 2], p, group_id="mine") for rid in ("c", "d")]
    first_group = singles[0][0].group
    assert all(s[0].group is first_group for s in singles) and first_group.n == 4
    assert [s[0].sample_index for s in singles] == [0, 1, 2, 3]  # a0 is the group's probe
    assert pair[0].group is not first_group and [s.sample_index for s in pair] == [0, 1]
    assert named[0][0].group is named[1][0].group
    with pytest.raises(InvalidRequestError, match="different prompt"):
        engine.add_request("e", [3], p, group_id="mine")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("b", [3], p)

    done = _drain(engine)
    assert sorted(done) == ["a0", "a1", "a2", "a3", "b", "c", "d"]
    assert all(len(c.token_ids) == 20 for out in done.values() for c in out.outputs)
    assert engine.dispatcher.policy.context._groups == {}, "finished groups are forgotten"
    again = engine.add_request("a-next", [5, 6, 7, 8], p)  # next iteration: a fresh group
    assert again[0].group is not first_group and again[0].sample_index == 0
    _drain(engine)
    _assert_idle(engine)


@pytest.mark.parametrize("backend", ["inproc", "mp"])
def test_same_outputs_as_the_plain_engine(model, backend):
    """Chunking across two instances changes nothing: tokens, text (stop strings
    trimmed), finish reasons, logprobs."""
    requests = [
        ("greedy", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)),
        ("seeded", [11, 12], SamplingParams(temperature=1.0, max_tokens=25, seed=3, n=3, logprobs=2)),
        ("text", "Once upon a time", SamplingParams(temperature=0.8, max_tokens=21, seed=9, min_tokens=10)),
    ]
    plain = LLMEngine(_config(model))
    rollout = _backend(model, chunk=6, backend=backend)
    for engine in (plain, rollout):
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
    want, got = _drain(plain), _drain(rollout)
    for rid, _, _ in requests:
        for a, b in zip(want[rid].outputs, got[rid].outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.index) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.index,
            )
            if a.logprobs is not None:
                assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]
                assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
    assert len(rollout.dispatcher.dispatch_log) > sum(p.n for _, _, p in requests), "responses ran in chunks"
    _assert_idle(rollout)
    if backend == "mp":  # chunk ends went to the shared-memory pool (moves: test_kv_pool_rollout)
        assert sum(inst.books.connector_stats.saved_blocks for inst in rollout.pool) > 0
    rollout.close()


def test_a_streamed_request_gets_each_logprob_once_from_its_instance(model, monkeypatch):
    """Streaming progress from an instance carries only the logprob entries it has not
    sent (the whole chunk's at every step made a long stream with logprobs quadratic on
    the thread that serves every request); the response shows all of them at every step,
    across chunk boundaries, and ends with the plain engine's."""
    from seer_engine.rollout.instances.worker import InstanceWorker

    sent = []
    step = InstanceWorker.step

    def counted(self, *args):
        reply = step(self, *args)
        sent.extend(len(o.outputs[0].logprobs or []) for o in reply.outputs if not o.finished)
        return reply

    monkeypatch.setattr(InstanceWorker, "step", counted)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, n=2, logprobs=2, ignore_eos=True)
    plain = LLMEngine(_config(model))
    plain.add_request("s", [11, 12], params)
    rollout = _backend(model, chunk=12)
    rollout.add_request("s", [11, 12], params, stream=True)
    last = None
    while rollout.has_unfinished_requests():
        for last in rollout.step():
            assert all(len(c.logprobs) == len(c.token_ids) for c in last.outputs)
    assert sum(sent) <= 2 * 40, "each entry sent once"
    for a, b in zip(_drain(plain)["s"].outputs, last.outputs, strict=True):
        assert a.token_ids == b.token_ids
        # The same entries and ranks; the values to float noise: a chunk resumed on another
        # instance recomputes its context as a prefill, which torch ops round differently.
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert {t: e.rank for t, e in x.items()} == {t: e.rank for t, e in y.items()}
            assert [y[t].logprob for t in x] == pytest.approx([e.logprob for e in x.values()], abs=1e-4)
    _assert_idle(rollout)
    rollout.close()


def test_context_policy_runs_one_probe_per_group_first(model):
    engine = _backend(model, instances=1, chunk=4, max_num_seqs=2)
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    for g in range(3):
        engine.add_request(f"g{g}", [20 + g] * (3 + g), p.clone(n=4))
    _drain(engine)
    log = [key for key, _ in engine.dispatcher.dispatch_log]
    first = log[:3]
    assert all(key.endswith("/0") for key in first) and len({k.split("/")[0] for k in first}) == 3
    _assert_idle(engine)


@pytest.mark.parametrize("backend", ["inproc", "mp"])
def test_abort_keeps_partial_tokens_and_frees_everything(model, backend):
    engine = _backend(model, chunk=8, backend=backend)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True, n=3))
    engine.add_request("y", [8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    done = {}
    while max(len(s.output_token_ids) for s in engine._requests["x"].samples) <= 12:
        done.update((o.request_id, o) for o in engine.step())  # past the first chunk boundary
    (out,) = engine.abort_request(["x", "unknown"])
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert any(len(c.token_ids) > 8 for c in out.outputs) and all(len(c.token_ids) < 60 for c in out.outputs)
    done.update(_drain(engine))
    assert done["y"].outputs[0].finish_reason == "length" and len(done["y"].outputs[0].token_ids) == 5
    _assert_idle(engine)
    engine.close()


def test_sleep_refuses_in_flight_requests_and_config_errors(model):
    engine = _backend(model)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="in flight"):
        engine.sleep()
    _drain(engine)
    engine.sleep()
    assert engine.is_sleeping and all(i.engine.is_sleeping for i in engine.pool)
    engine.wake_up()
    assert engine.stats().kv_total_blocks == 128
    for bad, needle in (
        (dict(instances=0), "--instances"),
        (dict(chunk_tokens=0), "--chunk-tokens"),
        (dict(policy="oracle"), "unknown rollout policy"),
        (dict(distributed_backend="slurm"), "--distributed-backend"),
        (dict(kv_connector="redis"), "--kv-connector"),
        (dict(mooncake_master="127.0.0.1:5"), "needs --kv-connector mooncake"),
        (dict(kv_connector="mooncake", mooncake_master="nohost"), "--mooncake-master: .*'host:port'"),
        (dict(kv_connector="mooncake", mooncake_master="http://m:50051"), "--mooncake-master: .*'host:port'"),
        (dict(kv_connector="mooncake", mooncake_master="m:99999"), "port 1-65535"),
        (dict(kv_pool_gib=0), "--kv-pool-gib"),
        (dict(kv_pool_gib=float("nan")), "--kv-pool-gib must be a finite number"),
        (dict(instance_timeout_s=float("nan")), "--instance-timeout must be a finite number"),
        (dict(instance_load_timeout_s=0), "--instance-load-timeout must be a finite number > 0, got 0"),
        (dict(starvation_s=float("inf")), "--starvation-s must be a finite number"),
        (dict(context_order="longest"), "--context-order must be one of \\['auto', 'wait', 'estimate'\\]"),
        (dict(history="memory", history_half_life=float("nan")), "--history-half-life must be > 0, got nan"),
        (dict(history_half_life=2.0), "--history-half-life decays the history store's lengths: it needs"),
        (dict(history="off", history_half_life=2.0), "--history-half-life decays the history store's"),
    ):
        with pytest.raises(ValueError, match=needle):
            RolloutConfig(**bad)


def test_a_long_running_backend_keeps_bounded_logs(model, monkeypatch):
    """A server runs for days: the dispatch log and the per-instance step timelines keep
    only the most recent entries."""
    import seer_engine.rollout.backend as backend_module

    monkeypatch.setattr(backend_module, "SERVER_LOG_LIMIT", 20)
    engine = _backend(model, chunk=4)
    p = SamplingParams(max_tokens=16, ignore_eos=True, n=2)
    for i in range(8):
        engine.add_request(f"r{i}", [5, 6, 7, i], p)
    assert len(_drain(engine)) == 8
    assert len(engine.dispatcher.dispatch_log) == 20, "8 x 2 responses ran 4 chunks each, 20 kept"
    for inst in engine.pool:
        assert 0 < len(inst.books.timeline) <= 20
    _assert_idle(engine)


def test_an_abort_that_finds_its_instance_dead_does_not_run_the_response_again(model):
    """The abort of a response whose instance process just died: the abort is what finds
    the death. Its other responses there go back to the buffer; the aborted one does not
    (it used to, and finishing it a second time crashed the Request Buffer's loop)."""
    engine = _backend(model, chunk=8, backend="mp", num_threads=1)
    try:
        p = SamplingParams(max_tokens=60, ignore_eos=True, n=4, seed=1, temperature=1.0)
        engine.add_request("x", [5, 6, 7], p)
        engine.add_request("y", [8, 9], p.clone(n=2, max_tokens=20))
        samples = engine._requests["x"].samples
        victim = engine.pool.instances[1]
        done = {}
        while sum(c.sample in samples and c.sample.chunks >= 2 for c in victim.books.in_flight.values()) < 2:
            done.update((o.request_id, o) for o in engine.step())  # 2 of "x" past a chunk on instance 1
        victim.process.kill()
        victim.process.join(30)
        assert victim.alive, "not noticed yet: the abort finds it"
        (out,) = engine.abort_request(["x"])
        assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
        assert not victim.alive and engine.dispatcher.counters.instance_failures == 1
        assert not any(s in engine.dispatcher.buffer for s in samples)
        done.update(_drain(engine))
        assert list(done) == ["y"] and all(len(c.token_ids) == 20 for c in done["y"].outputs)
        _assert_idle(engine)
    finally:
        engine.close()


def test_kv_figures_return_to_zero_after_an_abort_that_a_held_reply_predates(model):
    """In-process instances step ahead in modeled time and hold the reply until its end
    comes. An instance whose last response is aborted while it holds a reply answers the
    abort with its KV freed; the held reply, computed before, must not bring the KV it
    saw back into the stats: with no more work there it would stay in /metrics for good."""
    engine = _backend(model, chunk=256)
    p = SamplingParams(max_tokens=200, ignore_eos=True, temperature=1.0, seed=1)
    (x,) = engine.add_request("x", [5, 6, 7, 8], p)
    engine.add_request("y", [9, 9, 9], p)
    clock = engine.pool.clock
    while not (x.instance is not None and clock.holds(engine.pool.instances[x.instance])):
        engine.step()
    held = engine.pool.instances[x.instance]
    engine.abort_request(["x"])
    assert held.books.stats.kv_used_blocks == 0, "the abort's answer: x's KV freed"
    while clock.holds(held):
        engine.step()  # the held reply is handed out
    assert not held.books.in_flight and held.books.current_stats().kv_used_blocks == 0
    _drain(engine)
    assert engine.stats().kv_used_blocks == 0 and engine.stats().running == 0
    engine.close()
