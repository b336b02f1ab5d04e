"""Moving a response's KV between engine instances at chunk boundaries.

Divided rollout is cheap when the next chunk of a response can run on any instance
without recomputing its context. A connector saves a request's KV when a chunk ends,
says how much of it a pool holds, loads it into another instance, and frees it when
the response finishes. ``RecomputeConnector`` holds nothing: a response that moves
recomputes its context on the new instance (the rollout counts those tokens).

``PooledConnector`` is the one implementation over a pool: it stores a response's
full KV blocks under ``<namespace>/<response, "/" escaped>/<block index>-<digest>`` in a ``BlockStore``
(``local``: shared memory on this host; ``mooncake``: the Mooncake store), and loads
them into the target engine's prefix cache, so the next chunk finds its context as
prefix hits: the uniform scheduling rule then computes only what is missing (the
last partial block). Pool trouble never loses a request: the connector counts the
failure, logs it once, and the request recomputes.

A connector reaches an engine only through ``KVBlockIO`` (``LLMEngine`` implements it):
it never sees the engine's scheduler, runner or cache tensors.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol, runtime_checkable
from urllib.parse import quote

import numpy as np
import torch

logger = logging.getLogger(__name__)

UNFREED_LIMIT = 10_000  # finished responses whose pool entries a failed free left, retried later


@runtime_checkable
class KVBlockIO(Protocol):
    """An engine's KV blocks as a connector reads and writes them.

    Blocks are named by the chained hashes of the full blocks of a context (equal in
    every process), found in and adopted into the engine's prefix cache, and moved as
    one contiguous tensor ``[n, *kv_block_shape]``.
    """

    @property
    def kv_block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's shape, ``(layers, 2, block_size, kv_heads, head_dim)``."""
        ...

    @property
    def kv_block_dtype(self) -> torch.dtype: ...

    def kv_block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of ``token_ids``."""
        ...

    def cached_kv_blocks(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the leading run of ``hashes`` held in the prefix cache."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of the blocks, ``[n, *kv_block_shape]``."""
        ...

    def adopt_kv_blocks(self, hashes: Sequence[int], start: int) -> list[int] | None:
        """Blocks registered in the prefix cache for ``hashes[start:]`` behind the cached
        ``hashes[:start]``, to be filled by ``write_kv_blocks``; None when they cannot be
        had (the prefix is gone, too few free blocks, no prefix caching)."""
        ...

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Fill the blocks from ``blocks`` (``[n, *kv_block_shape]``)."""
        ...


class KVPoolError(RuntimeError):
    """The pool cannot serve a call (down, full, or the entry is gone)."""


class KVPoolFull(KVPoolError):
    """The pool has no room for a put: a cache at capacity, which works on (its responses
    recompute), not a pool that is down."""


@dataclass
class LoadResult:
    tokens: int  # leading context tokens whose KV the target instance now holds
    loaded_tokens: int = 0  # of those, tokens that came from the pool in this call
    error: str | None = None  # why the pool could not serve it; the caller recomputes


@dataclass
class ConnectorStats:
    saved_blocks: int = 0
    loaded_blocks: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0
    save_s: float = 0.0
    load_s: float = 0.0
    failures: int = 0  # calls the pool could not serve (the request recomputed)
    down: str | None = None  # why the last call failed, other than for room; None once one is served


class KVConnector:
    name = "abstract"

    def __init__(self) -> None:
        self.stats = ConnectorStats()

    def save(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> int:
        """Offer the KV of ``token_ids`` (a finished chunk's context, in ``engine``'s
        prefix cache) to the pool; returns the leading tokens the pool now holds.
        ``epoch``: the weights the KV was computed with (the rollout counts its weight
        updates); a save, lookup or load sees only entries of its own epoch."""
        raise NotImplementedError

    def lookup(self, key: str, token_ids: list[int], epoch: int = 0) -> int:
        """How many leading tokens of ``key``'s context ``token_ids`` the pool holds."""
        raise NotImplementedError

    def load(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> LoadResult:
        """Place the pooled KV into ``engine`` so its prefix cache serves ``token_ids``."""
        raise NotImplementedError

    def free(self, key: str) -> None:
        """The response finished: drop its pool entry (not left to eviction)."""
        raise NotImplementedError

    def free_left(self) -> None:
        """Retry the frees the pool failed (an idle server: no later free would)."""

    def close(self) -> None:
        """Release this process's handle on the pool."""


class SharedHandle(KVConnector):
    """One user's handle on a connector shared in this process (in-process instances
    and their dispatcher): calls go to the shared connector, and ``stats`` counts this
    user's own calls, so the users' stats add up to each call counted once."""

    def __init__(self, shared: KVConnector) -> None:
        super().__init__()
        self.shared = shared
        self.name = shared.name

    def __getattr__(self, name: str):
        if name == "shared":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.shared, name)  # the store and the rest of the shared connector

    def _own(self, call, *args):
        before = replace(self.shared.stats)
        try:
            return call(*args)
        finally:
            after = self.shared.stats
            for f in fields(ConnectorStats):
                if f.name != "down":
                    setattr(
                        self.stats,
                        f.name,
                        getattr(self.stats, f.name) + getattr(after, f.name) - getattr(before, f.name),
                    )
            self.stats.down = after.down

    def save(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> int:
        return self._own(self.shared.save, key, engine, token_ids, epoch)

    def lookup(self, key: str, token_ids: list[int], epoch: int = 0) -> int:
        return self._own(self.shared.lookup, key, token_ids, epoch)

    def load(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> LoadResult:
        return self._own(self.shared.load, key, engine, token_ids, epoch)

    def free(self, key: str) -> None:
        return self._own(self.shared.free, key)

    def free_left(self) -> None:
        return self._own(self.shared.free_left)


class RecomputeConnector(KVConnector):
    """No pool: moving a response recomputes its KV on the target instance."""

    name = "recompute"

    @classmethod
    def unreachable(cls, why: str) -> RecomputeConnector:
        """Stands in for a pool this process could not open: counted as one failure, and
        down for good (``/health`` says so)."""
        logger.warning("KV pool unavailable here: %s", why)
        connector = cls()
        connector.stats.failures, connector.stats.down = 1, why
        return connector

    def save(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> int:
        return 0

    def lookup(self, key: str, token_ids: list[int], epoch: int = 0) -> int:
        return 0

    def load(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> LoadResult:
        return LoadResult(tokens=0)

    def free(self, key: str) -> None:
        return None


class BlockStore:
    """What a pool backend provides: fixed-size byte values under string keys.

    Every value is one KV block as ``PooledConnector`` lays it out (a contiguous
    ``[layers, 2, block_size, kv_heads, head_dim]`` tensor). Methods raise
    ``KVPoolError`` when the pool cannot serve them.
    """

    name = "abstract"

    def put(self, keys: list[str], blocks: torch.Tensor) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` (overwriting what is there)."""
        raise NotImplementedError

    def get_into(self, keys: list[str], out: torch.Tensor) -> None:
        """Fill ``out[i]`` with the value of ``keys[i]``; every key must exist."""
        raise NotImplementedError

    def count_leading(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, exist (stops at the first missing)."""
        raise NotImplementedError

    def remove_prefix(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix``; returns how many."""
        raise NotImplementedError

    def close(self) -> None:
        """Release this process's handle (the pool itself lives on)."""


class PooledConnector(KVConnector):
    """Save, look up, load and free a response's KV blocks in a ``BlockStore``."""

    def __init__(self, store: BlockStore, block_size: int, namespace: str = "seer") -> None:
        super().__init__()
        self.store = store
        self.block_size = block_size
        self.name = store.name
        self.namespace = namespace
        self._warned = False
        self._unfreed: deque[str] = deque(maxlen=UNFREED_LIMIT)  # frees that failed, retried

    def _keys(self, key: str, token_ids: Sequence[int], num_blocks: int, epoch: int = 0) -> list[str]:
        """Block i's key: its index and a digest of the epoch and the context up to the
        block's end. Response keys come back (a caller's group id, a later iteration), and
        an entry a failed free left under one holds another context's KV, or KV of weights
        since replaced: with the digest it reads as absent (the block is saved again)
        instead of loading KV of other tokens or weights."""
        bs = self.block_size
        data = np.asarray(token_ids[: num_blocks * bs], dtype="<i8").tobytes()
        digest = hashlib.blake2b(epoch.to_bytes(8, "little", signed=True), digest_size=8)
        keys = []
        for i in range(num_blocks):
            digest.update(data[i * bs * 8 : (i + 1) * bs * 8])
            keys.append(f"{self._prefix(key)}{i}-{digest.hexdigest()}")
        return keys

    def _prefix(self, key: str) -> str:
        """Where a response's blocks live: its key is one path component ("/" and "%"
        escaped), so a response's prefix never starts another's (group ids are callers'
        strings: a free of ``a/1`` must not remove ``a/1/0``'s blocks)."""
        return f"{self.namespace}/{quote(key, safe='')}/"

    def _failed(self, what: str, err: Exception) -> str:
        self.stats.failures += 1
        message = f"KV pool ({self.name}) could not {what}: {err}; the request recomputes"
        if not isinstance(err, KVPoolFull):
            self.stats.down = message
        if not self._warned:  # once: a pool that is down fails every call
            logger.warning("%s (further pool failures are only counted)", message)
            self._warned = True
        return message

    def save(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> int:
        self._check(engine)
        block_ids = engine.cached_kv_blocks(engine.kv_block_hashes(token_ids))
        if not block_ids:
            return 0
        keys = self._keys(key, token_ids, len(block_ids), epoch)
        try:
            have = self.store.count_leading(keys)
            if have < len(keys):
                start = time.perf_counter()
                blocks = engine.read_kv_blocks(block_ids[have:])
                self.store.put(keys[have:], blocks)
                self.stats.save_s += time.perf_counter() - start
                self.stats.saved_blocks += len(keys) - have
                self.stats.saved_bytes += blocks.numel() * blocks.element_size()
        except KVPoolError as e:
            self._failed(f"save {key}", e)
            return 0
        self.stats.down = None
        return len(keys) * self.block_size

    def _check(self, engine: KVBlockIO) -> None:
        if engine.kv_block_size != self.block_size:
            raise ValueError(
                f"the KV pool holds blocks of {self.block_size} tokens; this engine uses "
                f"{engine.kv_block_size}"
            )

    def lookup(self, key: str, token_ids: list[int], epoch: int = 0) -> int:
        bs = self.block_size
        try:
            found = self.store.count_leading(self._keys(key, token_ids, len(token_ids) // bs, epoch)) * bs
        except KVPoolError as e:
            self._failed(f"look up {key}", e)
            return 0
        self.stats.down = None
        return found

    def load(self, key: str, engine: KVBlockIO, token_ids: list[int], epoch: int = 0) -> LoadResult:
        self._check(engine)
        bs = self.block_size
        hashes = engine.kv_block_hashes(token_ids)
        cached = len(engine.cached_kv_blocks(hashes))
        try:
            keys = self._keys(key, token_ids, len(hashes), epoch)
            pooled = self.store.count_leading(keys)
            self.stats.down = None
            if pooled <= cached:
                return LoadResult(cached * bs)
            start = time.perf_counter()
            out = torch.empty((pooled - cached, *engine.kv_block_shape), dtype=engine.kv_block_dtype)
            self.store.get_into(keys[cached:pooled], out)
        except KVPoolError as e:
            return LoadResult(cached * bs, error=self._failed(f"load {key}", e))
        block_ids = engine.adopt_kv_blocks(hashes[:pooled], cached)
        if block_ids is None:
            return LoadResult(cached * bs, error=f"no free KV blocks to load {key} into")
        engine.write_kv_blocks(block_ids, out)
        self.stats.load_s += time.perf_counter() - start
        self.stats.loaded_blocks += len(block_ids)
        self.stats.loaded_bytes += out.numel() * out.element_size()
        return LoadResult(pooled * bs, loaded_tokens=(pooled - cached) * bs)

    def free(self, key: str) -> None:
        """Free a finished response's entries; a free the pool failed (a pool briefly
        unreachable or locked) is tried again with the next ones, so nothing is left behind."""
        self._unfreed.append(key)
        self._free_unfreed(count=True)

    def free_left(self) -> None:
        """A retry that fails again is not counted again (an idle server retries each second)."""
        if self._unfreed:
            self._free_unfreed(count=False)

    def _free_unfreed(self, count: bool) -> None:
        while self._unfreed:
            try:
                self.store.remove_prefix(self._prefix(self._unfreed[-1]))
            except KVPoolError as e:
                if count:
                    self._failed(f"free {self._unfreed[-1]}", e)
                return
            self._unfreed.pop()
        self.stats.down = None

    def clear(self) -> None:
        """Remove every entry of this namespace (a pool shared with other servers outlives
        this one, and nothing else would ever free them)."""
        try:
            self.store.remove_prefix(f"{self.namespace}/")
        except KVPoolError as e:
            self._failed("remove its entries", e)

    def close(self) -> None:
        self.store.close()
