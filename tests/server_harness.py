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
_ADDRESS = re.compile(r"serving .+? on (http://[\d.]+:\d+)", re.S)  # any served name


class ServerProcess:
    """Start, stop and restart one server; ``url`` changes on every start."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, own_group: bool = False
    ) -> None:
        self.args = args
        self.log_path = log_path
        self.env = env or {}
        self.own_group = own_group  # a process group of its own, as a shell gives a foreground job
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 90.0) -> ServerProcess:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **self.env}
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps writing to it
        offset = self.log_path.stat().st_size
        cmd = [sys.executable, "-m", "seer_engine.entrypoints.cli", "serve", "--port", "0", *self.args]
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=self.own_group
        )
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

    def stop(self, timeout: float = 15.0, sig: int = signal.SIGTERM) -> None:
        """Ask it to shut down (SIGTERM, as an orchestrator would; SIGINT is Ctrl-C)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def kill(self, timeout: float = 15.0) -> None:
        """SIGKILL: no shutdown code runs, as when the machine or the OOM killer stops it."""
        if self.proc is not None and self.proc.poll() is None:
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

    def openai(self, timeout: float = 60, **kwargs):
        """A client without retries; ``timeout`` only guards against a hang, so a request
        whose length depends on the machine's speed gets a long one."""
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=timeout, **kwargs
        )

    def http(self, api_key: str | None = API_KEY, timeout: float = 60) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def complete(self, body: dict) -> httpx.Response:
        """POST /v1/completions on a client of its own (callable from a worker thread)."""
        with self.http() as http:
            return http.post("/v1/completions", json=body)

    def stream_events(self, body: dict) -> list[str]:
        """The ``data:`` lines of /v1/completions streamed, until the server ends the stream."""
        with self.http() as http, http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]


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


@pytest.fixture
def start_server(tmp_path):
    """``start_server(*args) -> ServerProcess``: a server of this test's own (stopped at the
    end), for tests that need other flags or break the server on purpose."""
    started: list[ServerProcess] = []

    def start(*args: str, own_group: bool = False, env: dict[str, str] | None = None) -> ServerProcess:
        root = tmp_path / f"server{len(started)}"
        root.mkdir()
        common = ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--data-dir", str(root / "data"),
                  "--log-level", "warning"]  # fmt: skip
        proc = ServerProcess([*common, *args], root / "server.log", env, own_group=own_group)
        started.append(proc)
        return proc.start(timeout=240)

    yield start
    for proc in started:
        proc.stop()
