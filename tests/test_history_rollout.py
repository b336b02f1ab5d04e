"""Cross-iteration history on real engines: finished responses fill the store, the
next iteration's grouped drafts are seeded from it (speculation stays lossless), the
server keeps it under its data dir across restarts and weight updates, ``--history
off`` turns it off, and ``bench rollout --iterations`` revisits the same prompts."""

from __future__ import annotations

import json

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.rollout.backend import RolloutBackend
from seer_engine.rollout.config import HISTORY_FILE, RolloutConfig
from seer_engine.rollout.dispatcher import Dispatcher
from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.policies import make_rollout_policy
from seer_engine.rollout.pool import EnginePool
from seer_engine.rollout.types import Group
from seer_engine.sampling_params import SamplingParams

SPEC = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
PROMPTS = [list(range(10, 10 + n)) for n in (7, 23, 40)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3")


def _groups(temperature: float) -> list[Group]:
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=11)
    return [Group(f"g{i}", p, params, 3, 24) for i, p in enumerate(PROMPTS)]


def _rollout(model, policy_name: str, temperature: float, history: HistoryStore | None, speculate=True):
    cfg = EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=8)
    policy = make_rollout_policy(policy_name, history=history)
    policy.speculative = SPEC if speculate else None
    with EnginePool.start(cfg, 2, policy=policy, history=history) as pool:
        result = Dispatcher(pool, policy, chunk_tokens=8).run(_groups(temperature))
        seeded = pool.seed_stats
    outputs = {gid: [s.output_token_ids for s in v] for gid, v in result.samples.items()}
    return result, outputs, seeded


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_history_seeds_the_next_iterations_drafts_and_outputs_stay_the_same(model, temperature):
    """Greedy and seeded sampling: the same tokens with no speculation, with unseeded
    grouped drafts (iteration 1) and with drafts seeded from iteration 1 (iteration 2),
    which accept more and draft from a response's first tokens."""
    _, reference, _ = _rollout(model, "context", temperature, None, speculate=False)
    store = HistoryStore()
    first, outputs, seeded = _rollout(model, "seer+history", temperature, store)
    assert outputs == reference and seeded.groups == 0
    for prompt in PROMPTS:
        assert (
            len(store.sequences(prompt)) == 3 and [n for n, _ in store.lengths(prompt, before=1)] == [24] * 3
        )
    store.next_iteration()
    second, outputs, seeded = _rollout(model, "seer+history", temperature, store)
    assert outputs == reference
    assert seeded.groups == 3 and seeded.responses == 9 and seeded.tokens == 9 * 24
    m1, m2 = first.metrics, second.metrics
    assert m2.accepted_tokens_per_step > m1.accepted_tokens_per_step
    assert m2.accepted_tokens_per_step_thirds[0] > 0, "drafts work from the start of the rollout"


def test_history_off_disables_seeding(model):
    store = HistoryStore()
    _rollout(model, "seer", 0.0, store)  # a plain policy given a store still fills it
    assert len(store) == 3
    _, _, seeded = _rollout(model, "seer", 0.0, None)
    assert seeded.groups == 0
    config = RolloutConfig(rollout_mode=True, history="off")
    assert config.open_history() is None and config.history_spec("/tmp/x") == "off"
    assert RolloutConfig(rollout_mode=True).history_spec("/tmp/x") == "off"  # seer: off unless asked
    with pytest.raises(ValueError, match="needs --history on"):
        RolloutConfig(policy="seer+history", history="off")
    with pytest.raises(ValueError, match="history-half-life"):
        RolloutConfig(history="memory", history_half_life=0)


def _serve(model, data_dir, **kw) -> RolloutBackend:
    """The backend ``seer_engine serve --rollout-policy seer+history --data-dir D`` builds."""
    rollout = RolloutConfig(
        policy="seer+history", instances=2, chunk_tokens=8, distributed_backend="inproc", **kw
    )
    return RolloutBackend(EngineConfig(model=str(model), num_kv_blocks=64, max_num_seqs=8), rollout, data_dir)


def _serve_group(backend: RolloutBackend, rid: str, prompt: list[int] = PROMPTS[1]) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=5, n=3)
    backend.add_request(rid, prompt, params)
    done = {}
    while backend.has_unfinished_requests():
        for out in backend.step():
            if out.finished:
                done[out.request_id] = out
    return [c.token_ids for c in done[rid].outputs]


