"""``--speculative-config``: which drafter proposes, how many tokens, how they are budgeted."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from seer_engine.core.numbers import is_int, is_real

METHODS = ("group_suffix", "suffix", "ngram")
BUDGETS = ("adaptive", "fixed")
MAX_DRAFT_NODES = 63  # the tree mask gives each verification row 64 visibility bits
MAX_TREE_DEPTH = 4096  # the C++ suffix tree's limit on max_depth
MAX_PRIORITY_WEIGHT = 1e3  # past this every low-priority node is already worthless beside a high one
MAX_BACKOFF = 1e6  # pseudo-counts; far past any tree's counts, so a larger one means nothing more
MAX_LIVE_WEIGHT = 1 << 16  # the C++ suffix tree's limit on a sequence's weight (1 / history_weight)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``group_suffix`` (Seer: one suffix tree per group, siblings draft for
    each other), ``suffix`` (a tree per request over its own prompt and output, as in
    SuffixDecoding) or ``ngram`` (prompt lookup). ``num_speculative_tokens`` caps the
    draft nodes per request and step; ``budget="adaptive"`` gives fewer (or none) when
    the batch is large and more where acceptance is high; ``multi_path`` allows token
    trees (suffix methods only)."""

    method: str = "group_suffix"
    num_speculative_tokens: int = 16
    budget: str = "adaptive"
    multi_path: bool = True
    min_prob: float = 0.01  # suffix trees: drop draft nodes whose path probability is lower
    max_depth: int = 64  # suffix trees: deepest suffix kept
    # suffix trees: each matched context length's next-token counts get a prior of this
    # many pseudo-counts from the next shorter context's distribution (0: the longest
    # match alone decides, as SuffixDecoding drafts)
    backoff: float = 16.0
    prompt_lookup_min: int = 2  # ngram: shortest suffix to match
    prompt_lookup_max: int = 5  # ngram: longest suffix to match
    # group_suffix with a history store: a seed (an earlier iteration's response) counts
    # this much of a live sibling (rounded to 1/k); at most history_sequences seeds per group.
    history_weight: float = 0.5
    history_sequences: int = 16
    # Adaptive budget: [fixed_s, per_token_s] of a step from an offline profile (Seer
    # profiles once per model and machine); None measures it at start-up.
    step_cost: tuple[float, float] | None = None
    # Adaptive budget: a high-priority request's tokens are worth this many of another's
    # (Seer's λ; rollouts mark their long responses high-priority).
    priority_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {list(METHODS)}, got {self.method!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"speculative budget must be one of {list(BUDGETS)}, got {self.budget!r}")
        # Types are checked here, not left to the drafter: a JSON "false" or 2.5 would
        # otherwise pass as truthy or crash a proposer mid-rollout.
        n = self.num_speculative_tokens
        if not is_int(n) or not 1 <= n <= MAX_DRAFT_NODES:
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_DRAFT_NODES}, got {n!r}")
        if not isinstance(self.multi_path, bool):
            raise ValueError(f"multi_path must be true or false, got {self.multi_path!r}")
        if not (is_real(self.min_prob) and 0.0 <= self.min_prob <= 1.0):
            raise ValueError(f"min_prob must be a number in [0, 1], got {self.min_prob!r}")
        if not (is_real(self.backoff) and 0.0 <= self.backoff <= MAX_BACKOFF):
            raise ValueError(f"backoff must be a number in [0, {MAX_BACKOFF:g}], got {self.backoff!r}")
        if not (is_int(self.max_depth) and 2 <= self.max_depth <= MAX_TREE_DEPTH):
            raise ValueError(f"max_depth must be an integer in 2..{MAX_TREE_DEPTH}, got {self.max_depth!r}")
        if not (is_real(self.history_weight) and 1.0 / MAX_LIVE_WEIGHT <= self.history_weight <= 1.0):
            raise ValueError(
                f"history_weight must be in [1/{MAX_LIVE_WEIGHT}, 1] (live sequences weigh its inverse "
                f"in the suffix trees, at most {MAX_LIVE_WEIGHT}), got {self.history_weight!r}"
            )
        if not is_int(self.history_sequences) or self.history_sequences < 0:
            raise ValueError(f"history_sequences must be an integer >= 0, got {self.history_sequences!r}")
        w = self.priority_weight
        if not (is_real(w) and 1.0 <= w <= MAX_PRIORITY_WEIGHT):
            raise ValueError(f"priority_weight must be a number in [1, {MAX_PRIORITY_WEIGHT:g}], got {w!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi):
            raise ValueError(
                f"need integers 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
            )
        if self.step_cost is not None:
            cost = self.step_cost
            if (
                not isinstance(cost, (list, tuple))
                or len(cost) != 2
                or not all(is_real(c) and c >= 0 for c in cost)
                or cost[0] <= 0
            ):
                raise ValueError(f"step_cost must be [fixed_s > 0, per_token_s >= 0] seconds, got {cost!r}")
            object.__setattr__(self, "step_cost", (float(cost[0]), float(cost[1])))

    @property
    def live_weight(self) -> int:
        """The suffix-tree weight of live sequences against a history seed's 1."""
        return max(1, round(1.0 / self.history_weight))

    @property
    def trees(self) -> bool:
        return self.multi_path and self.method != "ngram"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, a dict, or an instance; None/"" means off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            value = json_object(value)
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown --speculative-config keys {unknown}; known: {sorted(known)}")
        return cls(**value)


def json_object(text: str) -> dict[str, Any]:
    """A ``--speculative-config`` string's JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
    return value
