"""Faults under ``seer_engine serve --rollout-mode``: an instance process (or Ray actor)
killed mid-rollout, one that dies while the server is idle, one that hangs (SIGSTOP)
mid-rollout, a Mooncake master killed mid-rollout. Every sample comes back exactly
once with the tokens of a fault-free run (sampling is seeded, so tokens depend on seed
and position only), and the server keeps serving: /health and /metrics answer 200 and say what was lost."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest_plugins = ["server_harness"]

GROUPS, N, MAX_TOKENS = 4, 8, 200  # 32 samples in flight, in 16-token chunks
COMMON = ["--rollout-mode", "--chunk-tokens", "16", "--max-model-len", "512", "--num-kv-blocks", "256",
          "--max-num-seqs", "8", "--num-threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("qwen3")


def _request(server, g: int) -> list[tuple[int, list[int]]]:
    with server.openai(timeout=600) as client:  # a whole group, on a loaded machine too
        out = client.completions.create(
            model=server.model,
            prompt=[3 + g, 7, 11 + g, 5],
            n=N,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=100 + g,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    return sorted((c.index, list(c.token_ids)) for c in out.choices)


def _rollout(server, during=None) -> dict[int, list[tuple[int, list[int]]]]:
    """All groups at once; ``during()`` runs on this thread while they are in flight."""
    with ThreadPoolExecutor(GROUPS) as pool:
        futures = {g: pool.submit(_request, server, g) for g in range(GROUPS)}
        if during is not None:
            during()
        return {g: f.result(timeout=600) for g, f in futures.items()}


def _assert_complete(outputs: dict, reference: dict) -> None:
    for choices in outputs.values():
        assert [i for i, _ in choices] == list(range(N)), "every sample exactly once"
        assert all(len(tokens) == MAX_TOKENS for _, tokens in choices)
    assert outputs == reference, "a lost instance changed no output"


def _health(server) -> dict:
    with server.http() as http:
        resp = http.get("/health")
    assert resp.status_code == 200, resp.text
    return resp.json()


def _kill_mid_rollout(server, pid: int, sig: signal.Signals = signal.SIGKILL) -> dict:
    """Once some tokens are out (and most are not), send ``sig`` (SIGKILL) to ``pid``."""
    total = GROUPS * N * MAX_TOKENS
    start = server.metrics()["generation_tokens_total"]
    at = server.wait_until(
        lambda: (t := server.metrics()["generation_tokens_total"] - start) >= total // 8 and t,
        timeout=300,
        what="the rollout to get going",
    )
    os.kill(pid, sig)
    return {"tokens_before_kill": at, "total": total}


def test_killed_instance_processes_lose_no_sample(model, start_server):
    server = start_server("--model", str(model), "--instances", "3", *COMMON)
    instances = _health(server)["instances"]
    assert [i["alive"] for i in instances] == [True] * 3 and all(i["pid"] > 0 for i in instances)
    reference = _rollout(server)
    counters = ("generation_tokens_total", "engine_steps_total", "num_preemptions_total")
    before = {k: server.metrics()[k] for k in counters}
    assert before["generation_tokens_total"] > 0

    os.kill(instances[2]["pid"], signal.SIGKILL)  # dies while the server is idle
    health = server.wait_until(lambda: (h := _health(server))["status"] == "degraded" and h, what="degraded")
    assert "[2]" in health["reason"] and [i["alive"] for i in health["instances"]] == [True, True, False]
    assert server.metrics()["instance_failures_total"] == 1
    # Counters keep what the lost instance counted: Prometheus reads a drop as a reset.
    # (A live instance's idle reply may still add a step meanwhile.)
    after_kill = server.metrics()
    assert all(after_kill[k] >= before[k] for k in counters), (after_kill, before)

    kill = {}
    outputs = _rollout(server, during=lambda: kill.update(_kill_mid_rollout(server, instances[1]["pid"])))
    assert kill["tokens_before_kill"] < kill["total"], "the instance died mid-rollout"
    _assert_complete(outputs, reference)
    metrics = server.metrics()
    assert metrics["instance_failures_total"] == 2 and metrics["instances_alive"] == 1
    assert all(metrics[k] >= before[k] for k in counters)
    assert metrics["generation_tokens_total"] >= before["generation_tokens_total"] + kill["total"]
    assert metrics["num_requests_running"] == 0 and metrics["kv_cache_usage_perc"] == 0.0
    assert _health(server)["status"] == "degraded"
    assert _rollout(server) == reference, "the last instance keeps serving"


def test_a_hung_instance_process_is_killed_and_loses_no_sample(model, start_server):
    """An instance stopped mid-rollout (SIGSTOP: alive, silent, maybe holding the KV pool's
    lock) is taken as hung once it has not answered a step for --instance-timeout: killed,
    its responses finish on the others with unchanged tokens; the others, blocked on
    nothing it holds, keep going, and the server answers meanwhile."""
    server = start_server("--model", str(model), "--instances", "3", "--instance-timeout", "10", *COMMON)
    reference = _rollout(server)
    victim = _health(server)["instances"][1]["pid"]
    kill: dict = {}

    def stop_and_watch() -> None:
        kill.update(_kill_mid_rollout(server, victim, signal.SIGSTOP))
        assert server.metrics()["instances_alive"] >= 2, "the server answers while the instance hangs"

    try:
        outputs = _rollout(server, during=stop_and_watch)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped by the server, normally
            os.kill(victim, signal.SIGKILL)
    assert kill["tokens_before_kill"] < kill["total"], "the instance hung mid-rollout"
    _assert_complete(outputs, reference)
    health = _health(server)
    assert [i["alive"] for i in health["instances"]] == [True, False, True], health
    assert server.metrics()["instance_failures_total"] == 1
    assert "taken as hung" in server.log_tail()


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_a_serving_call_does_not_wait_on_a_hung_instance(model, start_server, backend):
    """An instance process or actor stopped (SIGSTOP) while idle holds a serving call
    (sleep, wake) up for --instance-timeout at most: it is killed, the call applies to
    the other instance, and the server goes on serving there with unchanged tokens."""
    if backend == "ray":
        pytest.importorskip("ray")
    server = start_server(
        "--model", str(model), "--instances", "2", "--instance-timeout", "10",
        "--distributed-backend", backend, *COMMON,
    )  # fmt: skip
    reference = _rollout(server)
    victim = _health(server)["instances"][1]["pid"]
    os.kill(victim, signal.SIGSTOP)
    try:
        with server.http() as http:
            assert http.post("/sleep", timeout=120).status_code == 200
            assert http.post("/wake_up", timeout=120).status_code == 200
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped by the server, normally
            os.kill(victim, signal.SIGKILL)
    health = _health(server)
    assert [i["alive"] for i in health["instances"]] == [True, False], health
    assert "no call reply in 10 s, taken as hung" in server.log_tail()
    assert _rollout(server) == reference


def test_a_weight_update_may_take_longer_than_a_step_before_it_is_taken_as_hung(model, start_server):
    """Loading a checkpoint takes as long as the disk does: an instance that answers a
    weight update later than --instance-timeout (stopped for longer, as by a slow load)
    is waited for up to --instance-load-timeout, and the update applies on both."""
    server = start_server(
        "--model", str(model), "--instances", "2", "--instance-timeout", "5",
        "--instance-load-timeout", "600", *COMMON,
    )  # fmt: skip
    victim = _health(server)["instances"][1]["pid"]
    os.kill(victim, signal.SIGSTOP)
    resume = threading.Timer(12.0, os.kill, (victim, signal.SIGCONT))
    resume.start()
    try:
        with server.http() as http:
            resp = http.post("/update_weights_from_disk", json={"model_path": str(model)}, timeout=300)
    finally:
        resume.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    assert resp.status_code == 200, resp.text
    assert [i["alive"] for i in _health(server)["instances"]] == [True, True]
    assert server.metrics()["instance_failures_total"] == 0
    assert [len(tokens) for _, tokens in _request(server, 0)] == [MAX_TOKENS] * N


def test_a_client_that_hangs_up_gets_its_request_aborted_cleanly(model, start_server):
    """A client that closes its connection mid-request: the request is aborted (its
    responses leave the instances) and the handler ends with 499, not with an
    InvalidStateError from reading the result of the task it had just cancelled."""
    import json
    import socket
    from urllib.parse import urlparse

    server = start_server("--model", str(model), "--instances", "2", *COMMON)
    url = urlparse(server.url)
    body = json.dumps({"model": server.model, "prompt": [3, 7, 11, 5], "n": 8, "max_tokens": 500,
                       "ignore_eos": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer test-key\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head + body)
        running = lambda: server.metrics()["num_requests_running"]  # noqa: E731
        server.wait_until(lambda: running() > 0, timeout=60, what="the request to run")
    server.wait_until(lambda: running() == 0, timeout=60, what="the abort")
    assert "InvalidStateError" not in server.log_tail(20_000)
    assert len(_request(server, 0)) == N, "the server keeps serving"


def test_killed_ray_actor_loses_no_sample(model, start_server):
    pytest.importorskip("ray")
    server = start_server(
        "--model", str(model), "--instances", "2", "--distributed-backend", "ray", *COMMON
    )  # fmt: skip
    reference = _rollout(server)
    victim = _health(server)["instances"][1]["pid"]
    kill = {}
    outputs = _rollout(server, during=lambda: kill.update(_kill_mid_rollout(server, victim)))
    assert kill["tokens_before_kill"] < kill["total"], "the actor died mid-rollout"
    _assert_complete(outputs, reference)
    assert server.metrics()["instance_failures_total"] == 1
    assert _health(server)["status"] == "degraded"
    # The last actor dies while the server is idle: noticed without a request (503).
    os.kill(_health(server)["instances"][0]["pid"], signal.SIGKILL)
    _wait_engine_dead(server)


def _children(pid: int) -> dict[int, str]:
    """Child processes of ``pid`` and their command lines."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry)] = cmdline
    return out


