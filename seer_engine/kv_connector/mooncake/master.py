"""``MooncakeMaster``: a ``mooncake_master`` (the wheel ships the binary) that this process
runs and supervises, on free ports, with its HTTP metadata server, and optionally a *segment
holder*: a standalone ``mooncake_client`` process that mounts the pool's memory. Values live
in mounted segments, and a segment goes away with the process that mounted it, so memory held
by a process of its own outlives every engine and Python process (an engine that exits or
crashes loses nothing of the pool).

Traps, seen with ``mooncake-transfer-engine-non-cuda`` 0.3.13:

* Every master listens on an admin/metrics port (9003 by default): two masters on one host
  collide unless each gets its own.
* A mounted segment must be at least 16 MiB (``mooncake_client`` aborts on less).
* A master that cannot bind its RPC port exits with code 1, silently, a second after its
  other ports open.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from seer_engine.kv_connector.base import KVPoolError
from seer_engine.kv_connector.mooncake.common import MIN_SEGMENT_BYTES, answers, free_port

T = TypeVar("T")


def find_binary(name: str) -> str | None:
    """The ``mooncake_master``/``mooncake_client`` executable the wheel ships, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _parent_death_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies, even by
    SIGKILL (Linux ``PR_SET_PDEATHSIG``). libc is resolved here, before the fork: the child
    of a multi-threaded parent must not take the loader's locks."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def _popen(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a terminal's Ctrl-C reaches this process, which stops the
            # master in order, not the master directly.
            start_new_session=True,
            preexec_fn=_parent_death_hook(),
        )


class _Forker:
    """A daemon thread, started on first use, that runs calls for other threads and never
    exits before the process does: children it forks get their parent-death signal when
    the process dies, not when the thread that asked for them ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="seer-mooncake-forker", daemon=True)
                self._thread.start()
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()

    def _run(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                done.set_exception(e)


_FORKER = _Forker()


def _stop_processes(procs: list[subprocess.Popen], log_dir: str | None, grace: float = 5.0) -> None:
    """Terminate (then kill) and reap; the segment holder goes first, while its master lives."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (Linux /proc; True
    where that cannot be told). Another program that took the port would answer probes too."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


