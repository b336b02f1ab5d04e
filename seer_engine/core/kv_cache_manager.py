"""Paged KV cache bookkeeping: a block pool with ref counts and prefix caching.

The cache is cut into fixed-size blocks. Each request owns a block table (a list of
block ids). A full block is identified by a chained hash of its tokens and every
token before it, so requests that share a prompt (the n samples of a group) share
the prompt's blocks. Blocks whose ref count drops to 0 stay cached in an LRU free
list until a new allocation evicts them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from seer_engine.core.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Chained block hash: a 128-bit BLAKE2b digest of the parent's digest and the
    block's tokens. A prefix-cache hit reuses KV without comparing tokens, so two
    contexts must never share a hash (Python's own ``hash`` of a tuple is 64 bits and
    collisions can be built on purpose); equal in every process of a machine."""
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash.to_bytes(16, "little"))
    digest.update(array("q", tokens).tobytes())
    return int.from_bytes(digest.digest(), "little")


class BlockPool:
    """All blocks, an O(1) LRU free list (an ordered dict) and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the free list, evicting the least recently freed first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self.free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self.free.popitem(last=False)[0]]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the free list's tail (evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free[block.block_id] = None

    def release_unused(self, blocks: Iterable[KVBlock]) -> None:
        """``release`` for blocks that hold nothing to share (rejected draft slots): at 0
        references they go to the free list's head, so the next allocation takes them
        before it evicts a cached block."""
        for block in blocks:
            self.release((block,))
            if block.ref_cnt == 0 and block.block_hash is None:
                self.free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: int) -> None:
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


class KVCacheManager:
    """Block tables of running requests on top of one ``BlockPool``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks already registered in the cache
        # Hashes of full prompt blocks that a running request is about to compute.
        self.pending: dict[int, str] = {}
        # Requests that held blocks at a prefix-cache reset: their later KV attends to
        # stale KV, so none of their blocks is registered again (until preempted).
        self.stale: set[str] = set()
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def stats(self) -> KVCacheStats:
        free = self.pool.num_free
        total = self.pool.num_blocks
        return KVCacheStats(total, free, 1.0 - free / total, self.prefix_queries, self.prefix_hits)

    def _full_block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens (memoised)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes[: num_tokens // bs]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        At least one token is left to compute, so the step produces its logits.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hits: list[KVBlock] = []
        for h in self._full_block_hashes(request, request.num_tokens - 1):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its request is admitted (not at every retry)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def prefix_pending(self, request: Request, num_hit_blocks: int) -> bool:
        """Is the next block of this prompt being computed by another request right now?

        Admitting such a request would compute a private copy of blocks that another
        request is about to cache; waiting one step lets it share them instead.
        """
        if not self.enable_prefix_caching:
            return False
        hashes = self._full_block_hashes(request, request.num_tokens - 1)
        return num_hit_blocks < len(hashes) and hashes[num_hit_blocks] in self.pending

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of a context (equal in every process)."""
        hashes: list[int] = []
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the leading run of ``hashes`` held in the prefix cache."""
        ids = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            ids.append(block.block_id)
        return ids

    # -- changes -------------------------------------------------------------------

    def adopt_blocks(self, hashes: Sequence[int], start: int) -> list[int] | None:
        """Cached blocks for ``hashes[start:]``, whose KV arrives from elsewhere (a KV
        pool), behind the cached ``hashes[:start]``. They are allocated, registered and
        left unreferenced at the LRU tail (the prefix refreshed with them, so making
        room never evicts it): the next request with this context finds all of it as
        prefix hits. None when the prefix is gone or too few blocks are free (the
        caller recomputes instead)."""
        if not self.enable_prefix_caching:
            return None
        prefix = [self.pool.lookup(h) for h in hashes[:start]]
        if any(b is None for b in prefix):
            return None
        self.pool.touch(prefix)
        if len(hashes) - start > self.pool.num_free:
            self.pool.release(prefix)
            return None
        blocks = self.pool.allocate(len(hashes) - start)
        for block, h in zip(blocks, hashes[start:]):
            self.pool.register(block, h)
        self.pool.release(reversed([*prefix, *blocks]))  # the prefix joins the tail last
        return [b.block_id for b in blocks]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` beyond the computed ones; False if blocks run out.

        ``computed_blocks`` are prefix hits to adopt when the request is admitted.
        """
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(blocks) - len(computed_blocks)
        reusable_free = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free - reusable_free:
            if not blocks:
                del self.req_blocks[rid]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            blocks.extend(computed_blocks)
            self.num_hashed[rid] = len(blocks)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        if self.enable_prefix_caching and rid not in self.stale:
            hashes = self._full_block_hashes(request, request.num_prompt_tokens)
            for h in hashes[self.num_hashed.get(rid, 0) : len(blocks)]:
                self.pending.setdefault(h, rid)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks so others can share them."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self.stale:
            return
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        done = self.num_hashed.get(rid, 0)
        hashes = self._full_block_hashes(request, request.num_computed_tokens)
        for i in range(done, min(len(hashes), len(blocks))):
            self.pool.register(blocks[i], hashes[i])
            if self.pending.get(hashes[i]) == rid:
                del self.pending[hashes[i]]
        self.num_hashed[rid] = max(done, min(len(hashes), len(blocks)))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the tail blocks beyond ``num_tokens`` slots (rejected draft nodes).

        Those blocks were allocated this step for the draft and hold no registered
        prefix, so they go straight back to the free list, where they are the next to be
        reused: drafting every step would otherwise cycle the whole free list and evict
        every cached prefix in it.
        """
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = max(self.blocks_needed(num_tokens), self.num_hashed.get(request.request_id, 0))
        if keep < len(blocks):
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.release_unused(extra)

    def free(self, request: Request) -> None:
        """Return a request's blocks, tail first so that prompt blocks stay cached longest."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.num_hashed.pop(rid, None)
        self.stale.discard(rid)
        for h in [h for h, owner in self.pending.items() if owner == rid]:
            del self.pending[h]
        self.pool.release(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a weight update the old KV is stale).

        Requests holding blocks now never register a block again, not even ones they
        fill later: that KV is computed attending to the stale KV before it.
        """
        self.pool.reset_prefix_cache()
        self.num_hashed = {rid: len(blocks) for rid, blocks in self.req_blocks.items()}
        self.stale.update(self.req_blocks)
        self.pending.clear()
