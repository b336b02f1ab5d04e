"""Where drafts come from: pluggable proposers behind one interface.

A proposer sees each request's tokens as they are generated (``observe``) and drafts
a continuation (``propose``). One proposer may serve several engines (a rollout
pool's draft server shares the group trees across instances), so all of its state
is keyed by group and sequence ids, never by engine request ids: a rollout chunk
that resumes a response on another instance finds its tokens already there.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from seer_engine.core.draft import DraftTree
from seer_engine.core.request import Request
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY, GroupSuffixTrees


class Proposer:
    name = "abstract"

    def observe(self, request: Request) -> None:
        """Take in the request's tokens generated since the last call."""

    def propose(self, request: Request, budget: int, multi_path: bool) -> DraftTree:
        """At most ``budget`` draft nodes continuing the request's tokens."""
        raise NotImplementedError

    def finish_group(self, group_id: str) -> None:
        """Every response of the group is done: drop what is kept for it."""

    def seed_group(
        self, group_id: str, prompt_token_ids: Sequence[int], responses: Sequence[Sequence[int]]
    ) -> int:
        """Earlier iterations' responses to the group's prompt, to draft from before its
        own siblings have written anything; returns the tokens taken (0: not used)."""
        return 0


class SuffixProposer(Proposer):
    """Suffix-tree drafts. ``grouped``: one tree per group holding the prompt and every
    sibling's output (Seer); else one tree per response over its own prompt and output
    (SuffixDecoding's per-request tree, the comparison point)."""

    def __init__(self, config: SpeculativeConfig, grouped: bool) -> None:
        self.name = "group_suffix" if grouped else "suffix"
        self.grouped = grouped
        self.trees = GroupSuffixTrees(
            max_depth=config.max_depth,
            min_prob=config.min_prob,
            live_weight=config.live_weight,
            backoff=config.backoff,
        )
        self.match_cap = config.max_depth // 2
        self.history_sequences = config.history_sequences
        self._seq_keys: dict[str, int] = {}  # sequence id -> its key inside its tree
        self._appended: dict[str, int] = {}  # sequence id -> output tokens already in the tree
        self._sequences: dict[str, list[str]] = {}  # group id -> its sequence ids
        self._next_key = itertools.count()

    def _tree_of(self, request: Request) -> Hashable:
        return request.group_id if self.grouped else request.sequence_id

    def observe(self, request: Request) -> None:
        # Called once per generated token: one dict lookup when there is nothing new.
        sid = request.sequence_id
        done = self._appended.get(sid)  # set together with _seq_keys[sid]
        if done is None:
            tree = self._tree_of(request)
            if tree not in self.trees:
                self.trees.append(tree, PROMPT_KEY, request.prompt_token_ids)
            self._seq_keys[sid] = next(self._next_key)
            self._appended[sid] = done = 0
            self._sequences.setdefault(request.group_id, []).append(sid)
        output = request.output_token_ids
        if len(output) > done:
            self.trees.append(self._tree_of(request), self._seq_keys[sid], output[done:])
            self._appended[sid] = len(output)

    def propose(self, request: Request, budget: int, multi_path: bool) -> DraftTree:
        sid = request.sequence_id
        done = self._appended.get(sid)
        if done is None:
            self.observe(request)
            done = self._appended[sid]
        tree = self._tree_of(request)
        # Its own output is context enough: no walk. In a seeded tree a walk through the
        # prompt would match only the seeds (they start with the prompt's tail), so once
        # the response has a token its output is the context there. A full tree's
        # sequences may stop short of their responses: walk the request's own tokens.
        own = done >= self.match_cap or (done and self.grouped and self.trees.seeded(tree))
        if own and not self.trees.full(tree):
            return self.trees.speculate_sequence(tree, self._seq_keys[sid], budget, multi_path)
        return self.trees.speculate(tree, request.all_token_ids[-self.match_cap :], budget, multi_path)

    def seed_group(
        self, group_id: str, prompt_token_ids: Sequence[int], responses: Sequence[Sequence[int]]
    ) -> int:
        """Grouped trees only (a per-response tree is its own response's); the newest
        ``history_sequences`` responses, at the config's ``history_weight``."""
        if not self.grouped or not self.history_sequences or not responses:
            return 0
        newest = list(responses)[-self.history_sequences :]
        return self.trees.seed(group_id, prompt_token_ids, newest)

    def finish_group(self, group_id: str) -> None:
        for sid in self._sequences.pop(group_id, []):
            self._seq_keys.pop(sid, None)
            self._appended.pop(sid, None)
            if not self.grouped:
                self.trees.free(sid)
        if self.grouped:
            self.trees.free(group_id)


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose what
    followed it. Single path; stateless."""

    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request, budget: int, multi_path: bool) -> DraftTree:
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                follow = tokens[start : start + budget].tolist()
                return DraftTree(follow, list(range(-1, len(follow) - 1)), [1.0] * len(follow), n)
        return DraftTree()


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    return SuffixProposer(config, grouped=config.method == "group_suffix")