class MooncakeMaster:
    """A ``mooncake_master`` (and optionally a segment holder) that this process owns.

    The master binds ``host`` on free ports: RPC (``address``), the HTTP metadata server
    (``metadata_server``) and its admin/metrics server. With ``segment_bytes > 0`` a
    ``mooncake_client`` process mounts that much memory for the pool, so values outlive the
    processes that put them. Logs go to files (``log_path``, ``segment_log_path``), never to a
    pipe that could fill up. ``stop()`` (or leaving the ``with`` block, garbage collection,
    interpreter exit) ends both processes; they also receive SIGTERM if this process dies
    without running its exit hooks (SIGKILL), whichever thread started them.
    """

    def __init__(
        self,
        segment_bytes: int = 0,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        client_binary: str | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if segment_bytes and segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"segment_bytes must be 0 or at least {MIN_SEGMENT_BYTES} (16 MiB), got {segment_bytes}"
            )
        self.host = host
        self.segment_bytes = segment_bytes
        self._log_dir = tempfile.mkdtemp(prefix="seer_mooncake_")
        self.log_path = Path(self._log_dir) / "master.log"
        self.segment_log_path = Path(self._log_dir) / "segment.log"
        self._procs: list[subprocess.Popen] = []  # stop order: holder first, then master
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._log_dir)
        try:
            self._master = self._start_master(binary or find_binary("mooncake_master"), startup_timeout)
            self._holder = None
            if segment_bytes:
                self._holder = self._start_holder(
                    client_binary or find_binary("mooncake_client"), startup_timeout
                )
        except BaseException:
            self._finalizer()
            raise

    # -- processes -------------------------------------------------------------------

    def _spawn(self, argv: list[str], log_path: Path) -> subprocess.Popen:
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so the fork happens on
        # a thread that lives as long as the process, whichever thread asks (the server
        # starts the pool on its engine thread: forked from there, a SIGKILLed server
        # would leave the master running).
        return _FORKER.call(lambda: _popen(argv, log_path))

    def _wait_ready(
        self, proc: subprocess.Popen, what: str, ports: list[int], log: Path, timeout: float
    ) -> bool:
        """True once ``proc`` itself listens on every port; False if it exited or another
        process took one of them (a master that cannot bind its RPC port exits with code 1,
        silently, a second after its other ports open)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if all(answers(self.host, p, 0.5) for p in ports):
                if all(_listening(proc.pid, p) for p in ports):
                    return True
                if time.monotonic() > deadline - timeout + 5:  # someone else's port, for 5 s
                    _stop_processes([proc], None)
                    return False
            time.sleep(0.05)
        _stop_processes([proc], None)
        raise KVPoolError(
            f"{what} did not answer on {self.host}:{ports} within {timeout:.0f} s; log:\n{_log_tail(log)}"
        )

    def _start_master(self, binary: str | None, timeout: float) -> subprocess.Popen:
        def argv(rpc: int, http: int, admin: int) -> list[str]:
            self.rpc_port, self.http_port, self.admin_port = rpc, http, admin
            return [
                f"--rpc_address={self.host}",
                f"--rpc_port={rpc}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={self.host}",
                f"--http_metadata_server_port={http}",
                f"--metrics_host={self.host}",
                f"--metrics_port={admin}",
                "--enable_metric_reporting=false",  # else a stats line every few seconds
            ]

        hint = "pip install 'seer_engine[mooncake]' (mooncake-transfer-engine-non-cuda)"
        return self._start("mooncake_master", binary, hint, 3, argv, self.log_path, timeout)

    def _start_holder(self, binary: str | None, timeout: float) -> subprocess.Popen:
        def argv(port: int) -> list[str]:
            self.holder_port = port
            return [
                f"--host={self.host}",
                f"--port={port}",
                f"--global_segment_size={self.segment_bytes}",
                f"--master_server_address={self.address}",
                f"--metadata_server={self.metadata_server}",
                "--protocol=tcp",
            ]

        hint = f"it holds the pool's memory (segment_bytes={self.segment_bytes} > 0)"
        return self._start(
            "mooncake_client", binary, hint, 1, argv, self.segment_log_path, timeout, first=True
        )

    def _start(
        self,
        name: str,
        binary: str | None,
        hint: str,
        num_ports: int,
        argv: Callable[..., list[str]],
        log: Path,
        timeout: float,
        first: bool = False,
    ) -> subprocess.Popen:
        """Run ``binary`` on fresh ports until it listens on all of them. A free port can
        be taken before the process binds it; it then exits (often without a word), so
        any early exit is retried on new ports. ``first``: stopped last (it holds data)."""
        if binary is None or not os.path.exists(binary):
            where = binary or "not in the mooncake package nor on PATH"
            raise KVPoolError(f"{name} not found ({where}): {hint}")
        for _attempt in range(3):
            ports = [free_port(self.host) for _ in range(num_ports)]
            try:
                proc = self._spawn([binary, *argv(*ports)], log)
            except OSError as e:
                raise KVPoolError(f"cannot run {name} ({binary}): {e}") from e
            self._procs.insert(0 if first else len(self._procs), proc)
            if self._wait_ready(proc, name, ports, log, timeout):
                return proc
            self._procs.remove(proc)
        raise KVPoolError(f"{name} ({binary}) exited with code {proc.returncode}; log:\n{_log_tail(log)}")

    # -- interface -------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The master's RPC address, ``host:port`` (what ``MooncakeStore`` connects to)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def pid(self) -> int:
        return self._master.pid

    @property
    def holder_pid(self) -> int | None:
        return None if self._holder is None else self._holder.pid

    @property
    def running(self) -> bool:
        return self._master.poll() is None

    def stop(self) -> None:
        """Stop the holder and the master and remove their logs (idempotent)."""
        self._finalizer()

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._finalizer.alive and self.running else "stopped"
        return f"MooncakeMaster({self.address}, {state}, segment {self.segment_bytes} bytes)"
