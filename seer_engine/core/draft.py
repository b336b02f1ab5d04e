"""A draft token tree and how one is verified: the shapes every proposer and the
engine share (no C++ needed here).

Verification lays the tree after the request's last committed token (the root row),
parents before children: row 0 is the root, row i + 1 is node i. Every row is
sampled at its own sequence position with the request's ordinary sampler, so a row's
token is exactly what decoding without speculation would emit there if the path to
it were the committed prefix. Acceptance walks from the root: while the token sampled
at the current row equals one of its children's tokens, step into that child; the
first token that matches no child is the bonus token.

Why this is lossless. For greedy rows the sampled token is the target argmax, the
greedy rule. For random rows it is a draw from the target distribution p (the
sampler's exponential race, seeded by request and position only). Following the
child whose token equals the draw is the multi-child rule for point-mass drafts:
child c_1 is accepted with probability p(c_1), after its rejection c_2 with
p(c_2) / (1 - p(c_1)), and so on, and when every child is rejected the token comes
from p restricted to the tokens no child holds. So every emitted token is
distributed as p, and with the same seed the emitted tokens are the same as with
speculation off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class DraftTree:
    """Node i is ``tokens[i]``, hanging off node ``parents[i]`` (-1: the root, i.e. the
    last committed token). Parents come before children, so a single path has parents
    ``[-1, 0, 1, ...]``. ``probs[i]`` estimates the probability of the whole path to
    node i; ``match_len`` is how many context tokens the draft was conditioned on."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0

    @classmethod
    def of(cls, tokens: list[int], parents: list[int], probs: list[float], match_len: int = 0) -> DraftTree:
        """``DraftTree(tokens, parents, probs, match_len)`` without the frozen dataclass's
        ``__init__`` (an ``object.__setattr__`` call per field, about 0.7 µs): drafters build
        one per request per step. The arguments are taken as they are, not copied."""
        draft = object.__new__(cls)
        draft.__dict__.update(tokens=tokens, parents=parents, probs=probs, match_len=match_len)
        return draft

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @cached_property
    def is_path(self) -> bool:
        """A single chain: causal attention already is its tree mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def children(self) -> list[dict[int, int]]:
        """Per row (0 = root, i + 1 = node i): child token -> child node index."""
        rows: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (tok, p) in enumerate(zip(self.tokens, self.parents)):
            rows[p + 1].setdefault(tok, i)
        return rows

    def row_mask_bits(self) -> list[int]:
        """Per verification row: bit j set <=> the row sees row j (root, ancestors, itself)."""
        bits = [1]
        for i, p in enumerate(self.parents):
            bits.append(bits[p + 1] | (1 << (i + 1)))
        return bits

    def truncated(self, num_nodes: int) -> DraftTree:
        """The first ``num_nodes`` nodes: still a valid tree, parents come first."""
        if num_nodes >= len(self.tokens):
            return self
        n = max(0, num_nodes)
        return DraftTree(self.tokens[:n], self.parents[:n], self.probs[:n], self.match_len)

    def validate(self) -> None:
        if not (len(self.tokens) == len(self.parents) and len(self.probs) in (0, len(self.tokens))):
            raise ValueError("a draft's tokens, parents and probs must have the same length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}: parents must come before children")


@dataclass
class Acceptance:
    """The outcome of verifying one request's draft."""

    nodes: list[int]  # accepted draft nodes, root to leaf
    tokens: list[int]  # emitted tokens: the accepted nodes' tokens, then the bonus token
    rows: list[int]  # the verification row each emitted token was sampled at
    draft_depth: int = 0  # depth of the draft that was verified (0: none)


def accept(draft: DraftTree | None, row_tokens: Sequence[int]) -> Acceptance:
    """Walk the draft with the token sampled at every row (see the module docstring)."""
    if not draft:
        return Acceptance([], [row_tokens[0]], [0])
    children = draft.children
    nodes: list[int] = []
    rows = [0]
    row = 0
    while True:
        token = row_tokens[row]
        child = children[row].get(token)
        if child is None:
            break
        nodes.append(child)
        row = child + 1
        rows.append(row)
    tokens = [draft.tokens[n] for n in nodes] + [row_tokens[row]]
    return Acceptance(nodes, tokens, rows, max(draft.depths))
