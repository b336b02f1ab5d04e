"""``MooncakeStore``: a ``BlockStore`` over one ``MooncakeDistributedStore`` client.

Blocks move zero-copy between a registered staging buffer and the pool (``batch_upsert_from``
/ ``batch_get_into``), in batches of at most ``max_batch`` keys: larger batches overflow the
TCP transport's per-peer queue and fail (older wheels stall instead).

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
* A stopped or hung master still accepts TCP connects (the kernel answers), so the probe
  passes and each call waits out the RPC timeout (30 s by default; ``MC_RPC_TIMEOUT_MS`` is
  set to 5 s here unless given). After a timeout, calls fail at once for a while (``_Quiet``).
* Staging copies use numpy: a torch copy of a block wakes torch's intra-op threads, which
  then spin and, on a small host, delay the transfer threads by milliseconds per call.
* All processes of one pool must use the same metadata mode: a client in P2PHANDSHAKE mode
  cannot reach segments registered through the HTTP metadata server.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from seer_engine.kv_connector.base import BlockStore, KVPoolError, KVPoolFull
from seer_engine.kv_connector.mooncake.common import (
    CONNECT_TIMEOUT_S,
    MIN_SEGMENT_BYTES,
    answers,
    split_address,
)

MAX_BATCH = 1024  # keys per Mooncake batch call (a few thousand to one peer fail)
DEFAULT_METADATA_PORT = 8080  # mooncake_master's default --http_metadata_server_port
DEFAULT_BUFFER_BYTES = 64 << 20
RPC_TIMEOUT_MS = "5000"  # a master call takes micro- to milliseconds; Mooncake waits 30 s
QUIET_S = (1.0, 60.0)  # after a master timeout calls fail at once this long, doubling to the cap

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


def _store_class() -> Any:
    """``MooncakeDistributedStore``, imported with quiet, bounded defaults.

    The log level is read when the library loads, so it is set before the import; a failed
    setup then gives up after two tries (~9 s) instead of retrying for ~90 s.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", RPC_TIMEOUT_MS)  # read by each new client
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise KVPoolError(
            "the mooncake KV pool needs the Mooncake wheel: pip install 'seer_engine[mooncake]' "
            f"(mooncake-transfer-engine-non-cuda, plus libibverbs1 and libnl-route-3-200): {e}"
        ) from e
    return MooncakeDistributedStore


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


class _Quiet:
    """Calls fail at once for a while after the master timed out (``QUIET_S``, doubling
    while it keeps timing out): a stopped master would otherwise cost every call of every
    instance the RPC timeout, holding the GIL, and stall the rollout instead of recomputing."""

    def __init__(self) -> None:
        self.until = 0.0
        self.pause_s = QUIET_S[0]
        self.timed_out_last = False  # the last call to reach the master timed out

    def check(self, master: str, what: str) -> None:
        left = self.until - time.monotonic()
        if left > 0:
            raise KVPoolError(
                f"cannot {what}: the Mooncake master at {master} timed out (stopped or hung?); "
                f"pool calls fail at once for {left:.1f} s more"
            )

    def timed_out(self) -> None:
        self.until = time.monotonic() + self.pause_s
        self.pause_s = min(2 * self.pause_s, QUIET_S[1])
        self.timed_out_last = True

    def answered(self) -> None:
        self.pause_s = QUIET_S[0]
        self.timed_out_last = False


@dataclass
class _Client:
    """One process's Mooncake client and the buffers registered with it (apart from the
    store, so that a finalizer can release them without keeping the store alive)."""

    client: Any
    staging: torch.Tensor
    retired: list[torch.Tensor]  # staging buffers replaced by larger ones
    pid: int
    quiet: _Quiet = field(default_factory=_Quiet)


def _release(handle: _Client, host: str, port: int) -> None:
    """Close the client; abandon it where closing would block (its master is gone) or is not
    this process's to do (a forked copy)."""
    client, handle.client = handle.client, None
    if client is None:
        return
    buffers = [handle.staging, *handle.retired]
    if os.getpid() != handle.pid or handle.quiet.timed_out_last or not answers(host, port):
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
        host, port = split_address(master)
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
        if not answers(self._host, self._port):
            raise KVPoolError(
                f"no Mooncake master answers at {spec.master} (TCP connect failed within "
                f"{CONNECT_TIMEOUT_S:.0f} s); start one with MooncakeMaster() or mooncake_master"
            )
        endpoint = _metadata_endpoint(spec.metadata_server)
        if endpoint is not None and not answers(*endpoint):
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
            why = ""
            if rc == -600 and spec.global_segment_size:  # Mooncake's answer to a segment it cannot allocate
                why = (
                    f": could this process not mount {spec.global_segment_size} bytes of its memory "
                    "into the pool (global_segment_size, the server's --kv-pool-gib)?"
                )
            raise KVPoolError(
                f"Mooncake client setup against master {spec.master} (metadata {spec.metadata_server}, "
                f"{spec.protocol}) failed with code {rc} after {time.monotonic() - start:.1f} s{why}"
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

    def _check_master_answers(self, what: str) -> None:
        """Fail fast where the client would retry for seconds: with its master gone, every
        call (lookups included) can block for ~4 to ~13 s. A loopback probe costs ~40 us."""
        self._h.quiet.check(self.master, what)
        if not answers(self._host, self._port):
            raise KVPoolError(f"cannot {what}: the Mooncake master at {self.master} does not answer")

    @contextmanager
    def _calling(self, what: str) -> Iterator[Any]:
        """The client, under this store's lock, once the master looks alive; a call that
        ends without raising ends a run of master timeouts."""
        with self._lock:
            client = self._live(what)
            self._check_master_answers(what)
            yield client
            self._h.quiet.answered()

    def _fail(self, what: str, key: str, code: int) -> KVPoolError:
        if code in (-900, -901):
            self._h.quiet.timed_out()
        where = f" (master {self.master})" if code in (-900, -901) else ""
        error = KVPoolFull if code == -200 else KVPoolError
        return error(f"Mooncake {what} of {key!r} failed{where}: {_describe(code)}")

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
        with self._calling(f"put {len(keys)} blocks") as client:
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
        with self._calling(f"get {len(keys)} blocks") as client:
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
        with self._calling(f"look up {len(keys)} keys") as client:
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
        with self._calling(f"remove {prefix!r}") as client:
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
