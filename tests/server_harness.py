"""A real ``seer_engine serve`` process for the server tests (a pytest plugin).

Loaded with ``pytest_plugins = ["server_harness"]`` by tests/test_server_*.py, so the
session-scoped server is started once for all of them. Test modules use it through
fixtures only (``server``, ``client``, ``http``, ``model``): importing this module
directly would defeat pytest's assertion rewriting of it. The server binds port 0
(the OS picks a free port, so parallel runs never collide) and logs the address,
which the harness reads from its log file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny-test"
_ADDRESS = re.compile(r"serving \S+ on (http://[\d.]+:\d+)")


class ServerProcess:
    """Start, stop and restart one server; ``url`` changes on every start."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        offset = self.log_path.stat().st_size
        cmd = [sys.executable, "-m", "seer_engine.entrypoints.cli", "serve", "--port", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            text = self.log_path.read_text(errors="replace")[offset:]
            match = _ADDRESS.search(text)
            if match:
                self.url = match.group(1)
                try:
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    # -- clients and helpers -----------------------------------------------------------

    model = MODEL_NAME
    mode = "plain"  # or "rollout" (see SERVER_MODES)

    def metrics(self) -> dict[str, float]:
        """/metrics as {name: value} (the seer_engine_ prefix and labels dropped)."""
        with self.http() as http:
            resp = http.get("/metrics")
        assert resp.status_code == 200, resp.text
        out = {}
        for line in resp.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{", 1)[0].removeprefix("seer_engine_")] = float(value)
        return out

    @staticmethod
    def wait_until(predicate, timeout: float = 20.0, interval: float = 0.02, what: str = "condition"):
        """Poll ``predicate`` until it returns something truthy (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(interval)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=60, **kwargs)

    def http(self, api_key: str | None = API_KEY, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


@pytest.fixture(scope="session")
def server_models(tiny_model) -> tuple[Path, Path]:
    """The served model and a second one of the same shape (another seed) for weight updates."""
    return tiny_model("qwen3"), tiny_model("qwen3", seed=1)


# Every server test runs against both backends: one plain engine, and rollout mode
# (two instances behind the Request Buffer, context-aware order, 16-token chunks so
# that responses cross chunk boundaries and instances).
SERVER_MODES = {
    "plain": [],
    "rollout": [
        "--rollout-mode",
        "--instances",
        "2",
        "--chunk-tokens",
        "16",
        # seer's grouped drafts, with the step cost pinned so drafting does not hang on load
        "--speculative-config",
        '{"method": "group_suffix", "step_cost": [0.004, 2e-5]}',
    ],  # fmt: skip
}


@pytest.fixture(scope="session", params=list(SERVER_MODES))
def server(request, server_models, tmp_path_factory) -> ServerProcess:
    root = tmp_path_factory.mktemp(f"server-{request.param}")
    args = [
        "--model", str(server_models[0]),
        "--served-model-name", MODEL_NAME,
        "--api-key", API_KEY,
        "--data-dir", str(root / "data"),
        "--max-model-len", "512",
        "--num-kv-blocks", "512",
        "--max-num-seqs", "64",
        "--num-threads", "1",
        "--max-body-bytes", "1000000",
        "--log-level", "warning",
        *SERVER_MODES[request.param],
    ]  # fmt: skip
    proc = ServerProcess(args, root / "server.log").start()
    proc.mode = request.param
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    with server.openai() as c:
        yield c


@pytest.fixture
def http(server):
    with server.http() as c:
        yield c


@pytest.fixture(scope="session")
def model(server) -> str:
    """The name clients use for the served model."""
    return server.model


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """``start_server(args, name) -> ServerProcess``: a server of a test module's own
    (its model, its flags), with its own data folder; stopped at the end of the session
    at the latest (a module fixture may stop it sooner)."""
    started: list[ServerProcess] = []

    def start(args: list[str], name: str = "own") -> ServerProcess:
        root = tmp_path_factory.mktemp(f"server-{name}")
        proc = ServerProcess([*args, "--data-dir", str(root / "data")], root / "server.log").start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
