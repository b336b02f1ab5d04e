"""Pure-Python reference of the C++ GroupSuffixTree, for property tests only.

It stores the raw sequences and recounts substrings by brute force on every query, so
it is slow but easy to check by eye.  Its semantics (weighted counts, match rule,
probabilities, tie-breaking, output order) are the definition the C++ tree is tested
against.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict


class RefGroupSuffixTree:
    """Same interface and results as ``seer_engine._C.GroupSuffixTree``."""

    def __init__(self, max_depth: int = 64) -> None:
        if not 2 <= max_depth <= 4096:
            raise ValueError(f"max_depth must be in [2, 4096], got {max_depth}")
        self.max_depth = max_depth
        self.seqs: dict[int, list[int]] = {}
        self.weights: dict[int, int] = {}

    # -- sequences -------------------------------------------------------------------

    def add_sequence(self, key: int, tokens: list[int], weight: int = 1) -> None:
        if key in self.seqs:
            raise KeyError(key)
        if not 1 <= weight <= 1 << 16:
            raise ValueError(f"weight must be in [1, 65536], got {weight}")
        self.extend(key, tokens)
        self.weights[key] = weight

    def extend(self, key: int, tokens: list[int]) -> None:
        if any(t < 0 for t in tokens):
            raise ValueError("token ids must be >= 0")
        self.seqs.setdefault(key, []).extend(tokens)
        self.weights.setdefault(key, 1)

    def remove_sequence(self, key: int) -> None:
        del self.seqs[key]
        del self.weights[key]

    # -- counts ----------------------------------------------------------------------

    def _counts(self) -> Counter[tuple[int, ...]]:
        """Weighted occurrences of every substring of length 1..max_depth (a sequence
        of weight k counts as k copies of it)."""
        counts: Counter[tuple[int, ...]] = Counter()
        for key, s in self.seqs.items():
            w = self.weights[key]
            for i in range(len(s)):
                for j in range(i + 1, min(i + self.max_depth, len(s)) + 1):
                    counts[tuple(s[i:j])] += w
        return counts

    def _children(self) -> dict[tuple[int, ...], dict[int, int]]:
        """path -> {next token: count of path + (token,)}."""
        children: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)
        for path, c in self._counts().items():
            children[path[:-1]][path[-1]] = c
        return children

    def count(self, path: list[int]) -> int:
        if not path:
            return sum(len(s) * self.weights[k] for k, s in self.seqs.items())
        return self._counts().get(tuple(path), 0)

    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs.values())

    def num_nodes(self) -> int:
        return 1 + len(self._counts())

    def dump(self) -> list[tuple[list[int], int]]:
        """(path, count) pairs in depth-first order, children by token id."""
        return [(list(p), c) for p, c in sorted(self._counts().items())]

    # -- drafting --------------------------------------------------------------------

    def speculate_sequence(
        self, key: int, *args: float, **kwargs: float
    ) -> tuple[list[int], list[int], list[float], int]:
        """``speculate`` with a stored sequence as the context."""
        return self.speculate(self.seqs[key], *args, **kwargs)

    def speculate(
        self,
        context: list[int],
        budget: int,
        multi_path: bool = False,
        min_prob: float = 0.1,
        max_spec_factor: float = 0.0,
        max_match_len: int = -1,
        backoff: float = 0.0,
    ) -> tuple[list[int], list[int], list[float], int]:
        children = self._children()
        cap = self.max_depth // 2 if max_match_len < 0 else max_match_len
        cap = min(cap, self.max_depth - 1, len(context))
        match_len = 0
        for n in range(cap, 0, -1):  # longest suffix that is followed by some token
            if children.get(tuple(context[len(context) - n :])):
                match_len = n
                break
        if match_len == 0:
            return [], [], [], 0
        if max_spec_factor > 0:
            budget = min(budget, int(max_spec_factor * match_len))
        if budget <= 0:
            return [], [], [], match_len
        if backoff > 0:
            return self._backed_off(children, list(context), match_len, budget, multi_path, min_prob, backoff)
        start = tuple(context[len(context) - match_len :])

        def prob(parent_p: float, node: tuple[int, ...], tok: int) -> float:
            kids = children[node]
            return parent_p * (kids[tok] / sum(kids.values()))

        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if not multi_path:
            node, p = start, 1.0
            while len(tokens) < budget and children.get(node):
                kids = children[node]
                tok = min(kids, key=lambda t: (-kids[t], t))
                q = prob(p, node, tok)
                if q < min_prob:
                    break
                parents.append(len(tokens) - 1)
                tokens.append(tok)
                probs.append(q)
                node, p = node + (tok,), q
            return tokens, parents, probs, match_len

        # Multi-path: every descendant with prob >= min_prob, ranked, best `budget` kept.
        ranked: list[tuple[float, int, tuple[int, ...]]] = []
        stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
        while stack:
            rel, p = stack.pop()
            for tok in children.get(start + rel, {}):
                q = prob(p, start + rel, tok)
                if q >= min_prob:
                    ranked.append((q, len(rel) + 1, rel + (tok,)))
                    stack.append((rel + (tok,), q))
        ranked.sort(key=lambda r: (-r[0], r[1], r[2]))
        index: dict[tuple[int, ...], int] = {}
        for q, _, rel in ranked[:budget]:
            index[rel] = len(tokens)
            parents.append(index[rel[:-1]] if len(rel) > 1 else -1)
            tokens.append(rel[-1])
            probs.append(q)
        return tokens, parents, probs, match_len

    def _backed_off(
        self,
        children: dict[tuple[int, ...], dict[int, int]],
        context: list[int],
        match_len: int,
        budget: int,
        multi_path: bool,
        min_prob: float,
        backoff: float,
    ) -> tuple[list[int], list[int], list[float], int]:
        """Drafts whose next-token distributions mix every matched context length (see the
        C++ docstring); a draft node's context is the context plus its path."""

        def deepest(ctx: tuple[int, ...], longest: int) -> int:
            """Longest suffix of ``ctx``, at most ``longest`` tokens, that occurs."""
            for n in range(min(longest, len(ctx), self.max_depth), 0, -1):
                if self._occurs(children, ctx[len(ctx) - n :]):
                    return n
            return 0

        def next_tokens(ctx: tuple[int, ...], orders: int) -> list[tuple[int, float]]:
            """Longest context first: each adds its counts at the weight the longer ones
            left it (runs of equal child totals, whose children are the same, at once)."""
            totals = {k: sum(children.get(ctx[len(ctx) - k :], {}).values()) for k in range(1, orders + 1)}
            dist: dict[int, float] = {}
            weight, k = 1.0, orders
            while k >= 1:
                total, kids = totals[k], children.get(ctx[len(ctx) - k :], {})
                denom, share = total + backoff, 0.0
                while k >= 1 and totals[k] == total:
                    share += weight / denom
                    weight *= backoff / denom
                    k -= 1
                for tok in sorted(kids, key=lambda t: (-kids[t], t))[:budget] if total else []:
                    dist[tok] = dist.get(tok, 0.0) + share * kids[tok]
            return sorted(dist.items(), key=lambda tp: (-tp[1], tp[0]))[:budget]

        ctx0 = tuple(context)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        if not multi_path:
            ctx, orders, p = ctx0, match_len, 1.0
            while len(tokens) < budget:
                best = next_tokens(ctx, orders)
                if not best or p * best[0][1] < min_prob:
                    break
                tok, q = best[0][0], p * best[0][1]
                parents.append(len(tokens) - 1)
                tokens.append(tok)
                probs.append(q)
                ctx, p = ctx + (tok,), q
                orders = deepest(ctx, orders + 1)
            return tokens, parents, probs, match_len

        # Best-first by (prob desc, depth asc, token path asc); children rank after parents.
        heap: list[tuple[float, int, tuple[int, ...], int, int]] = []  # (-q, depth, path, parent, orders)

        def push(path: tuple[int, ...], p: float, orders: int, parent: int) -> None:
            for tok, prob in next_tokens(ctx0 + path, orders):
                if p * prob >= min_prob:
                    heapq.heappush(heap, (-(p * prob), len(path) + 1, path + (tok,), parent, orders))

        push((), 1.0, match_len, -1)
        while heap and len(tokens) < budget:
            neg_q, _, path, parent, orders = heapq.heappop(heap)
            index = len(tokens)
            tokens.append(path[-1])
            parents.append(parent)
            probs.append(-neg_q)
            push(path, -neg_q, deepest(ctx0 + path, orders + 1), index)
        return tokens, parents, probs, match_len

    @staticmethod
    def _occurs(children: dict[tuple[int, ...], dict[int, int]], path: tuple[int, ...]) -> bool:
        """``path`` occurs in some sequence (it is a child of its prefix)."""
        return path[-1] in children.get(path[:-1], {})