def test_server_keeps_history_under_its_data_dir_across_restarts_and_weight_updates(model, tmp_path):
    path = tmp_path / "history" / HISTORY_FILE
    backend = _serve(model, tmp_path)
    try:
        first = _serve_group(backend, "a")
        assert PROMPTS[1] not in HistoryStore.load(path), "saved at startup, then at updates and close"
        backend.update_weights(str(model))  # the next iteration begins, the store is saved
        assert HistoryStore.load(path).iteration == 1
    finally:
        backend.close()
    saved = HistoryStore.load(path)
    assert saved.sequences(PROMPTS[1]) == first and [n for n, _ in saved.lengths(PROMPTS[1])] == [16] * 3

    restarted = _serve(model, tmp_path, history_half_life=1.0)
    try:
        assert restarted.history.iteration == 1 and PROMPTS[1] in restarted.history
        assert restarted.history.lengths(PROMPTS[1]) == [(16, 0.5)] * 3  # one update old, half-life 1
        again = _serve_group(restarted, "b")
        assert again == first, "seeded drafts change no token"
        assert restarted.pool.seed_stats.groups == 1 and restarted.pool.seed_stats.tokens == 3 * 16
    finally:
        restarted.close()
    assert len(HistoryStore.load(path).sequences(PROMPTS[1])) == 6
    memory = _serve(model, tmp_path / "other", history="memory")
    memory.close()
    assert not (tmp_path / "other").exists()


def test_a_failed_history_save_fails_neither_the_weight_update_nor_the_shutdown(model, tmp_path):
    """The weights are swapped before the store is saved: a save that fails (here a folder
    where the file goes) is reported by /health, and the next update saves what was kept."""
    path = tmp_path / "history" / HISTORY_FILE
    backend = _serve(model, tmp_path)
    try:
        first = _serve_group(backend, "a")
        path.unlink()
        path.mkdir()
        backend.update_weights(str(model))  # no exception: the update happened
        assert "history store is not saved" in (backend.health().degraded or "")
        assert backend.history.iteration == 1 and backend.history.sequences(PROMPTS[1]) == first
        path.rmdir()
        backend.update_weights(str(model))
        assert backend.health().degraded is None
        saved = HistoryStore.load(path)
        assert saved.iteration == 2 and saved.sequences(PROMPTS[1]) == first
        path.unlink()
        path.mkdir()
    finally:
        backend.close()  # the failed save at shutdown is logged, the pool still closes
    assert path.is_dir()


def test_servers_sharing_a_history_directory_keep_each_others_records(model, tmp_path):
    """Two servers with one --data-dir, each serving its own prompts: their saves (at
    startup, weight updates and close) merge, so the file ends with both servers' groups."""
    path = tmp_path / "history" / HISTORY_FILE
    one, two = _serve(model, tmp_path), _serve(model, tmp_path)
    try:
        first = _serve_group(one, "a", PROMPTS[0])
        second = _serve_group(two, "b", PROMPTS[2])
        for backend in (one, two):
            backend.update_weights(str(model))
        saved = HistoryStore.load(path)
        assert saved.iteration == 1 and saved.sequences(PROMPTS[0]) == first
        assert saved.sequences(PROMPTS[2]) == second
        assert PROMPTS[0] in two.history, "a save takes up what the other server saved"
        _serve_group(one, "c", PROMPTS[0])
    finally:
        one.close()
        two.close()
    saved = HistoryStore.load(path)
    assert [len(saved.lengths(p, before=2)) for p in PROMPTS] == [6, 0, 3]


