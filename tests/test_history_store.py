"""The cross-iteration history store: bounds, keying by token ids, decay, persistence."""

from __future__ import annotations

import pytest

from seer_engine.rollout.history import HistoryStore, prompt_key


class _Counted(list):
    """A prompt known only by its length and identity, as the simulator's are."""

    def __init__(self, n: int, key: str) -> None:
        super().__init__([0] * n)
        self.history_key = key


def test_history_store_bounds_and_recency():
    store = HistoryStore(max_prompts=2, max_lengths=3, max_sequences=2, max_sequence_tokens=4)
    p1, p2, p3 = [1, 2, 3], [4, 5], [6]
    for n in (10, 20, 30, 40):
        store.record(p1, n, token_ids=list(range(n)))
    assert store.lengths(p1) == [], "lengths count from the next iteration on"
    store.next_iteration()
    assert [n for n, _ in store.lengths(p1)] == [40, 30, 20], "newest first, at most max_lengths"
    assert store.sequences(p1) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    store.record(p2, 5)
    store.record(p1, 50)  # p1 used again: p2 is now the least recently used
    store.record(p3, 7)
    assert len(store) == 2 and p2 not in store and p1 in store and p3 in store


def test_history_store_keys_by_token_ids_and_decays():
    assert prompt_key([1, 2, 3]) == prompt_key((1, 2, 3)) != prompt_key([1, 2, 4])
    assert prompt_key([1, 2]) != prompt_key([2, 1])
    assert (
        prompt_key(_Counted(100, "q7")) == prompt_key(_Counted(900, "q7")) != prompt_key(_Counted(100, "q8"))
    )
    store = HistoryStore(half_life_iterations=1.0)
    store.record([9], 100)
    store.next_iteration()
    store.record([9], 200)
    store.next_iteration()
    assert store.lengths([9]) == [(200, 0.5), (100, 0.25)]
    assert store.lengths([9], before=1) == [(100, 0.25)]


def test_history_store_persists(tmp_path):
    store = HistoryStore(max_prompts=10, max_sequence_tokens=3)
    store.record([1, 2], 17, token_ids=[5, 6, 7, 8])
    store.next_iteration()
    path = tmp_path / "history.json"
    store.save(path)
    again = HistoryStore.load(path)
    assert again.lengths([1, 2]) == store.lengths([1, 2]) == [(17, 1.0)]
    assert again.sequences([1, 2]) == [[5, 6, 7]] and again.iteration == 1 and again.max_prompts == 10
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid"):
        HistoryStore.load(path)
    with pytest.raises(ValueError, match="not found"):
        HistoryStore.load(tmp_path / "missing.json")


def test_history_store_rejects_bad_bounds():
    with pytest.raises(ValueError, match="bounds"):
        HistoryStore(max_prompts=0)
    with pytest.raises(ValueError, match="half_life"):
        HistoryStore(half_life_iterations=0)
