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
