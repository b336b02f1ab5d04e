"""``local``: a KV block pool in POSIX shared memory, for engine instances that run as
separate processes on one host.

The pool is two shared-memory segments and a lock:

* the data slab: ``num_slots`` fixed-size slots of ``block_bytes`` (one KV block each);
* the index: a small header and four ``uint64`` arrays, one entry per slot: the hash of
  the key in the slot, the hash of its parent (the key up to its last ``/``), a
  version that changes whenever the slot changes hands, and the pid of the put that
  claimed it;
* a lock: ``fcntl.flock`` on the index segment's file (a lock file in the temp directory
  where shared memory has no path) serialises index access across processes. It is
  always taken exclusive: the sections are short (a scan of the index), and shared locks
  would let a stream of readers starve a writer. The kernel drops a dead process's lock,
  so a crash cannot wedge the pool; a process that stops while holding it (SIGSTOP, a
  hung instance) makes the others' calls fail with ``KVPoolError`` after
  ``LOCK_TIMEOUT_S`` (they recompute instead), then fail at once until the lock is free
  again, so a hung instance holds up no other. Only a put's publish waits for the lock
  as long as it takes: giving up there would leave its claimed slots behind.

The creator (``LocalStore.create``) owns the pool and destroys it on ``close()``, when the
store is garbage-collected, or at interpreter exit. Any process on the host attaches with
``LocalStore.open(spec)``; its ``close()`` only detaches.

A put claims its slots under the lock (the key reads as absent while it is written),
allocates their pages (segments are sparse, and ``/dev/shm`` may have filled since the pool
was made: no room is ``KVPoolFull``, where a copy would be SIGBUS), copies the bytes without
the lock, then publishes the key hashes under the lock: readers never see a half-written
block. A read resolves its slots under the lock, copies without
it, and checks under the lock that no slot changed hands meanwhile (else it retries):
concurrent puts and removes never hand a reader mixed bytes.

Keys are hashed with BLAKE2b to 64 bits (stable across processes, unlike ``hash``); two
distinct keys or parents colliding is possible in principle (about n^2 / 2^64) and is
ignored. Lookups scan the whole index with numpy: linear in ``num_slots``, which is
cheap for pools of real KV blocks (a block is hundreds of KiB, so a pool of many GiB
has some 10^4 slots: well under a millisecond); millions of tiny slots would want a
hash table instead.

A process that dies between claiming slots and publishing them (an instance killed
mid-save) leaves them claimed; they are taken back at the next removal of any key or
when a put finds the pool full, once the claiming pid is gone (a zombie counts as gone). An overwrite reads as
absent while it is written (the connector then recomputes), and is lost if its copy
fails.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import tempfile
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

from seer_engine.core.file_lock import flock_within
from seer_engine.kv_connector.base import BlockStore, KVPoolError, KVPoolFull
from seer_engine.kv_connector.shm import (
    SHM_DIR,
    TRACKER_LOCK,
    attach,
    check_shm_room,
    lock_file_for,
    pid_alive,
    reserve,
)

# Values of a slot's key hash that are states, not keys (real hashes are shifted past them).
_FREE = 0  # nothing in the slot
_WRITING = 1  # claimed by a put that is copying its bytes in
_CANCELLED = 2  # claimed, but its parent was removed meanwhile: freed at publish, not published
_FIRST_HASH = 3

_MAGIC = 0x5EE2_4B56_504F_4F4C  # "seer KV POOL"; marks an index segment as ours
_LAYOUT = 2
_HEADER_WORDS = 4  # magic, layout, num_slots, block_bytes
_READ_TRIES = 4  # a read retries when a concurrent put/remove takes one of its slots mid-copy
LOCK_TIMEOUT_S = 2.0  # index sections take microseconds: a holder this slow is stuck


@dataclass(frozen=True)
class LocalPoolSpec:
    """Everything another process needs to attach to a pool (picklable, a few strings)."""

    data_name: str
    index_name: str
    num_slots: int
    block_bytes: int
    lock_path: str


def _hash(text: str) -> int:
    """A 64-bit hash that every process computes alike; never one of the state values."""
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return h + _FIRST_HASH if h < _FIRST_HASH else h


def _key_hashes(keys: list[str]) -> np.ndarray:
    return np.fromiter((_hash(k) for k in keys), dtype=np.uint64, count=len(keys))


def _parent_hashes(keys: list[str]) -> np.ndarray:
    seen: dict[str, int] = {}  # one put's keys usually share a parent
    out = np.empty(len(keys), dtype=np.uint64)
    for i, key in enumerate(keys):
        parent, sep, _ = key.rpartition("/")
        if not sep:
            raise ValueError(f"local KV pool keys look like '<parent>/<index>'; got {key!r}")
        if parent not in seen:
            seen[parent] = _hash(parent)
        out[i] = seen[parent]
    return out


class _Mapping:
    """One process's attachment: segments, array views over them, the lock file.

    Kept apart from ``LocalStore`` so that a finalizer can release it without keeping
    the store alive. The views must be dropped before the segments close (an exported
    buffer makes ``SharedMemory.close`` fail).
    """

    def __init__(self, spec: LocalPoolSpec, data: SharedMemory, index: SharedMemory, owner: bool) -> None:
        n = spec.num_slots
        self.data = data
        self.index = index
        self.lock_path = spec.lock_path
        self.lock_fd = os.open(spec.lock_path, os.O_RDWR)
        self.lock_pid = os.getpid()  # flock is per open file: a forked child opens its own
        self.owner_pid = os.getpid() if owner else None
        self.thread_lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self.lock_stuck = False  # the last bounded wait for the lock timed out
        # numpy, not torch: its single-threaded memcpy is as fast for one block, and torch's
        # intra-op threads can cost milliseconds per copy on a busy host.
        self.slab: np.ndarray | None = np.ndarray((n, spec.block_bytes), dtype=np.uint8, buffer=data.buf)
        words = _HEADER_WORDS + 4 * n
        table = np.ndarray((words,), dtype=np.uint64, buffer=index.buf)
        self.header: np.ndarray | None = table[:_HEADER_WORDS]
        self.keys: np.ndarray | None = table[_HEADER_WORDS : _HEADER_WORDS + n]
        self.parents: np.ndarray | None = table[_HEADER_WORDS + n : _HEADER_WORDS + 2 * n]
        self.versions: np.ndarray | None = table[_HEADER_WORDS + 2 * n : _HEADER_WORDS + 3 * n]
        self.writers: np.ndarray | None = table[_HEADER_WORDS + 3 * n :]  # pid of the claiming put

    def fd(self) -> int:
        if self.lock_pid != os.getpid():
            os.close(self.lock_fd)
            try:
                self.lock_fd = os.open(self.lock_path, os.O_RDWR)
            except FileNotFoundError as e:
                raise KVPoolError(f"local KV pool lock {self.lock_path} is gone (pool closed)") from e
            self.lock_pid = os.getpid()
        return self.lock_fd


def _abandoned(m: _Mapping) -> np.ndarray:
    """Slots claimed by a put whose process is gone (it died mid-copy)."""
    claimed = np.flatnonzero((m.keys == _WRITING) | (m.keys == _CANCELLED))
    dead = [slot for slot in claimed.tolist() if not pid_alive(int(m.writers[slot]))]
    return np.asarray(dead, dtype=np.int64)


def _lock_within(m: _Mapping, fd: int, timeout_s: float) -> None:
    """``flock`` exclusive, polled, for at most ``timeout_s``; ``KVPoolError`` past it."""
    if not flock_within(fd, timeout_s, max_pause_s=1e-3):
        m.lock_stuck = True
        raise KVPoolError(
            f"the local KV pool's lock has been held for over {LOCK_TIMEOUT_S:g} s "
            "(a stopped or hung process?)"
        )


def _release(m: _Mapping) -> None:
    """Detach; the owning process (not a forked child of it) also destroys the pool."""
    m.slab = m.header = m.keys = m.parents = m.versions = m.writers = None
    for shm in (m.data, m.index):
        try:
            shm.close()
        except BufferError:  # a view escaped; the mapping goes away with the process
            pass
    try:
        os.close(m.lock_fd)
    except OSError:
        pass
    if m.owner_pid == os.getpid():
        for shm in (m.data, m.index):
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        try:
            os.unlink(m.lock_path)
        except FileNotFoundError:
            pass


class LocalStore(BlockStore):
    """A ``BlockStore`` in shared memory; see the module docstring for the layout.

    Make one with ``create`` (the owner) and attach others with ``open(store.spec)``.
    ``remove_prefix`` only takes a prefix ending in ``/`` and removes the keys whose
    parent is exactly that prefix (``a/b/`` removes ``a/b/0``, not ``a/b/c/0``): that is
    how ``PooledConnector`` frees a response, and it lets the index match one hash.
    """

    name = "local"

    def __init__(self, spec: LocalPoolSpec, mapping: _Mapping) -> None:
        """Use ``create`` or ``open``."""
        self.spec = spec
        self._m: _Mapping | None = mapping
        self._finalizer = weakref.finalize(self, _release, mapping)

    @classmethod
    def create(cls, capacity_bytes: int, block_bytes: int, lock_dir: str | None = None) -> LocalStore:
        """A new, empty pool of ``capacity_bytes // block_bytes`` slots, owned by this process."""
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be a positive integer, got {block_bytes!r}")
        num_slots = int(capacity_bytes) // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"a local KV pool of {capacity_bytes} bytes cannot hold one block of {block_bytes} bytes"
            )
        check_shm_room(num_slots * block_bytes + 8 * (_HEADER_WORDS + 4 * num_slots))
        base = f"seer_kv_{os.getpid()}_{secrets.token_hex(6)}"  # the pid tells whose segment it is
        data_name, index_name = f"{base}_data", f"{base}_index"
        fallback = os.path.join(lock_dir or tempfile.gettempdir(), f"{base}.lock")
        made: list[SharedMemory] = []
        lock_path = None
        try:
            with TRACKER_LOCK:  # registered: the tracker unlinks them if this process dies
                made.append(SharedMemory(data_name, create=True, size=num_slots * block_bytes))
                index_bytes = 8 * (_HEADER_WORDS + 4 * num_slots)
                made.append(SharedMemory(index_name, create=True, size=index_bytes))  # zeros: free
            if not reserve(made[1], [0], index_bytes):  # every put and free writes in it
                raise ValueError(f"no room in {SHM_DIR} for a local KV pool's index of {index_bytes} bytes")
            lock_path = lock_file_for(index_name, fallback)
            spec = LocalPoolSpec(data_name, index_name, num_slots, block_bytes, lock_path)
            mapping = _Mapping(spec, made[0], made[1], owner=True)
        except BaseException:
            for shm in made:
                shm.close()
                shm.unlink()
            if lock_path == fallback:
                os.unlink(fallback)
            raise
        mapping.header[:] = [_MAGIC, _LAYOUT, num_slots, block_bytes]
        return cls(spec, mapping)

    @classmethod
    def open(cls, spec: LocalPoolSpec) -> LocalStore:
        """Attach to the pool ``spec`` names (from any process on this host)."""
        attached: list[SharedMemory] = []
        try:
            attached.append(attach(spec.data_name))
            attached.append(attach(spec.index_name))
            mapping = _Mapping(spec, attached[0], attached[1], owner=False)
        except FileNotFoundError as e:
            for shm in attached:
                shm.close()
            raise KVPoolError(
                f"local KV pool {spec.data_name} is not in this process's {SHM_DIR} (closed by its owner, "
                "or on another host or container: a local pool serves one host; --kv-connector mooncake "
                "spans hosts)"
            ) from e
        except BaseException:
            for shm in attached:
                shm.close()
            raise
        store = cls(spec, mapping)
        found = mapping.header.tolist()
        if found != [_MAGIC, _LAYOUT, spec.num_slots, spec.block_bytes]:
            store.close()
            raise KVPoolError(f"shared memory {spec.index_name} is not the local KV pool {spec} describes")
        return store

    # -- stats ---------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.spec.num_slots

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.spec.num_slots * self.spec.block_bytes

    @property
    def used_slots(self) -> int:
        """Slots holding a key or being written by a put."""
        with self._locked() as m:
            return int(np.count_nonzero(m.keys != _FREE))

    def __repr__(self) -> str:
        state = "closed" if self._m is None else f"{self.num_slots} slots of {self.block_bytes} bytes"
        return f"LocalStore({self.spec.data_name}, {state})"

    # -- BlockStore ----------------------------------------------------------------

    @contextmanager
    def _locked(self, bounded: bool = True) -> Iterator[_Mapping]:
        """Hold the pool lock (block copies happen outside it). ``bounded``: give up with
        ``KVPoolError`` when another process holds it past ``LOCK_TIMEOUT_S`` (at once while
        the last bounded wait had to give up); else wait as long as it takes."""
        m = self._m
        if m is None:
            raise KVPoolError("this local KV pool handle is closed")
        with m.thread_lock:
            fd = m.fd()
            if bounded:
                _lock_within(m, fd, 0.0 if m.lock_stuck else LOCK_TIMEOUT_S)
            else:
                fcntl.flock(fd, fcntl.LOCK_EX)
            m.lock_stuck = False
            try:
                yield m
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    @staticmethod
    def _find(m: _Mapping, hashes: np.ndarray) -> np.ndarray:
        """The slot of each key hash, -1 where absent (one vectorised scan of the index)."""
        hit = np.flatnonzero(np.isin(m.keys, hashes))
        where = dict(zip(m.keys[hit].tolist(), hit.tolist()))
        return np.fromiter((where.get(h, -1) for h in hashes.tolist()), dtype=np.int64, count=len(hashes))

    @staticmethod
    def _free_slots(m: _Mapping, slots: np.ndarray) -> None:
        m.keys[slots] = _FREE
        m.parents[slots] = 0
        m.versions[slots] += 1  # tells a reader mid-copy that the slot changed hands

    def _check_rows(self, t: torch.Tensor, n: int, what: str) -> None:
        if t.dim() == 0 or t.shape[0] != n:
            rows = "a scalar" if t.dim() == 0 else f"{t.shape[0]} rows"
            raise ValueError(f"{what} has {rows} for {n} keys")
        if n and t[0].numel() * t.element_size() != self.block_bytes:
            raise ValueError(
                f"the local KV pool stores blocks of {self.block_bytes} bytes; {what} rows of shape "
                f"{tuple(t.shape[1:])} and dtype {t.dtype} are {t[0].numel() * t.element_size()} bytes"
            )

    def put(self, keys: list[str], blocks: torch.Tensor) -> None:
        self._check_rows(blocks, len(keys), "blocks")
        if not keys:
            return
        last = {key: i for i, key in enumerate(keys)}  # a key given twice keeps its last value
        unique = list(last)
        key_h, parent_h = _key_hashes(unique), _parent_hashes(unique)
        rows = blocks.detach()
        if len(unique) < len(keys):
            rows = rows[list(last.values())]
        rows = rows.to("cpu").contiguous().reshape(len(unique), -1).view(torch.uint8)

        with self._locked() as m:
            slots = self._find(m, key_h)  # an existing key is overwritten in its own slot
            new = slots < 0
            need = int(new.sum())
            if need:
                free = np.flatnonzero(m.keys == _FREE)
                if len(free) < need:
                    self._free_slots(m, _abandoned(m))
                    free = np.flatnonzero(m.keys == _FREE)
                if len(free) < need:  # before any change: a failed put leaves nothing behind
                    raise KVPoolFull(
                        f"local KV pool full: {need} new blocks, {len(free)} of {m.keys.size} slots free "
                        f"(capacity {self.capacity_bytes} bytes in blocks of {self.block_bytes})"
                    )
                slots[new] = free[:need]
            m.keys[slots] = _WRITING
            m.parents[slots] = parent_h
            m.versions[slots] += 1
            m.writers[slots] = os.getpid()
        if not reserve(m.data, slots.tolist(), self.block_bytes):
            with self._locked(bounded=False) as m:
                self._free_slots(m, slots)
            raise KVPoolFull(f"local KV pool: {SHM_DIR} has no room left for {len(slots)} more blocks")
        try:
            m.slab[slots] = rows.numpy()
        except BaseException:
            with self._locked(bounded=False) as m:
                self._free_slots(m, slots)  # an overwritten key is lost with it
            raise
        with self._locked(bounded=False) as m:  # giving up would leave the slots claimed
            mine = m.keys[slots] == _WRITING
            self._free_slots(m, slots[~mine])  # removed while being written
            key_h = key_h[mine]
            # A concurrent put of the same key published first: the later publish wins.
            self._free_slots(m, np.flatnonzero(np.isin(m.keys, key_h)))
            m.keys[slots[mine]] = key_h

    def get_into(self, keys: list[str], out: torch.Tensor) -> None:
        self._check_rows(out, len(keys), "out")
        if not keys:
            return
        key_h = _key_hashes(keys)
        direct = out.device.type == "cpu" and out.is_contiguous()
        if direct:
            dst = out.detach().view(len(keys), -1).view(torch.uint8)
        else:
            dst = torch.empty((len(keys), self.block_bytes), dtype=torch.uint8)
        dst_np = dst.numpy()
        for _ in range(_READ_TRIES):
            with self._locked() as m:
                slots = self._find(m, key_h)
                missing = np.flatnonzero(slots < 0)
                if len(missing):
                    raise KVPoolError(f"key {keys[int(missing[0])]!r} is not in the local KV pool")
                versions = m.versions[slots]
            np.take(m.slab, slots, axis=0, out=dst_np, mode="clip")  # "clip": no buffering; slots are valid
            with self._locked() as m:
                if np.array_equal(m.keys[slots], key_h) and np.array_equal(m.versions[slots], versions):
                    break
        else:
            raise KVPoolError(
                f"local KV pool: blocks from {keys[0]!r} on were rewritten during {_READ_TRIES} reads"
            )
        if not direct:
            out.copy_(dst.view(out.dtype).view(out.shape))

    def count_leading(self, keys: list[str]) -> int:
        if not keys:
            return 0
        key_h = _key_hashes(keys)
        with self._locked() as m:
            slots = self._find(m, key_h)
        missing = np.flatnonzero(slots < 0)
        return int(missing[0]) if len(missing) else len(keys)

    def remove_prefix(self, prefix: str) -> int:
        """Remove the keys whose parent + "/" is ``prefix`` (see the class docstring)."""
        if not prefix.endswith("/"):
            raise ValueError(
                f"the local KV pool removes one parent's keys: the prefix must end in '/', got {prefix!r}"
            )
        parent_h = _hash(prefix[:-1])
        with self._locked() as m:
            ours = m.parents == parent_h
            self._free_slots(m, _abandoned(m))  # any dead put's, not only ours
            m.keys[ours & (m.keys == _WRITING)] = _CANCELLED  # the put frees them when done
            published = np.flatnonzero(ours & (m.keys >= _FIRST_HASH))
            self._free_slots(m, published)
        return len(published)

    def close(self) -> None:
        """Detach; in the creating process, also destroy the pool (idempotent)."""
        self._m = None
        self._finalizer()
