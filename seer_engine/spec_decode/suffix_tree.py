"""Group suffix trees: the draft source of adaptive grouped speculative decoding.

Seer keeps one suffix tree per group (a prompt and its G sibling responses), so a
request can draft from what its siblings already generated.  The trees live in C++
(``seer_engine._C.GroupSuffixTree``); this module maps group ids to trees and turns
drafts into ``DraftTree`` records.

The per-request baseline (SuffixDecoding-style, where a request drafts only from its
own prompt and output) uses the same class: give every request its own tree id and
append only that request's prompt and output to it, i.e. a "group" of one request.

Backoff (beyond Seer and SuffixDecoding, which draft from the longest match alone):
with ``backoff > 0`` a token's probability mixes what every matched context length
says, each length's counts getting ``backoff`` pseudo-counts from the next shorter
one's distribution. A long match seen once or twice then no longer claims certainty,
and a draft tree spends its nodes on the likeliest alternatives of every length.

History seeds (beyond Seer): a group's tree may start with responses to the same
prompt from earlier iterations (``seed``), so drafts work from a group's first
token. They weigh 1 against ``live_weight`` for the prompt and live siblings, so a
sibling that disagrees with history soon outvotes it. Each seed starts with the
prompt's last tokens, so a response's very first tokens match it; once a response
has a token, it drafts from its own output only (``SuffixProposer``), where seeds
and live siblings match equally deep and their weights decide.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from seer_engine._C import GroupSuffixTree
from seer_engine.core.draft import DraftTree

__all__ = ["HISTORY_KEY", "PROMPT_KEY", "DraftTree", "GroupSuffixTree", "GroupSuffixTrees"]

# Sequence key for a group's prompt; responses use their own (non-negative) keys.
PROMPT_KEY = -1
# History seed j of a group has key HISTORY_KEY - j.
HISTORY_KEY = -2
HISTORY_WEIGHT = 1  # a seed's weight; live sequences weigh ``live_weight``
MAX_WEIGHTED_TOKENS = (1 << 31) - 1  # a C++ tree counts its weighted tokens in an int32


def _as_list(tokens: Sequence[int]) -> Sequence[int]:
    """Lists pass through; tensors and arrays become lists (one C-level conversion)."""
    if type(tokens) is list:  # the per-token case: skip the attribute lookup
        return tokens
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else tokens


class GroupSuffixTrees:
    """One ``GroupSuffixTree`` per group id, created on first append.

    Drafting defaults (``min_prob``, ``max_spec_factor``, ``max_match_len``,
    ``backoff``) are set here and can be overridden per ``speculate`` call; see the C++
    class docstring for their exact meaning.  ``max_match_len=None`` caps matches at
    ``max_depth // 2``: the trie is only ``max_depth`` deep, so a longer match would
    leave too little depth for the draft.
    """

    def __init__(
        self,
        max_depth: int = 64,
        min_prob: float = 0.1,
        max_spec_factor: float = 0.0,
        max_match_len: int | None = None,
        live_weight: int = 1,
        backoff: float = 0.0,
    ) -> None:
        GroupSuffixTree(max_depth)  # validate max_depth now rather than on first append
        if not isinstance(live_weight, int) or live_weight < 1:
            raise ValueError(f"live_weight must be an integer >= 1, got {live_weight!r}")
        self.max_depth = max_depth
        self.live_weight = live_weight
        self.min_prob = min_prob
        self.max_spec_factor = max_spec_factor
        self.max_match_len = max_match_len
        self.backoff = backoff
        self._trees: dict[Hashable, GroupSuffixTree] = {}
        self._full: set[Hashable] = set()  # trees that refused tokens: they no longer grow

    def append(
        self, group_id: Hashable, seq_key: int, tokens: Sequence[int], weight: int | None = None
    ) -> None:
        """Append tokens to one sequence of a group (prompt or a sibling's output).
        ``weight`` (default ``live_weight``) applies when the sequence is new: its
        occurrences count that many times. A tree whose weighted token count would pass
        ``MAX_WEIGHTED_TOKENS`` is ``full``: it keeps what it holds and takes no more."""
        if group_id in self._full:
            return
        tree = self._trees.get(group_id)
        if tree is None:
            tree = self._trees[group_id] = GroupSuffixTree(self.max_depth)
        weight = self.live_weight if weight is None else weight
        tokens = _as_list(tokens)
        try:
            tree.append(seq_key, tokens, weight)
        except ValueError:
            if tree.count([]) + len(tokens) * weight <= MAX_WEIGHTED_TOKENS:
                raise
            self._full.add(group_id)

    def full(self, group_id: Hashable) -> bool:
        """The group's tree stopped growing (see ``append``): its sequences may end short
        of the responses they hold."""
        return group_id in self._full

    def seed(self, group_id: Hashable, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> int:
        """Put earlier iterations' responses to the group's prompt into its tree (creating
        it with the prompt if needed), each after the prompt's last ``max_depth // 2``
        tokens (a fresh response's first context) and at weight ``HISTORY_WEIGHT``.
        Seeds already there are kept as they are; returns the tokens added."""
        prompt = _as_list(prompt)
        tree = self._trees.get(group_id)
        if tree is None or PROMPT_KEY not in tree:
            self.append(group_id, PROMPT_KEY, prompt)
            tree = self._trees[group_id]
        tail = list(prompt[len(prompt) - min(len(prompt), self.max_depth // 2) :])
        added = 0
        for j, response in enumerate(r for r in responses if len(r)):
            key = HISTORY_KEY - j
            if key in tree:
                continue
            self.append(group_id, key, tail + list(_as_list(response)), HISTORY_WEIGHT)
            if self.full(group_id):
                break
            added += len(response)
        return added

    def seeded(self, group_id: Hashable) -> bool:
        """The group's tree holds history seeds."""
        tree = self._trees.get(group_id)
        return tree is not None and HISTORY_KEY in tree

    def speculate(
        self,
        group_id: Hashable,
        context_tail: Sequence[int],
        budget: int,
        multi_path: bool = False,
        *,
        min_prob: float | None = None,
        max_spec_factor: float | None = None,
        max_match_len: int | None = None,
        backoff: float | None = None,
    ) -> DraftTree:
        """Draft up to ``budget`` tokens continuing ``context_tail`` from the group's tree.

        ``context_tail`` is the end of the request's prompt + output; only its last
        ``max_match_len`` tokens are used.  An unknown group yields an empty draft.
        """
        tree = self._trees.get(group_id)
        if tree is None:
            return DraftTree()
        opts = self._options(min_prob, max_spec_factor, max_match_len, backoff)
        tail = _as_list(context_tail)
        if len(tail) > opts[2]:
            tail = tail[len(tail) - opts[2] :]
        return DraftTree.of(*tree.speculate(tail, budget, multi_path, *opts))

    def speculate_sequence(
        self,
        group_id: Hashable,
        seq_key: int,
        budget: int,
        multi_path: bool = False,
        *,
        min_prob: float | None = None,
        max_spec_factor: float | None = None,
        max_match_len: int | None = None,
        backoff: float | None = None,
    ) -> DraftTree:
        """``speculate`` with the stored sequence ``seq_key`` as the context.

        The fast path when the request's own output is in the tree (its suffix nodes
        are already known, no walk from the root).  It sees only that sequence's
        tokens, not the prompt before them, which only matters for the first few
        output tokens.  Unknown groups or sequences yield an empty draft.
        """
        tree = self._trees.get(group_id)
        if tree is None:
            return DraftTree()
        opts = self._options(min_prob, max_spec_factor, max_match_len, backoff)
        try:  # the sequence is nearly always there: no separate membership call
            return DraftTree.of(*tree.speculate_sequence(seq_key, budget, multi_path, *opts))
        except KeyError:
            return DraftTree()

    def _options(
        self,
        min_prob: float | None,
        max_spec_factor: float | None,
        max_match_len: int | None,
        backoff: float | None,
    ) -> tuple[float, float, int, float]:
        """Per-call overrides over the defaults; a negative match cap means max_depth // 2."""
        cap = self.max_match_len if max_match_len is None else max_match_len
        if cap is None or cap < 0:
            cap = self.max_depth // 2
        return (
            self.min_prob if min_prob is None else min_prob,
            self.max_spec_factor if max_spec_factor is None else max_spec_factor,
            cap,
            self.backoff if backoff is None else backoff,
        )

    def remove_sequence(self, group_id: Hashable, seq_key: int) -> None:
        """Forget one sequence of a group (e.g. an aborted request's output)."""
        self._trees[group_id].remove_sequence(seq_key)

    def free(self, group_id: Hashable) -> None:
        """Drop a group's tree and its memory; a no-op for unknown groups."""
        self._trees.pop(group_id, None)
        self._full.discard(group_id)

    def tree(self, group_id: Hashable) -> GroupSuffixTree | None:
        """The group's tree, for inspection (node counts, memory)."""
        return self._trees.get(group_id)

    def num_nodes(self) -> int:
        """Live nodes over all groups."""
        return sum(t.num_nodes() for t in self._trees.values())

    def __contains__(self, group_id: Hashable) -> bool:
        return group_id in self._trees

    def __len__(self) -> int:
        return len(self._trees)