def test_killed_mooncake_master_makes_moves_recompute(model, start_server):
    pytest.importorskip("mooncake")
    server = start_server(
        "--model", str(model), "--instances", "2", "--kv-connector", "mooncake",
        "--migration-spread", "0", "--pool-pull-tokens", "0", *COMMON,
    )  # fmt: skip
    reference = _rollout(server)
    masters = [pid for pid, cmd in _children(server.proc.pid).items() if "mooncake_master" in cmd]
    assert len(masters) == 1, _children(server.proc.pid)
    kill = {}
    outputs = _rollout(server, during=lambda: kill.update(_kill_mid_rollout(server, masters[0])))
    assert kill["tokens_before_kill"] < kill["total"], "the master died mid-rollout"
    _assert_complete(outputs, reference)
    assert server.metrics()["kv_pool_failures_total"] > 0
    health = _health(server)
    assert health["status"] == "degraded" and "KV pool" in health["reason"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_shuts_the_rollout_server_down_cleanly(model, start_server, sig):
    """SIGTERM (what orchestrators send) and SIGINT both run the engine's shutdown: the
    history store is saved with the groups served, and the instances' KV pool is released
    by its owner rather than left to multiprocessing's leak tracker."""
    from seer_engine.rollout.history import HistoryStore

    args = ["--model", str(model), "--instances", "2", "--rollout-policy", "seer+history", *COMMON]
    server = start_server(*args)
    served = _request(server, 0)
    assert len(served) == N
    data = server.args[server.args.index("--data-dir") + 1]
    server.stop(sig=sig)
    assert server.proc.returncode in (0, 128 + sig, 1), server.log_tail()
    saved = HistoryStore.load(Path(data) / "history" / "history.json")
    assert sorted(saved.sequences([3, 7, 11, 5])) == sorted(tokens for _, tokens in served)
    assert "leaked shared_memory" not in server.log_tail(20000), server.log_tail()


def _post_completion(server, g: int = 0, timeout: float = 120):
    """A request as a raw HTTP call: its status and OpenAI error object are looked at."""
    body = {"model": server.model, "prompt": [3 + g, 7, 11 + g, 5], "n": N, "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 100 + g, "ignore_eos": True}  # fmt: skip
    with server.http(timeout=timeout) as http:
        return http.post("/v1/completions", json=body)


def _assert_engine_dead(resp) -> None:
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "engine_dead", error
    assert error["message"].startswith("every engine instance of the rollout is gone"), error  # its own words


def _wait_engine_dead(server) -> None:
    """/health says 503 (condition-based: the server notices lost processes by itself)."""

    def dead():
        with server.http() as http:
            resp = http.get("/health")
        return resp.status_code == 503 and resp

    _assert_engine_dead(server.wait_until(dead, timeout=60, what="/health to say 503"))


def _assert_metrics_say_every_instance_lost(server, lost: int = 2) -> None:
    """/metrics keeps answering once every instance is gone, and says so (not the figures
    of the last snapshot before): none alive, each loss counted, nothing running or
    waiting any more (every request has failed)."""
    alive = lambda: (m := server.metrics())["instances_alive"] == 0 and m  # noqa: E731
    metrics = server.wait_until(alive, what="/metrics to say no instance is alive")
    assert metrics["instance_failures_total"] == lost, metrics
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0, metrics
    assert metrics["num_requests_held"] == metrics["kv_cache_usage_perc"] == 0, metrics
    assert metrics["generation_tokens_total"] > 0, "counters keep their values"


def test_losing_every_instance_in_a_serving_call_while_paused_fails_requests_clearly(model, start_server):
    """Every instance hangs (SIGSTOP) while generation is paused with ``keep``, and a cache
    reset takes each as hung and kills it: the reset applied nowhere, so it answers 503
    (not success); the requests in flight can never finish, so they end at once with 503
    (not a wait for a resume that cannot help); /health and new requests say 503."""
    server = start_server("--model", str(model), "--instances", "2", "--instance-timeout", "3", *COMMON)
    pids = [i["pid"] for i in _health(server)["instances"]]
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(_post_completion, server)
        server.wait_until(lambda: server.metrics()["generation_tokens_total"] > 0, timeout=120, what="tokens")
        with server.http() as http:
            assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                _assert_engine_dead(http.post("/flush_cache", timeout=120))
            finally:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):  # killed by the server, normally
                        os.kill(pid, signal.SIGKILL)
        _assert_engine_dead(in_flight.result(timeout=60))
    _wait_engine_dead(server)
    _assert_engine_dead(_post_completion(server, 1))
    _assert_metrics_say_every_instance_lost(server)


def test_losing_every_instance_while_idle_refuses_requests_clearly(model, start_server):
    """Every instance process killed while idle (the baseline policy, which pins groups to
    instances up front): /health says 503, and a new request is refused with 503, not a
    500 from the dispatcher finding no instance to pin it to."""
    server = start_server("--model", str(model), "--instances", "2", *COMMON, "--rollout-policy", "baseline")
    for inst in _health(server)["instances"]:
        os.kill(inst["pid"], signal.SIGKILL)
    _wait_engine_dead(server)
    _assert_engine_dead(_post_completion(server))


def test_a_stop_signal_ends_the_requests_still_running_with_a_clear_error(model, start_server):
    """Requests that have not finished when the drain after SIGTERM ends (here: held by a
    ``keep`` pause) used to be cancelled by uvicorn: a plain-text 500 and a stream cut off
    mid-message. The engine now stops first: each ends with a 503 ``engine_dead`` error
    object (in-band on a stream), and a batch under way is left for the next start, which
    runs it to the end."""
    import json

    server = start_server("--model", str(model), "--instances", "2", *COMMON)
    body = {"model": server.model, "prompt": [3, 7, 11, 5], "max_tokens": 4}
    with server.http() as http:
        assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
        line = {"custom_id": "b0", "method": "POST", "url": "/v1/completions", "body": body}
        upload = http.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line).encode())},
                           data={"purpose": "batch"})  # fmt: skip
        batch_body = {
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        batch_id = http.post("/v1/batches", json=batch_body).json()["id"]

    with ThreadPoolExecutor(2) as pool:
        answers = pool.submit(server.complete, body), pool.submit(server.stream_events, body)
        server.wait_until(lambda: server.metrics()["num_requests_held"] == 3, what="the held requests")
        server.stop(timeout=60)
        resp, events = answers[0].result(timeout=60), answers[1].result(timeout=60)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead", resp.text
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "engine_dead", events
    assert "Exception in ASGI application" not in server.log_tail(20000), server.log_tail()

    server.start(timeout=240)
    with server.openai() as client:
        done = server.wait_until(
            lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b, timeout=120
        )
        assert done.request_counts.completed == 1 and done.request_counts.failed == 0