def test_bench_rollout_iterations_repeat_prompts(tmp_path, capsys, game24_trace):
    from seer_engine.entrypoints.cli import main
    from seer_engine.workloads.groups import select_groups
    from seer_engine.workloads.traces import load_trace

    trace = game24_trace
    args = ["bench", "rollout", "--trace", str(trace), "--groups", "2:4", "--samples", "3",
            "--instances", "2", "--kv-blocks", "24", "--chunk-tokens", "32", "--max-tokens", "96",
            "--distributed-backend", "inproc", "--iterations", "3", "--clock", "moonlight",
            "--history", str(tmp_path / "hist"), "--policy", "seer,context+history+group_tree",
            "--context-order", "estimate", "--report", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["context_order"] == "estimate"
    assert len(report["iterations"]) == 3 and report["policies"] == report["iterations"][-1]["policies"]
    groups = select_groups(load_trace(str(trace)), "2:4")
    for it, figures in enumerate(report["iterations"]):
        # iteration k replays trace responses 3k..3k+2 of the same groups (plus EOS each)
        want = sum(
            min(len(g.response_token_ids[j]) + 1, 96) for g in groups for j in range(3 * it, 3 * it + 3)
        )
        for name in ("seer", "context+history+group_tree"):
            assert figures["policies"][name]["output_tokens"] == want, (it, name)
    store = HistoryStore.load(tmp_path / "hist" / "context+history+group_tree" / HISTORY_FILE)
    assert store.iteration == 3 and len(store) == 2
    assert all(len(store.sequences(g.prompt_token_ids)) == 9 for g in groups)
    assert not (tmp_path / "hist" / "seer").exists(), "only +history policies keep a store"
    tree = [
        it["policies"]["context+history+group_tree"]["accepted_tokens_per_step"]
        for it in report["iterations"]
    ]
    assert tree[1] > tree[0] and tree[2] > tree[0], "drafts seeded from earlier iterations accept more"
    with pytest.raises(SystemExit):
        main(args[:-8] + ["--history", "off", "--policy", "context+history"])
    assert "need --history memory or DIR" in capsys.readouterr().err


def test_rollout_cli_keeps_history_in_its_directory(model, tmp_path):
    """``seer_engine rollout --history DIR``: each run is an iteration of the store there."""
    from seer_engine.entrypoints.cli import main

    hist = tmp_path / "hist"
    args = ["rollout", "--model", str(model), "--task", "arith", "--prompts", "2", "--n", "3",
            "--max-tokens", "8", "--knob", "steps=1", "--seed", "5", "--num-threads", "1",
            "--rollout-mode", "--chunk-tokens", "4", "--history", str(hist)]  # fmt: skip
    for run in (1, 2):
        assert main([*args, "--output", str(tmp_path / f"out{run}.jsonl")]) == 0
        store = HistoryStore.load(hist / HISTORY_FILE)
        assert store.iteration == run and len(store) == 2
        lines = [json.loads(x) for x in (tmp_path / f"out{run}.jsonl").read_text().splitlines()]
        for line in lines:
            seqs = store.sequences(line["prompt_token_ids"])
            assert seqs[-3:] == [o["token_ids"] for o in line["outputs"]] and len(seqs) == 3 * run


def test_a_shutdown_waits_for_a_held_history_save_and_says_what_for(model, tmp_path, monkeypatch, caplog):
    """The engine's shutdown gave up after 30 s: a save slower than that (a large store, a
    slow disk) was cut off when the process exited, so the run's history was lost without a
    word. It now waits, saying what for; a caller's own bound is kept, with a warning."""
    import asyncio
    import logging
    import threading
    import time

    import seer_engine.engine.engine_shutdown as engine_shutdown
    from seer_engine.engine.async_engine import AsyncEngine
    from seer_engine.rollout.backend import TEST_PAUSE_CLOSING_ENV

    def wait_until(predicate, what: str) -> None:
        deadline = time.monotonic() + 60
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    marker, path = tmp_path / "closing", tmp_path / "history" / HISTORY_FILE
    monkeypatch.setenv(TEST_PAUSE_CLOSING_ENV, str(marker))
    monkeypatch.setattr(engine_shutdown, "LOG_EVERY_S", 0.05)
    caplog.set_level(logging.WARNING)
    engine = AsyncEngine(lambda: _serve(model, tmp_path), "m", tokenizer_path=str(model)).start(timeout=120)

    async def serve() -> list[list[int]]:
        params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=5, n=3)
        outputs = [out async for out in await engine.generate("a", PROMPTS[1], params)]
        return [c.token_ids for c in outputs[-1].outputs]

    served = asyncio.run(serve())
    stopping = threading.Thread(target=engine.shutdown, daemon=True)
    stopping.start()
    try:
        wait_until(marker.exists, "the engine's close")
        waiting = "waiting for the engine thread to finish shutting down: saving the history store"
        wait_until(lambda: waiting in caplog.text or not stopping.is_alive(), "the shutdown's log")
        assert stopping.is_alive(), "the shutdown returned while the history store's save was held"
        assert f"an exit now loses the history store's records since its last save ({path}" in caplog.text
        assert engine.shutdown(timeout=0.1) is False, "a caller's bound ends its own wait"
        assert "not waiting longer for the engine thread to shut down: saving the history" in caplog.text
    finally:
        marker.unlink(missing_ok=True)
    stopping.join(60)
    assert not stopping.is_alive()
    assert HistoryStore.load(path).sequences(PROMPTS[1]) == served


def test_bench_task_iterations_take_fresh_seeds():
    """``bench rollout --task --iterations``: a later iteration's responses share no seed
    with an earlier one's (iteration k's sample i once took iteration k-1's sample i+1
    seed: the same prompt, the same tokens, drafts from history accepted for free)."""
    from seer_engine.core.seeds import group_seed, sample_seed
    from seer_engine.entrypoints.bench import _fresh_seeds

    group = Group(
        "g0", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=8, seed=group_seed(5, 0)), 8, 8
    )
    seeds = []
    for it in range(3):
        fresh = _fresh_seeds(group, it)
        seeds += [sample_seed(fresh.sampling_params.seed, fresh.order, i) for i in range(fresh.n)]
    assert _fresh_seeds(group, 0).sampling_params.seed == group.sampling_params.seed
    assert len(set(seeds)) == len(seeds) == 24
