"""What the modeled engines know and the scheduler must not: each response's true
length, and prompts and responses as token counts rather than token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from seer_engine.sim.acceptance import lead_share


class TokenCount(Sequence[int]):
    """Token ids the simulator counts but never holds: ``len`` works, reading one does not
    (so nothing copies a 98k-token response by accident)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):  # type: ignore[override]
        raise TypeError("simulated responses have lengths, not token ids")

    def __repr__(self) -> str:
        return f"TokenCount({self.n})"


class SimPrompt(TokenCount):
    """A simulated prompt: a length and an identity (the history store's key), no ids."""

    __slots__ = ("history_key",)

    def __init__(self, n: int, history_key: str) -> None:
        super().__init__(n)
        self.history_key = history_key

    def __repr__(self) -> str:
        return f"SimPrompt({self.n}, {self.history_key!r})"


@dataclass
class SimWorld:
    """What the modeled engines know and the scheduler must not: each response's real
    length (EOS included), and how far each group has got (speculation depends on it)."""

    lengths: Mapping[str, int]  # sample key -> output tokens
    max_tokens: int  # a response this long was cut by the budget ("length"), not EOS
    group_sizes: Mapping[str, int]
    members: Mapping[str, Sequence[str]] = field(default_factory=dict)  # group -> its sample keys
    finished: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)  # sample key -> output tokens at its last chunk end
    versions: dict[str, int] = field(default_factory=dict)  # group -> bumped when a member's written moves

    def stage(self, group_id: str) -> float:
        """Share of the group's responses already finished."""
        return self.finished.get(group_id, 0) / self.group_sizes[group_id]

    def on_response_end(self, group_id: str) -> None:
        self.finished[group_id] = self.finished.get(group_id, 0) + 1

    def on_chunk_end(self, group_id: str, key: str, written: int) -> None:
        """A chunk of ``key`` ended (cut, length or finished) with ``written`` output tokens."""
        if self.written.get(key) != written:
            self.written[key] = written
            self.versions[group_id] = self.versions.get(group_id, 0) + 1

    def lead_share(self, group_id: str, key: str, window: int) -> float:
        """How far the siblings of ``key`` have written past it, as of their last chunk
        ends (``sim.acceptance.lead_share``)."""
        others = (self.written.get(j, 0) for j in self.members.get(group_id, ()) if j != key)
        return lead_share(self.written.get(key, 0), others, window)
