"""``mooncake``: the KV block pool in a Mooncake store, shared by engines on one or many hosts.

Three pieces:

* ``MooncakeMaster`` runs a ``mooncake_master`` (the wheel ships the binary) on free ports with
  its HTTP metadata server, and optionally a *segment holder*: a standalone ``mooncake_client``
  process that mounts the pool's memory. Values live in mounted segments, and a segment goes
  away with the process that mounted it, so memory held by a process of its own outlives every
  engine and Python process (an engine that exits or crashes loses nothing of the pool).
* ``MooncakeStore`` is a ``BlockStore`` over one ``MooncakeDistributedStore`` client. Blocks
  move zero-copy between a registered staging buffer and the pool (``batch_upsert_from`` /
  ``batch_get_into``), in batches of at most ``max_batch`` keys: larger batches overflow the
  TCP transport's per-peer queue and fail (older wheels stall instead).
* ``make_mooncake_connector`` wires a ``PooledConnector`` to a store, starting a master when
  it is given none.

Traps this module works around, all seen with ``mooncake-transfer-engine-non-cuda`` 0.3.13:

* ``batch_put_from`` on an existing key keeps the old value; ``batch_upsert_from`` replaces it.
* Reads grant the reader a lease (10 s): ``remove`` fails with OBJECT_HAS_LEASE unless forced.
* ``remove_by_regex`` searches (it is not anchored): prefixes are anchored with ``^``.
* With no master, ``setup`` retries for about 90 s; every call (puts, removes, and lookups
  and gets too when the master has just died) retries for ~4 to ~13 s; ``close`` (also run by
  the client's destructor) takes ~13 s. All of them hold the GIL. So the master's RPC port is
  probed (a TCP connect, ~40 us on loopback) before each call; a client whose master is gone
  is abandoned rather than closed. A master that dies between the probe and the call still
  costs that call its retries.
* Every master listens on an admin/metrics port (9003 by default): two masters on one host
  collide unless each gets its own.
* Staging copies use numpy: a torch copy of a block wakes torch's intra-op threads, which
  then spin and, on a small host, delay the transfer threads by milliseconds per call.
* A mounted segment must be at least 16 MiB (``mooncake_client`` aborts on less).
* All processes of one pool must use the same metadata mode: a client in P2PHANDSHAKE mode
  cannot reach segments registered through the HTTP metadata server.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from seer_engine.kv_connector.base import BlockStore, KVPoolError, PooledConnector

MAX_BATCH = 1024  # keys per Mooncake batch call (a few thousand to one peer fail)
DEFAULT_METADATA_PORT = 8080  # mooncake_master's default --http_metadata_server_port
DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_POOL_BYTES = 1 << 30
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake's allocator refuses (and mooncake_client aborts on) less
CONNECT_TIMEOUT_S = 2.0

# Mooncake's ErrorCode values that these calls return (the Python binding exports no enum).
_ERRORS = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
_HINTS = {
    -200: "the pool is full or has no memory mounted (MooncakeMaster(segment_bytes=...) or "
    "global_segment_size adds some)",
    -600: "the stored value is larger than the destination block",
    -704: "the key is not in the pool",
    -800: "the process holding the value's segment may be gone",
    -900: "the master does not answer",
    -901: "the master does not answer",
}


def _describe(code: int) -> str:
    text = f"{_ERRORS.get(code, 'error')} ({code})"
    hint = _HINTS.get(code)
    return f"{text}: {hint}" if hint else text


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a Mooncake master address looks like 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _answers(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at host:port (a refused port fails at once)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _local_ip_towards(host: str) -> str:
    """The address of this host's interface that routes to ``host`` (what peers must dial)."""
    if _is_loopback(host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _metadata_endpoint(url: str) -> tuple[str, int] | None:
    """host:port of an ``http://host:port/...`` metadata server (None for other modes)."""
    for scheme, default in (("http://", 80), ("https://", 443)):
        if url.startswith(scheme):
            netloc = url[len(scheme) :].split("/", 1)[0]
            host, sep, port = netloc.rpartition(":")
            return (host, int(port)) if sep and port.isdigit() else (netloc, default)
    return None


def _regex_prefix(prefix: str) -> str:
    """An anchored std::regex (ECMAScript) matching keys that start with ``prefix``."""
    return "^" + "".join("\\" + c if c in "\\^$.|?*+()[]{}" else c for c in prefix)


def find_binary(name: str) -> str | None:
    """The ``mooncake_master``/``mooncake_client`` executable the wheel ships, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _store_class() -> Any:
    """``MooncakeDistributedStore``, imported with quiet, bounded defaults.

    The log level is read when the library loads, so it is set before the import; a failed
    setup then gives up after two tries (~9 s) instead of retrying for ~90 s.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise KVPoolError(
            "the mooncake KV pool needs the Mooncake wheel: pip install 'seer_engine[mooncake]' "
            f"(mooncake-transfer-engine-non-cuda, plus libibverbs1 and libnl-route-3-200): {e}"
        ) from e
    return MooncakeDistributedStore


# -- the master ----------------------------------------------------------------------


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
    interpreter exit) ends both processes; started from the main thread, they also receive
    SIGTERM if this process dies without running its exit hooks.
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
        # PR_SET_PDEATHSIG fires when the *thread* that forked exits, so only the main thread
        # (which lives as long as the process) asks for it.
        main = threading.current_thread() is threading.main_thread()
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's Ctrl-C reaches this process, which stops the
                # master in order, not the master directly.
                start_new_session=True,
                preexec_fn=_parent_death_hook() if main else None,
            )

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
            if all(_answers(self.host, p, 0.5) for p in ports):
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
            ports = [_free_port(self.host) for _ in range(num_ports)]
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


