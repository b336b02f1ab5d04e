"""Where a buffered response's next chunk runs, and whether its KV comes from the pool.

Seer's rule: prefer the instance that holds the longest prefix of the response (its
last instance holds all of it in the prefix cache; one that ran a sibling holds the
prompt), so most chunks resume without moving KV; but once the instances' loads
drift apart (the spread of chunks in flight exceeds a threshold, 32 in the paper)
go to the least loaded one instead. A response placed on an instance that lacks more
than a threshold of its context (512 tokens in the paper) pulls it from the global
KV pool; a smaller gap is cheaper to recompute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from seer_engine.rollout.instances.base import InstanceHandle

SEER_SPREAD_THRESHOLD = 32
SEER_PULL_THRESHOLD_TOKENS = 512


class Placement:
    name = "abstract"

    def choose(
        self,
        candidates: Sequence[InstanceHandle],
        prefix_tokens: Callable[[InstanceHandle], int],
        loads: Sequence[int],
    ) -> InstanceHandle:
        """One of ``candidates`` (instances with room for the chunk). ``prefix_tokens``:
        how much of the response's context an instance holds; ``loads``: chunks in
        flight on every live instance."""
        raise NotImplementedError

    def should_pull(self, missing_tokens: int) -> bool:
        """Load the context from the pool rather than recompute ``missing_tokens``."""
        raise NotImplementedError


class SeerPlacement(Placement):
    name = "seer"

    def __init__(
        self,
        spread_threshold: int = SEER_SPREAD_THRESHOLD,
        pull_threshold_tokens: int = SEER_PULL_THRESHOLD_TOKENS,
    ) -> None:
        if spread_threshold < 0 or pull_threshold_tokens < 0:
            raise ValueError("placement thresholds must be >= 0")
        self.spread_threshold = spread_threshold
        self.pull_threshold_tokens = pull_threshold_tokens

    def choose(self, candidates, prefix_tokens, loads):
        if loads and max(loads) - min(loads) > self.spread_threshold:
            return min(candidates, key=lambda i: (len(i.books.in_flight), -i.books.free_blocks, i.index))
        return max(
            candidates,
            key=lambda i: (prefix_tokens(i), -len(i.books.in_flight), i.books.free_blocks, -i.index),
        )

    def should_pull(self, missing_tokens: int) -> bool:
        return missing_tokens > self.pull_threshold_tokens
