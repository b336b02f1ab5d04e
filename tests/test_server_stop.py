"""How ``seer_engine serve --rollout-mode`` stops when signals reach more than its own
process: Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the
server's instance processes included."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest_plugins = ["server_harness"]

COMMON = ["--rollout-mode", "--chunk-tokens", "16", "--max-model-len", "512", "--num-kv-blocks", "256",
          "--max-num-seqs", "8", "--num-threads", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("qwen3")


def test_ctrl_c_leaves_the_instance_processes_to_the_servers_shutdown(model, start_server):
    """SIGINT to the process group used to kill every instance process at once (a
    KeyboardInterrupt traceback each): the requests in flight lost their drain and ended
    with "every engine instance of the rollout is gone". The instances now leave stopping
    to the server, which drains, then ends what is left with its own shutdown."""
    server = start_server("--model", str(model), "--instances", "2", *COMMON, own_group=True)
    body = {"model": server.model, "prompt": [3, 7, 11, 5], "max_tokens": 4}

    def plain():
        with server.http() as http:
            return http.post("/v1/completions", json=body)

    with server.http() as http:
        assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(plain)
        server.wait_until(lambda: server.metrics()["num_requests_held"] == 1, what="the held request")
        os.killpg(server.proc.pid, signal.SIGINT)
        resp = answer.result(timeout=60)
        server.proc.wait(60)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == "the engine is shut down", resp.text
    assert server.proc.returncode == 128 + signal.SIGINT, server.log_tail()
    log = server.log_tail(20000)
    assert "KeyboardInterrupt" not in log and "died" not in log, log


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_stop_signal_ends_the_requests_still_running_with_a_clear_error(model, start_server, sig):
    """A second SIGINT makes uvicorn quit without waiting for the drain; it then cancelled
    the requests still running (a plain-text 500, a stream cut off mid-message, an
    "Exception in ASGI application" traceback each). The engine now stops first, so each
    ends with a 503 ``engine_dead`` error object, in-band on a stream. A second SIGTERM
    (uvicorn ignores it) does the same. The drain is longer than the test may wait, so
    the server ends only if the second signal skips it."""
    import json

    import httpx

    server = start_server(
        "--model", str(model), "--max-model-len", "512", "--num-threads", "1", "--drain-timeout", "3600"
    )
    body = {"model": server.model, "prompt": [3, 7, 11, 5], "max_tokens": 4}

    def refused() -> bool:
        """The first signal is handled: the server stopped listening. A connection accepted
        just before the listener closed is dropped unanswered (or answered late): poll again."""
        try:
            httpx.get(f"{server.url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException):
            return False
        return False

    with server.http() as http:
        assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    with ThreadPoolExecutor(2) as pool:
        answers = pool.submit(server.complete, body), pool.submit(server.stream_events, body)
        server.wait_until(lambda: server.metrics()["num_requests_held"] == 2, what="the held requests")
        server.proc.send_signal(sig)
        server.wait_until(refused, what="the server to stop listening")
        server.proc.send_signal(sig)
        resp, events = answers[0].result(timeout=60), answers[1].result(timeout=60)
        server.proc.wait(60)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead", resp.text
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == "engine_dead", events
    assert server.proc.returncode == 128 + sig, server.log_tail()
    assert "a second stop signal: not waiting" in server.log_tail(20000), server.log_tail()
    assert "Exception in ASGI application" not in server.log_tail(20000), server.log_tail()


def test_a_second_signal_while_the_engine_shuts_down_exits_at_once_saying_what_is_lost(
    model, start_server, tmp_path
):
    """The engine's shutdown (the history store's save, the instances' stop) has no fixed
    end now. Another signal while it runs used to be held until it ended: the process
    exits at once instead (a grace period's end, an operator who asks twice), with a
    warning that the run's history is not saved; the file keeps its last save."""
    from seer_engine.rollout.backend import TEST_PAUSE_CLOSING_ENV
    from seer_engine.rollout.history import HistoryStore

    marker, history = tmp_path / "closing", tmp_path / "history"
    args = ["--instances", "2", "--distributed-backend", "mp", "--rollout-policy", "seer+history"]
    server = start_server("--model", str(model), *args, "--history", str(history), *COMMON,
                          env={TEST_PAUSE_CLOSING_ENV: str(marker)})  # fmt: skip
    prompt = [3, 7, 11, 5]
    with server.http() as http:
        body = {"model": server.model, "prompt": prompt, "n": 2, "max_tokens": 8, "ignore_eos": True}
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.wait_until(marker.exists, what="the engine's shutdown")
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
    finally:
        marker.unlink(missing_ok=True)
    assert server.proc.returncode == 128 + signal.SIGTERM, server.log_tail()
    log = server.log_tail(20000)
    exiting = "stop signal during the engine's shutdown: exiting before it is done (saving the history store"
    assert exiting in log, log
    assert f"an exit now loses the history store's records since its last save ({history}" in log, log
    assert HistoryStore.load(history / "history.json").sequences(prompt) == [], "the startup's save is kept"


def _process_tree(pid: int) -> dict[int, str]:
    """The processes below ``pid`` (children, theirs, ...) and their command lines."""
    parents: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = {}, [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            tree[child] = commands[child]
            todo.append(child)
    return tree


def _still_running(tree: dict[int, str]) -> dict[int, str]:
    running = {}
    for pid, command in tree.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            same = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() == command
        except OSError:
            continue
        if same and state != "Z":
            running[pid] = command
    return running


def test_a_stopped_ray_server_leaves_no_ray_process_behind(model, start_server):
    """The local Ray cluster a server starts ends with it, at once. Ray ties the GCS and
    raylet it starts to the thread that ran ``ray.init`` (Linux's parent-death signal
    follows the thread), the engine thread here: they were SIGKILLed as that thread
    ended, before Ray's own shutdown at exit could stop them, and the raylet's agents
    were left running for a minute."""
    pytest.importorskip("ray")
    server = start_server("--model", str(model), "--instances", "1", "--distributed-backend", "ray", *COMMON)
    with server.http() as http:
        body = {"model": server.model, "prompt": [3, 7, 11, 5], "max_tokens": 4}
        assert http.post("/v1/completions", json=body).status_code == 200
    tree = _process_tree(server.proc.pid)
    assert any("raylet" in command for command in tree.values()), tree
    server.stop(timeout=60)
    assert server.proc.returncode == 128 + signal.SIGTERM, server.log_tail()
    ended = lambda: not _still_running(tree)  # noqa: E731
    server.wait_until(ended, timeout=10, interval=0.2, what=f"Ray's processes to end: {_still_running(tree)}")