# -- the store -----------------------------------------------------------------------


@dataclass(frozen=True)
class MooncakeSpec:
    """What another process needs to open its own client on the same pool (picklable)."""

    master: str
    metadata_server: str
    protocol: str = "tcp"
    device: str = ""
    global_segment_size: int = 0  # memory this client mounts into the pool
    local_buffer_size: int = DEFAULT_BUFFER_BYTES  # its registered staging buffer
    max_batch: int = MAX_BATCH
    local_hostname: str | None = None

    def open(self) -> MooncakeStore:
        return MooncakeStore.open(self)


_ABANDONED: list[object] = []


def _abandon(*objects: object) -> None:
    """Keep objects alive for good: the destructor of a client whose master is gone blocks ~13 s."""
    for obj in objects:
        _ABANDONED.append(obj)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # survives the list's teardown at exit


@dataclass
class _Client:
    """One process's Mooncake client and the buffers registered with it (apart from the
    store, so that a finalizer can release them without keeping the store alive)."""

    client: Any
    staging: torch.Tensor
    retired: list[torch.Tensor]  # staging buffers replaced by larger ones
    pid: int


def _release(handle: _Client, host: str, port: int) -> None:
    """Close the client; abandon it where closing would block (its master is gone) or is not
    this process's to do (a forked copy)."""
    client, handle.client = handle.client, None
    if client is None:
        return
    buffers = [handle.staging, *handle.retired]
    if os.getpid() != handle.pid or not _answers(host, port):
        _abandon(client, *buffers)
        return
    client.unregister_buffer(handle.staging.data_ptr())
    client.close()


