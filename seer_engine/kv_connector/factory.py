"""``--kv-connector``: the KV pool a rollout's instances share, and handles on it.

A ``KVPool`` is made once, by the process that runs the Request Buffer: it owns the
pool (the shared-memory segment, or a Mooncake master it started) and a connector of
its own (to free entries when responses finish). Instances in other processes open
their own connector from ``spec``, a small picklable description.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from seer_engine.core.numbers import is_real
from seer_engine.kv_connector.base import KVConnector, KVPoolError, PooledConnector, RecomputeConnector

if TYPE_CHECKING:
    from seer_engine.engine.config import EngineConfig
    from seer_engine.kv_connector.mooncake import MooncakeMaster

KV_CONNECTORS = ("none", "local", "mooncake")
DEFAULT_LOCAL_POOL_GIB = 4.0


@dataclass(frozen=True)
class RecomputeSpec:
    def open(self) -> KVConnector:
        return RecomputeConnector()


@dataclass(frozen=True)
class PooledSpec:
    """Opens a ``PooledConnector`` on the store ``store_type.open(store_spec)`` (a
    BlockStore client in the calling process)."""

    store_type: type
    store_spec: Any
    block_size: int
    namespace: str

    def open(self) -> KVConnector:
        """A pool this process cannot open leaves it without one: its responses recompute,
        and its stats say why (a failing pool never fails a request, nor an instance)."""
        try:
            store = self.store_type.open(self.store_spec)
        except KVPoolError as e:
            return RecomputeConnector.unreachable(f"{e}; this instance recomputes what it would load")
        return PooledConnector(store, self.block_size, self.namespace)


@dataclass
class KVPool:
    connector: KVConnector  # this process's handle
    spec: RecomputeSpec | PooledSpec | None  # ``spec.open()``: a handle in another process
    _closers: list[Callable[[], None]] = field(default_factory=list)
    master: MooncakeMaster | None = None  # the master this pool started, if any
    shared: bool = False  # the store outlives this pool (a given master): close clears its entries
    _closed: bool = False

    @property
    def name(self) -> str:
        return self.connector.name

    @classmethod
    def recompute(cls) -> KVPool:
        return cls(RecomputeConnector(), RecomputeSpec())

    def close(self) -> None:
        """Drop this process's handle and what it owns (idempotent)."""
        if self._closed:
            return
        self._closed = True
        closers, self._closers = self._closers, []
        if self.shared and isinstance(self.connector, PooledConnector):
            self.connector.clear()
        self.connector.close()
        for close in reversed(closers):
            close()


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def make_kv_pool(
    kind: str,
    block_size: int,
    block_bytes: int,
    *,
    mooncake_master: str | None = None,
    mooncake_metadata: str | None = None,
    capacity_gib: float = DEFAULT_LOCAL_POOL_GIB,
    namespace: str | None = None,
) -> KVPool:
    """A new pool of ``kind`` for blocks of ``block_size`` tokens (``block_bytes`` each).

    ``mooncake``: without ``mooncake_master`` a master on 127.0.0.1 starts here and stops
    with the pool; either way this process mounts ``capacity_gib`` into the pool.
    ``mooncake_metadata`` is the metadata server of a given master (default: its host's
    port 8080). ``namespace`` (default: one of this pool's own) prefixes every key: servers
    sharing a master all name their responses ``grp0/0``, ..., and must never load (other
    weights, dtype) or free each other's blocks, nor a restarted server its predecessor's."""
    if kind == "none":
        return KVPool.recompute()
    if namespace is None:
        namespace = f"seer-{secrets.token_hex(8)}"
    if not (is_real(capacity_gib) and capacity_gib > 0):
        raise ValueError(f"--kv-pool-gib must be a finite number > 0, got {capacity_gib!r}")
    capacity = int(capacity_gib * 2**30)
    least = block_bytes
    if kind == "mooncake":
        from seer_engine.kv_connector.mooncake.common import MIN_SEGMENT_BYTES

        least = MIN_SEGMENT_BYTES
    if kind in ("local", "mooncake") and capacity < least:
        what = "a mooncake pool mounts" if kind == "mooncake" else "one KV block takes"
        raise ValueError(
            f"--kv-pool-gib {capacity_gib:g} ({capacity} bytes) is too small: {what} at least "
            f"{least / 2**30:g} ({_size(least)})"
        )
    if kind == "local":
        from seer_engine.kv_connector.local import LocalStore

        store = LocalStore.create(capacity, block_bytes)
        spec = PooledSpec(type(store), store.spec, block_size, namespace)
        return KVPool(PooledConnector(store, block_size, namespace), spec)
    if kind == "mooncake":
        from seer_engine.kv_connector.mooncake import MooncakeMaster, MooncakeStore

        closers: list[Callable[[], None]] = []
        if mooncake_master is None:
            master = MooncakeMaster()
            closers.append(master.stop)
            address, metadata = master.address, master.metadata_server
        else:
            address, metadata = mooncake_master, mooncake_metadata
        try:
            store = MooncakeStore(address, metadata_server=metadata, global_segment_size=capacity)
        except BaseException:
            for close in closers:
                close()
            raise
        spec = PooledSpec(type(store), store.spec, block_size, namespace)
        owned = master if mooncake_master is None else None
        connector = PooledConnector(store, block_size, namespace)
        return KVPool(connector, spec, closers, owned, shared=owned is None)
    raise ValueError(f"--kv-connector must be one of {list(KV_CONNECTORS)}, got {kind!r}")


def kv_pool_for(kind: str, config: EngineConfig, **kwargs: Any) -> KVPool:
    """``make_kv_pool`` sized for the blocks of ``config``'s model (an EngineConfig), before
    any engine exists: the process that owns the pool may run none."""
    if kind == "none":
        return KVPool.recompute()
    from seer_engine.engine.llm_engine import resolve_model_path
    from seer_engine.model_executor.model_config import ModelConfig, parse_dtype
    from seer_engine.model_executor.model_runner import kv_cache_bytes_per_block

    model_config = ModelConfig.from_pretrained(resolve_model_path(config.model, config.dtype))
    dtype = model_config.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
    block_bytes = kv_cache_bytes_per_block(model_config, config.block_size, dtype)
    return make_kv_pool(kind, config.block_size, block_bytes, **kwargs)
