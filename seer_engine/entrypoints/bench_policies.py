"""``bench rollout``'s policy names: a rollout policy (``context+history``: ranked by a
history store), optionally with a speculative decoding variant on top (``context+ngram``)."""

from __future__ import annotations

from seer_engine.rollout.history import HistoryStore
from seer_engine.rollout.policies import (
    HISTORY_POLICIES,
    HISTORY_SUFFIX,
    ROLLOUT_POLICIES,
    RolloutPolicy,
    distinct_policies,
    make_rollout_policy,
)


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    for name in policies:
        base, spec = split_policy(name)
        if (
            base not in ROLLOUT_POLICIES
            and base not in HISTORY_POLICIES
            or spec not in (None, *SPEC_VARIANTS)
        ):
            raise ValueError(
                f"unknown policy {name!r}; choose from {sorted(ROLLOUT_POLICIES) + list(HISTORY_POLICIES)}, "
                f"optionally with +{'|+'.join(SPEC_VARIANTS)} (speculative decoding on top)"
            )
    return distinct_policies(policies)


# Speculative decoding variants a bench policy can add, e.g. "context+ngram". They
# draft a fixed 16 tokens per request and step, so their accepted tokens per step
# compare the draft sources alone; seer itself sizes drafts with the adaptive budget.
_FIXED16 = {"budget": "fixed", "num_speculative_tokens": 16}
SPEC_VARIANTS: dict[str, dict] = {
    "ngram": {"method": "ngram", **_FIXED16},
    "suffix": {"method": "suffix", **_FIXED16},  # a tree per response (SuffixDecoding)
    "group_path": {"method": "group_suffix", "multi_path": False, **_FIXED16},
    "group_tree": {"method": "group_suffix", **_FIXED16},
}


def bench_policy(
    name: str,
    true_lengths: dict[str, int],
    starvation_s: float,
    history: HistoryStore | None = None,
    context_order: str = "auto",
) -> RolloutPolicy:
    """A rollout policy by name; ``base+variant`` adds that speculative decoding
    (``seer+history``, ``context+history+group_tree``: ranks by ``history``)."""
    base, spec = split_policy(name)
    order = {"starvation_s": starvation_s, "order": context_order}
    if base.endswith(HISTORY_SUFFIX):
        policy = make_rollout_policy(base, history=history, **order)
    else:
        policy = make_rollout_policy(base, true_lengths=true_lengths, **order)
    if spec:
        policy.name = name
        policy.speculative = SPEC_VARIANTS[spec]
    return policy


def split_policy(name: str) -> tuple[str, str | None]:
    """``context+history+group_tree`` -> (``context+history``, ``group_tree``)."""
    head, _, tail = name.rpartition("+")
    if head and tail in SPEC_VARIANTS:
        return head, tail
    if head and tail != HISTORY_SUFFIX[1:]:
        return head, tail  # an unknown variant: refused by parse_policies
    return name, None
