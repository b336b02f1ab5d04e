"""A connector needs nothing of an engine but ``KVBlockIO``: a response's KV moves between
two block caches, each a real ``KVCacheManager`` and a plain tensor, through a real
``local`` pool (no model, no engine)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from seer_engine.core.kv_cache_manager import KVCacheManager
from seer_engine.kv_connector.base import KVBlockIO, KVPoolError
from seer_engine.kv_connector.factory import make_kv_pool

BS = 4
SHAPE = (2, 2, BS, 2, 8)  # layers, k/v, block_size, kv_heads, head_dim
DTYPE = torch.bfloat16
BLOCK_BYTES = math.prod(SHAPE) * DTYPE.itemsize


class TensorBlocks:
    """``KVBlockIO`` and nothing more: a prefix cache and one ``[blocks, *SHAPE]`` tensor."""

    __slots__ = ("_kv", "_cache")

    def __init__(self, num_blocks: int, block_size: int = BS) -> None:
        self._kv = KVCacheManager(num_blocks, block_size)
        self._cache = torch.zeros((num_blocks, *SHAPE[:2], block_size, *SHAPE[3:]), dtype=DTYPE)

    @property
    def kv_block_size(self) -> int:
        return self._kv.block_size

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        return tuple(self._cache.shape[1:])

    @property
    def kv_block_dtype(self) -> torch.dtype:
        return self._cache.dtype

    def kv_block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        return self._kv.block_hashes(token_ids)

    def cached_kv_blocks(self, hashes: Sequence[int]) -> list[int]:
        return self._kv.cached_prefix(hashes)

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self._cache[block_ids].clone()

    def adopt_kv_blocks(self, hashes: Sequence[int], start: int) -> list[int] | None:
        return self._kv.adopt_blocks(hashes, start)

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self._cache[block_ids] = blocks


def holding(io: TensorBlocks, context: list[int], data: torch.Tensor) -> None:
    """Put ``data`` into ``io``'s prefix cache as the KV of ``context``'s leading blocks."""
    hashes = io.kv_block_hashes(context)[: len(data)]
    have = len(io.cached_kv_blocks(hashes))
    ids = io.adopt_kv_blocks(hashes, have)
    assert ids is not None
    io.write_kv_blocks(ids, data[have:])


def contents(io: TensorBlocks, context: list[int]) -> torch.Tensor:
    return io.read_kv_blocks(io.cached_kv_blocks(io.kv_block_hashes(context)))


@pytest.fixture
def pool():
    p = make_kv_pool("local", BS, BLOCK_BYTES, capacity_gib=64 * BLOCK_BYTES / 2**30)
    yield p
    p.close()


def test_a_context_moves_between_two_block_caches(pool):
    conn = pool.connector
    context = [(5 * i + 1) % 97 for i in range(5 * BS + 2)]  # 5 full blocks and 2 tokens
    data = torch.randn(5, *SHAPE).to(DTYPE)
    source, target = TensorBlocks(16), TensorBlocks(16)
    assert isinstance(source, KVBlockIO)
    holding(source, context, data)

    assert conn.save("r", source, context) == 5 * BS
    assert conn.lookup("r", context) == 5 * BS
    assert conn.save("r", source, context) == 5 * BS  # already pooled: nothing is copied again
    assert (conn.stats.saved_blocks, conn.stats.saved_bytes) == (5, 5 * BLOCK_BYTES)

    holding(target, context, data[:2])  # the target already caches the first two blocks
    r = conn.load("r", target, context)
    assert (r.tokens, r.loaded_tokens, r.error) == (5 * BS, 3 * BS, None)
    assert torch.equal(contents(target, context), data)
    assert conn.stats.loaded_blocks == 3

    again = conn.load("r", target, context)  # all cached now: the pool is not read
    assert (again.tokens, again.loaded_tokens) == (5 * BS, 0) and conn.stats.loaded_blocks == 3

    conn.free("r")
    assert conn.lookup("r", context) == 0 and conn.stats.failures == 0


def test_a_target_without_room_or_of_another_block_size(pool):
    conn = pool.connector
    context = list(range(3 * BS))
    source = TensorBlocks(8)
    holding(source, context, torch.randn(3, *SHAPE).to(DTYPE))
    assert conn.save("r", source, context) == 3 * BS

    small = TensorBlocks(2)
    r = conn.load("r", small, context)
    assert (r.tokens, r.loaded_tokens) == (0, 0) and "no free KV blocks" in r.error
    assert small.cached_kv_blocks(small.kv_block_hashes(context)) == []

    with pytest.raises(ValueError, match="blocks of 4 tokens; this engine uses 8"):
        conn.load("r", TensorBlocks(8, block_size=8), context)


def test_a_reused_key_never_loads_a_context_a_failed_free_left(pool, monkeypatch):
    """Response keys come back (a caller's group id, a later iteration). An entry that a
    failed free left behind holds another context's KV: it must read as absent."""
    conn = pool.connector
    old, new = list(range(3 * BS)), list(range(100, 100 + 3 * BS))
    source = TensorBlocks(8)
    holding(source, old, torch.randn(3, *SHAPE).to(DTYPE))
    assert conn.save("g/0", source, old) == 3 * BS

    def unreachable(prefix: str) -> int:
        raise KVPoolError("lock held")

    with monkeypatch.context() as m:
        m.setattr(conn.store, "remove_prefix", unreachable)
        conn.free("g/0")  # the response finished, the pool could not free it now
    assert conn.stats.failures == 1 and conn.lookup("g/0", old) == 3 * BS

    data = torch.randn(3, *SHAPE).to(DTYPE)
    again = TensorBlocks(8)
    holding(again, new, data)
    assert conn.lookup("g/0", new) == 0
    assert conn.save("g/0", again, new) == 3 * BS  # a new response under the same key
    target = TensorBlocks(8)
    r = conn.load("g/0", target, new)
    assert (r.tokens, r.loaded_tokens, r.error) == (3 * BS, 3 * BS, None)
    assert torch.equal(contents(target, new), data)
    conn.free("g/0")  # frees both contexts' entries (and retries nothing more)
    assert conn.lookup("g/0", new) == 0 and conn.lookup("g/0", old) == 0


def test_a_full_pool_is_not_down_and_a_pool_that_serves_again_is_up(monkeypatch):
    """Health reads ``stats.down``: a pool at capacity works on (its saves fail, its
    responses recompute) and a pool that failed and serves again is up; only a pool whose
    last call failed for another reason is down. Failures are counted either way."""
    tiny = make_kv_pool("local", BS, BLOCK_BYTES, capacity_gib=2 * BLOCK_BYTES / 2**30)
    try:
        conn = tiny.connector
        context = list(range(3 * BS))
        source = TensorBlocks(8)
        holding(source, context, torch.randn(3, *SHAPE).to(DTYPE))
        assert conn.save("a", source, context) == 0  # 3 blocks, room for 2
        assert conn.stats.failures == 1 and conn.stats.down is None

        def unreachable(keys: list[str]) -> int:
            raise KVPoolError("lock held")

        with monkeypatch.context() as m:
            m.setattr(conn.store, "count_leading", unreachable)
            assert conn.lookup("a", context) == 0
        assert conn.stats.failures == 2 and "lock held" in (conn.stats.down or "")
        assert conn.lookup("a", context) == 0 and conn.stats.down is None
    finally:
        tiny.close()


@pytest.mark.parametrize(
    "kind,gib,error",
    [
        ("local", BLOCK_BYTES / 2 / 2**30, f"too small: one KV block takes.*{BLOCK_BYTES} bytes"),
        ("mooncake", 0.01, r"too small: a mooncake pool mounts at least 0\.015625 \(16 MiB\)"),
    ],
)
def test_a_kv_pool_gib_too_small_for_the_pool_names_the_flag(kind, gib, error):
    """The user sets ``--kv-pool-gib``; an error about a store's inner parameter
    (``global_segment_size``) would not tell them what to change. Mooncake's is refused
    before any master starts."""
    with pytest.raises(ValueError, match=f"--kv-pool-gib.*{error}"):
        make_kv_pool(kind, BS, BLOCK_BYTES, capacity_gib=gib)