class MooncakeStore(BlockStore):
    """A ``BlockStore`` over a Mooncake store; see the module docstring.

    ``master`` is the master's RPC ``host:port``; ``metadata_server`` defaults to the master's
    HTTP metadata server on its default port (``http://<master host>:8080/metadata``).
    ``global_segment_size`` bytes of this process's memory are mounted into the pool (0: the
    pool's memory lives elsewhere, e.g. in ``MooncakeMaster``'s segment holder); values in it
    go away when this client closes. ``local_buffer_size`` is the registered staging buffer
    blocks pass through (a batch of larger blocks grows it). ``protocol`` is ``tcp`` or
    ``rdma`` (then ``device`` names the RDMA NIC(s), e.g. ``mlx5_0``).
    """

    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata_server: str | None = None,
        *,
        protocol: str = "tcp",
        device: str = "",
        global_segment_size: int = 0,
        local_buffer_size: int = DEFAULT_BUFFER_BYTES,
        max_batch: int = MAX_BATCH,
        local_hostname: str | None = None,
    ) -> None:
        host, port = _split_address(master)
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if protocol == "rdma" and not device:
            raise ValueError("protocol 'rdma' needs device, the RDMA NIC name(s) (e.g. 'mlx5_0')")
        if global_segment_size and global_segment_size < MIN_SEGMENT_BYTES:
            raise ValueError(
                f"global_segment_size must be 0 or at least {MIN_SEGMENT_BYTES} (16 MiB), "
                f"got {global_segment_size}"
            )
        if local_buffer_size < 1 or max_batch < 1:
            raise ValueError(
                f"need local_buffer_size >= 1 and max_batch >= 1, got {local_buffer_size}, {max_batch}"
            )
        if metadata_server is None:
            metadata_server = f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        self._spec = MooncakeSpec(
            master=master,
            metadata_server=metadata_server,
            protocol=protocol,
            device=device,
            global_segment_size=global_segment_size,
            local_buffer_size=local_buffer_size,
            max_batch=max_batch,
            local_hostname=local_hostname,
        )
        self._host, self._port = host, port
        self.max_batch = max_batch
        self._lock = threading.Lock()
        client, staging = self._connect(local_hostname or _local_ip_towards(host))
        self._h = _Client(client, staging, [], os.getpid())
        # Closes at garbage collection and interpreter exit too (before the masters started
        # earlier stop), where the client's own destructor could block for seconds.
        self._finalizer = weakref.finalize(self, _release, self._h, host, port)

    @classmethod
    def open(cls, spec: MooncakeSpec) -> MooncakeStore:
        """A client of the pool ``spec`` describes, in this process."""
        return cls(**asdict(spec))

    @property
    def spec(self) -> MooncakeSpec:
        """For other processes: their clients mount no memory (the pool's memory stays where it is)."""
        return replace(self._spec, global_segment_size=0)

    @property
    def master(self) -> str:
        return self._spec.master

    def _connect(self, local_hostname: str) -> tuple[Any, torch.Tensor]:
        spec = self._spec
        if not _answers(self._host, self._port):
            raise KVPoolError(
                f"no Mooncake master answers at {spec.master} (TCP connect failed within "
                f"{CONNECT_TIMEOUT_S:.0f} s); start one with MooncakeMaster() or mooncake_master"
            )
        endpoint = _metadata_endpoint(spec.metadata_server)
        if endpoint is not None and not _answers(*endpoint):
            raise KVPoolError(
                f"the Mooncake metadata server {spec.metadata_server} does not answer (master "
                f"{spec.master}; it needs --enable_http_metadata_server=true and that port)"
            )
        client = _store_class()()
        start = time.monotonic()
        rc = client.setup(
            local_hostname,
            spec.metadata_server,
            spec.global_segment_size,
            0,  # Mooncake's own local buffer: unused, transfers go through our registered one
            spec.protocol,
            spec.device,
            spec.master,
        )
        if rc != 0:
            raise KVPoolError(
                f"Mooncake client setup against master {spec.master} (metadata {spec.metadata_server}, "
                f"{spec.protocol}) failed with code {rc} after {time.monotonic() - start:.1f} s"
            )
        staging = torch.empty(spec.local_buffer_size, dtype=torch.uint8)
        rc = client.register_buffer(staging.data_ptr(), staging.numel())
        if rc != 0:
            client.close()
            raise KVPoolError(f"Mooncake could not register a {staging.numel()}-byte buffer: code {rc}")
        return client, staging

    # -- helpers ---------------------------------------------------------------------

    def _live(self, what: str) -> Any:
        if self._h.client is None:
            raise KVPoolError(f"cannot {what}: this Mooncake store handle is closed")
        if os.getpid() != self._h.pid:
            raise KVPoolError(
                f"cannot {what}: this Mooncake client belongs to process {self._h.pid}; open one in "
                "this process with MooncakeStore.open(store.spec)"
            )
        return self._h.client

    def _master_answers(self, what: str) -> None:
        """Fail fast where the client would retry for seconds: with its master gone, every
        call (lookups included) can block for ~4 to ~13 s. A loopback probe costs ~40 us."""
        if not _answers(self._host, self._port):
            raise KVPoolError(f"cannot {what}: the Mooncake master at {self.master} does not answer")

    def _fail(self, what: str, key: str, code: int) -> KVPoolError:
        where = f" (master {self.master})" if code in (-900, -901) else ""
        return KVPoolError(f"Mooncake {what} of {key!r} failed{where}: {_describe(code)}")

    def _stage(self, block_bytes: int) -> int:
        """Blocks per batch; grows the staging buffer when one block does not fit."""
        h = self._h
        if block_bytes > h.staging.numel():
            bigger = torch.empty(block_bytes, dtype=torch.uint8)
            rc = h.client.register_buffer(bigger.data_ptr(), bigger.numel())
            if rc != 0:
                raise KVPoolError(
                    f"Mooncake could not register a {block_bytes}-byte staging buffer: code {rc}"
                )
            h.client.unregister_buffer(h.staging.data_ptr())
            h.retired.append(h.staging)  # a failed transfer may still touch it
            h.staging = bigger
        return max(1, min(self.max_batch, h.staging.numel() // block_bytes))

    @staticmethod
    def _check_rows(t: torch.Tensor, n: int, what: str) -> int:
        if t.dim() == 0 or t.shape[0] != n:
            rows = "a scalar" if t.dim() == 0 else f"{t.shape[0]} rows"
            raise ValueError(f"{what} has {rows} for {n} keys")
        block_bytes = t[0].numel() * t.element_size() if n else 0
        if n and block_bytes == 0:
            raise ValueError(f"{what} rows are empty")
        return block_bytes

    # -- BlockStore ------------------------------------------------------------------

    def put(self, keys: list[str], blocks: torch.Tensor) -> None:
        bb = self._check_rows(blocks, len(keys), "blocks")
        if not keys:
            return
        last = {key: i for i, key in enumerate(keys)}  # a key given twice keeps its last value
        rows = blocks.detach()
        if len(last) < len(keys):
            keys, rows = list(last), rows[list(last.values())]
        rows = rows.to("cpu").contiguous().reshape(len(keys), -1).view(torch.uint8).numpy()
        with self._lock:
            client = self._live("put")
            self._master_answers(f"put {len(keys)} blocks")
            per = self._stage(bb)
            staging = self._h.staging
            base = staging.data_ptr()
            for start in range(0, len(keys), per):
                part = keys[start : start + per]
                staged = staging.numpy()[: len(part) * bb].reshape(len(part), bb)
                np.copyto(staged, rows[start : start + len(part)])
                codes = client.batch_upsert_from(
                    part, [base + i * bb for i in range(len(part))], [bb] * len(part)
                )
                for key, code in zip(part, codes):
                    if code != 0:
                        raise self._fail("put", key, code)

    def get_into(self, keys: list[str], out: torch.Tensor) -> None:
        bb = self._check_rows(out, len(keys), "out")
        if not keys:
            return
        direct = out.device.type == "cpu" and out.is_contiguous()
        # numpy copies: one thread, where torch's intra-op threads (woken per copy, then
        # spinning) delay the transfer threads by milliseconds on a small host
        if direct:
            dst = out.detach().view(len(keys), -1).view(torch.uint8).numpy()
        else:
            dst = np.empty((len(keys), bb), dtype=np.uint8)
        with self._lock:
            client = self._live("get")
            self._master_answers(f"get {len(keys)} blocks")
            per = self._stage(bb)
            staging = self._h.staging
            base = staging.data_ptr()
            for start in range(0, len(keys), per):
                part = keys[start : start + per]
                codes = client.batch_get_into(
                    part, [base + i * bb for i in range(len(part))], [bb] * len(part)
                )
                for key, code in zip(part, codes):
                    if code < 0:
                        raise self._fail("get", key, code)
                    if code != bb:
                        raise KVPoolError(f"Mooncake value of {key!r} is {code} bytes; the block needs {bb}")
                staged = staging.numpy()[: len(part) * bb].reshape(len(part), bb)
                np.copyto(dst[start : start + len(part)], staged)
        if not direct:
            out.copy_(torch.from_numpy(dst).view(out.dtype).view(out.shape))

    def count_leading(self, keys: list[str]) -> int:
        with self._lock:
            client = self._live("look up keys")
            self._master_answers(f"look up {len(keys)} keys")
            for start in range(0, len(keys), self.max_batch):
                part = keys[start : start + self.max_batch]
                for i, (key, found) in enumerate(zip(part, client.batch_is_exist(part))):
                    if found == 0:
                        return start + i
                    if found != 1:
                        raise self._fail("lookup", key, found)
        return len(keys)

    def remove_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` on the master (whoever put them)."""
        if not prefix:
            raise ValueError("an empty prefix would remove the whole pool")
        with self._lock:
            client = self._live(f"remove {prefix!r}")
            self._master_answers(f"remove {prefix!r}")
            # force: readers hold leases (10 s) that would make the removal fail
            removed = client.remove_by_regex(_regex_prefix(prefix), force=True)
        if removed < 0:
            raise self._fail("removal", prefix + "*", removed)
        return removed

    def close(self) -> None:
        """Close this client (idempotent); the pool lives on. Values in this client's own
        segment (``global_segment_size``) go with it."""
        with self._lock:
            self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._h.client is None else "open"
        return f"MooncakeStore({self.master}, {self._spec.protocol}, {state})"


def make_mooncake_connector(
    block_size: int,
    master: str | None = None,
    namespace: str = "seer",
    *,
    metadata_server: str | None = None,
    pool_bytes: int = DEFAULT_POOL_BYTES,
    protocol: str = "tcp",
    device: str = "",
) -> tuple[PooledConnector, MooncakeMaster | None]:
    """A connector over a Mooncake pool, and the master it started (None when given one).

    Without ``master`` a ``MooncakeMaster`` starts here, with ``pool_bytes`` of memory in its
    segment holder; stop it (``stop()``) when the pool is done. With a master address this
    process mounts ``pool_bytes`` into that pool. Other processes open their own handle with
    ``PooledConnector(connector.store.spec.open(), block_size, namespace)``.
    """
    owned = MooncakeMaster(segment_bytes=pool_bytes) if master is None else None
    try:
        store = MooncakeStore(
            owned.address if owned else master,
            owned.metadata_server if owned else metadata_server,
            protocol=protocol,
            device=device,
            global_segment_size=0 if owned else pool_bytes,
        )
    except BaseException:
        if owned is not None:
            owned.stop()
        raise
    return PooledConnector(store, block_size, namespace), owned
