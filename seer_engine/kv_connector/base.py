"""Moving a response's KV between engine instances at chunk boundaries.

Divided rollout is cheap when the next chunk of a response can run on any instance
without recomputing its context. A connector saves a request's KV when a chunk ends,
says how much of it a pool holds, loads it into another instance, and frees it when
the response finishes. ``RecomputeConnector`` holds nothing: a response that moves
recomputes its context on the new instance (the rollout counts those tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from seer_engine.engine.llm_engine import LLMEngine


@dataclass
class LoadResult:
    tokens: int  # context tokens whose KV is now in the target instance
    error: str | None = None  # why the load failed, per request; the caller recomputes


class KVConnector:
    name = "abstract"

    def save(self, key: str, engine: LLMEngine, token_ids: list[int]) -> None:
        """Offer the KV of ``token_ids`` (a finished chunk's context) to the pool."""
        raise NotImplementedError

    def lookup(self, key: str) -> int:
        """How many leading tokens of ``key``'s context the pool holds."""
        raise NotImplementedError

    def load(self, key: str, engine: LLMEngine, token_ids: list[int]) -> LoadResult:
        """Place the pooled KV into ``engine`` so its prefix cache serves ``token_ids``."""
        raise NotImplementedError

    def free(self, key: str) -> None:
        """The response finished: drop its pool entry (not left to eviction)."""
        raise NotImplementedError


class RecomputeConnector(KVConnector):
    """No pool: moving a response recomputes its KV on the target instance."""

    name = "recompute"

    def save(self, key: str, engine: LLMEngine, token_ids: list[int]) -> None:
        return None

    def lookup(self, key: str) -> int:
        return 0

    def load(self, key: str, engine: LLMEngine, token_ids: list[int]) -> LoadResult:
        return LoadResult(tokens=0)

    def free(self, key: str) -> None:
        return None
