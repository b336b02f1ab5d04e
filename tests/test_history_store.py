"""The cross-iteration history store: bounds, keying by token ids, decay, persistence."""

from __future__ import annotations

import json
import re

import pytest

from seer_engine.rollout import history_file
from seer_engine.rollout.history import HistoryStore, prompt_key, vocab_fingerprint


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


def _saved(tmp_path, entry: dict | None = None, **changes) -> dict:
    """A saved store's JSON with ``entry`` changed in its one prompt and ``changes`` at the top."""
    store = HistoryStore(max_lengths=2, max_sequences=2, max_sequence_tokens=3)
    store.record([1, 2], 5, token_ids=[7, 8])
    path = tmp_path / "history.json"
    store.save(path)
    data = json.loads(path.read_text())
    next(iter(data["prompts"].values())).update(entry or {})
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"prompts": []}, '"prompts" is not an object'),
        ({"entry": {"sequences": "abc"}}, "a sequence is str, not a list of token ids"),
        ({"entry": {"sequences": [[1, 2.5]]}}, "2.5 is not a non-negative integer"),
        ({"entry": {"sequences": [[-1]]}}, "-1 is not a non-negative integer"),
        ({"entry": {"sequences": [[2**40]]}}, "greater than maximum"),
        ({"entry": {"lengths": [[0, "7"]]}}, "'7' is not a non-negative integer"),
        ({"entry": {"lengths": [[0, 1, 2]]}}, "too many values to unpack"),
        ({"version": 2}, "version 2, expected 1"),
        ({"tokenizer": 7}, "tokenizer 7 is not a string"),
        ({"iteration": None}, "int() argument"),
    ],
)
def test_history_store_load_refuses_damaged_files(tmp_path, changes, message):
    """What a damaged or foreign file holds is a ValueError naming the file, not a crash
    now or a bad token id in a draft later."""
    path = tmp_path / "history.json"
    changes = dict(changes)
    entry = changes.pop("entry", None)
    path.write_text(json.dumps(_saved(tmp_path, entry, **changes)))
    with pytest.raises(ValueError, match=f"history store '{path}' is not valid: .*{re.escape(message)}"):
        HistoryStore.load(path)


def test_history_store_load_refuses_unreadable_files(tmp_path):
    for data in ([], "x", {"version": 1}):
        (tmp_path / "history.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match="is not valid"):
            HistoryStore.load(tmp_path / "history.json")
    (tmp_path / "history.json").write_text(json.dumps(_saved(tmp_path))[:-9])  # truncated
    with pytest.raises(ValueError, match="is not valid"):
        HistoryStore.load(tmp_path / "history.json")
    (tmp_path / "history.json").unlink()
    (tmp_path / "history.json").mkdir()
    with pytest.raises(ValueError, match="cannot read the history store .*Is a directory"):
        HistoryStore.load(tmp_path / "history.json")
    with pytest.raises(ValueError, match="cannot save the history store .*Is a directory"):
        HistoryStore().save(tmp_path / "history.json")
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"], "no temporary file is left"


def test_history_store_load_keeps_the_bounds(tmp_path):
    """A file holding more than its bounds allow (edited, or from another build) is cut to them."""
    lengths, sequences = [[0, n] for n in range(5)], [[1], [2], [3, 4, 5, 6]]
    data = _saved(tmp_path, {"lengths": lengths, "sequences": sequences}, bounds=[3, 2, 2, 3])
    path = tmp_path / "history.json"
    path.write_text(json.dumps(data))
    store = HistoryStore.load(path)
    store.next_iteration()
    assert store.lengths([1, 2]) == [(4, 1.0), (3, 1.0)]
    assert store.sequences([1, 2]) == [[2], [3, 4, 5]]
    data["prompts"].update({f"k{i}": {"lengths": [[0, i]], "sequences": []} for i in range(3)})
    path.write_text(json.dumps(data))
    store = HistoryStore.load(path)
    assert len(store) == 3 and [1, 2] not in store, "the most recently used max_prompts prompts"


def test_history_store_merges_what_another_server_saved(tmp_path, caplog):
    """Two servers sharing a --history directory: each save merges what the saver recorded
    since its last save into what the other saved meanwhile, so neither's records are lost
    or counted twice; each keeps counting its own iterations, the file the furthest."""
    path = tmp_path / "history.json"
    mine, theirs = HistoryStore(), HistoryStore()
    mine.record([1], 10, token_ids=[3] * 5)
    theirs.record([2], 20, token_ids=[4] * 5)
    mine.save(path)
    theirs.next_iteration()
    theirs.save(path)
    assert [1] in theirs and theirs.sequences([1]) == [[3] * 5], "the saver takes up the other's records"
    mine.record([1], 11)
    mine.record([2], 21)
    mine.save(path)
    mine.save(path)  # nothing new: written as it is, nothing doubled
    saved = HistoryStore.load(path)
    assert saved.iteration == 1 and mine.iteration == 0
    assert saved.lengths([1], before=2) == [(11, 1.0), (10, 1.0)]
    assert saved.lengths([2], before=2) == [(21, 1.0), (20, 1.0)]
    assert saved.sequences([2]) == [[4] * 5]
    assert [p.name for p in tmp_path.iterdir()] == ["history.json"], "no temporary or lock file is left"

    other = HistoryStore()
    other.bind_tokenizer("3:aaaa", 3)
    other.record([1], 1)
    other.save(path)
    mine.bind_tokenizer("3:bbbb", 9)
    mine.record([1], 12)
    with pytest.raises(
        ValueError, match=r"another server saved this history store under another tokenizer \(3:aaaa"
    ):
        mine.save(path)

    path.write_text("not json")
    theirs.record([5], 50)
    with caplog.at_level("WARNING"):
        theirs.save(path)
    assert "is not valid" in caplog.text and "overwriting it" in caplog.text
    assert [5] in HistoryStore.load(path)


def _save_each(path: str, first: int, count: int) -> None:
    store = HistoryStore()
    for k in range(first, first + count):
        store.record([k], k, token_ids=[k % 7] * 3)
        store.save(path)


def test_history_store_saves_from_processes_at_once_lose_no_record(tmp_path):
    """Processes saving to one file as fast as they can (the lock takes turns): every
    record of every process is in the file once, whatever the interleaving."""
    import multiprocessing

    path = str(tmp_path / "history.json")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_save_each, args=(path, 100 * i, 15)) for i in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    saved = HistoryStore.load(path)
    assert len(saved) == 45
    for i in range(3):
        for k in range(100 * i, 100 * i + 15):
            assert saved.lengths([k], before=1) == [(k, 1.0)] and saved.sequences([k]) == [[k % 7] * 3]


def test_history_store_is_bound_to_its_tokenizer(tmp_path):
    """Token ids mean nothing under another tokenizer: a store kept under one is refused
    by another, and an unbound one holding ids beyond the model's vocabulary too."""
    vocab = {"a": 0, "b": 1, "c": 2}
    fingerprint = vocab_fingerprint(vocab)
    assert (
        fingerprint == vocab_fingerprint(dict(reversed(vocab.items()))) != vocab_fingerprint({"a": 0, "b": 2})
    )
    store = HistoryStore()
    store.record([1, 2], 3, token_ids=[0, 1, 2])
    store.bind_tokenizer(fingerprint, 3)
    store.save(tmp_path / "history.json")
    again = HistoryStore.load(tmp_path / "history.json")
    assert again.tokenizer == fingerprint
    again.bind_tokenizer(fingerprint, 3)
    with pytest.raises(ValueError, match="written under another tokenizer"):
        again.bind_tokenizer(vocab_fingerprint({"a": 0}), 3)
    unbound = HistoryStore()
    unbound.record([1, 2], 3, token_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="holds token id 2, beyond this model's vocabulary of 2"):
        unbound.bind_tokenizer(fingerprint, 2)
    assert unbound.tokenizer is None


def test_a_save_cut_off_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    """A stop signal (SystemExit) in the middle of a save left its temporary file behind,
    and so does a save killed outright (SIGKILL, a daemon thread cut off at exit); each
    stayed in the history directory for good. The old store stays whole, the signal's
    temporary file is removed, and the next save clears what a killed one left."""
    path = tmp_path / "history.json"
    store = HistoryStore()
    store.record([1, 2], 5)
    store.save(path)
    before = path.read_bytes()
    store.record([3, 4], 7)

    def stopped(*args, **kwargs) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(json, "dumps", stopped)
    with pytest.raises(SystemExit):
        store.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["history.json"]

    (tmp_path / "history.json.k1ll3d.tmp").write_text('{"half": ')  # a save killed outright
    store.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.json"]
    assert HistoryStore.load(path).lengths([3, 4], before=1) == [(7, 1.0)]


def test_a_reopened_store_decays_as_this_runs_half_life_says(tmp_path):
    """--history-half-life is this run's: a store saved by a run with a half-life, reopened
    without one, does not decay (the flag's default), and reopened with another takes it."""
    from seer_engine.rollout.config import HISTORY_FILE, open_history

    store = open_history(str(tmp_path), half_life=1.0)
    assert store is not None
    store.record([9], 100)
    for _ in range(2):  # two weight updates
        store.next_iteration()
    store.save(tmp_path / HISTORY_FILE)
    assert store.lengths([9]) == [(100, 0.25)]
    for half_life, weight in ((None, 1.0), (2.0, 0.5), (1.0, 0.25)):
        again = open_history(str(tmp_path), half_life=half_life)
        assert again is not None and again.half_life == half_life
        assert again.lengths([9]) == [(100, weight)]


def test_stored_sequences_take_about_4_bytes_a_token(tmp_path):
    """Token ids are held compactly: a list of Python ints takes about 36 bytes a token
    (ids past 256 are objects of their own), which the store's bounds multiply by up to
    100,000 prompts x 16 sequences. Saving and loading keeps them compact and equal."""
    import tracemalloc

    store = HistoryStore(max_prompts=8, max_sequences=16, max_sequence_tokens=4096)
    tokens = [[50_000 + (7 * i + s) % 40_000 for i in range(4096)] for s in range(16)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for seq in tokens:
        store.record([1, 2, 3], len(seq), seq)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 6 * 16 * 4096, f"{grown / (16 * 4096):.1f} bytes a token"
    assert store.sequences([1, 2, 3]) == tokens
    store.save(tmp_path / "h.json")
    loaded = HistoryStore.load(tmp_path / "h.json")
    assert loaded.sequences([1, 2, 3]) == tokens
    assert all(seq.itemsize == 4 for seq in loaded._prompts[prompt_key([1, 2, 3])].sequences)


def test_history_store_holds_at_most_its_total_of_sequence_tokens(tmp_path):
    """The per-prompt caps alone allow gigabytes on a long run; past the total, the least
    recently used prompts' oldest sequences go first and every prompt's lengths stay."""
    store = HistoryStore(max_sequences=4, max_sequence_tokens=5, max_total_sequence_tokens=12)
    for p, seq in (([1], [1] * 5), ([1], [2] * 5), ([2], [3] * 2)):
        store.record(p, len(seq), token_ids=seq)
    assert store.sequence_tokens == 12
    store.record([2], 3, token_ids=[5] * 3)  # 15 > 12: [1]'s oldest goes
    assert store.sequences([1]) == [[2] * 5] and store.sequences([2]) == [[3] * 2, [5] * 3]
    store.record([3], 5, token_ids=[6] * 5)  # [1]'s last one goes
    store.record([4], 2, token_ids=[7] * 2)
    assert store.sequences([1]) == [] and store.sequence_tokens == 12
    store.record([2], 4)  # a length alone: [2] is used again, [3] now the least recent
    store.record([5], 5, token_ids=[8] * 5)
    assert store.sequences([3]) == [] and store.sequences([2]) == [[3] * 2, [5] * 3]
    assert store.sequence_tokens == 12
    store.next_iteration()
    assert [n for n, _ in store.lengths([1])] == [5, 5] and len(store) == 5
    assert store._unsaved.sequence_tokens <= 12  # what the next save merges is held to it too
    path = tmp_path / "history.json"
    store.save(path)
    again = HistoryStore.load(path)
    assert again.max_total_sequence_tokens == 12 and again.sequence_tokens == 12
    assert [again.sequences([k]) for k in (2, 4, 5)] == [[[3] * 2, [5] * 3], [[7] * 2], [[8] * 5]]
    with pytest.raises(ValueError, match="integers"):
        HistoryStore(max_total_sequence_tokens=1.5)


def test_a_store_saved_with_four_bounds_loads_with_the_default_total(tmp_path):
    path = tmp_path / "history.json"
    HistoryStore().save(path)
    data = json.loads(path.read_text())
    data["bounds"] = data["bounds"][:4]
    path.write_text(json.dumps(data))
    assert HistoryStore.load(path).max_total_sequence_tokens == HistoryStore().max_total_sequence_tokens


def test_a_save_landing_while_a_store_loads_is_merged_not_overwritten(tmp_path, monkeypatch):
    """A server starting on a shared directory reads the file and then parses it (seconds
    for a large store). Another server's save in that time was taken for the version read,
    so the starting server's first save replaced it unmerged and the other's records were
    lost; the version read is the one opened."""
    path = tmp_path / "history.json"
    running = HistoryStore()
    running.record([1], 10)
    running.save(path)
    parse = history_file.fields

    def parse_then_the_other_saves(text):
        monkeypatch.setattr(history_file, "fields", parse)
        running.record([2], 20)
        running.save(path)
        return parse(text)

    monkeypatch.setattr(history_file, "fields", parse_then_the_other_saves)
    starting = HistoryStore.load(path)
    assert [1] in starting and [2] not in starting
    starting.record([3], 30)
    starting.save(path)
    saved = HistoryStore.load(path)
    assert [saved.lengths([k], before=1) for k in (1, 2, 3)] == [[(10, 1.0)], [(20, 1.0)], [(30, 1.0)]]


def test_what_is_recorded_after_a_save_is_counted_afresh(tmp_path):
    """A save emptied the records it merges from but kept their token count and the keys
    holding sequences: a server crashed with a KeyError recording a response once its
    sequence tokens since startup passed the total (a few weight updates), and before that
    dropped new sequences the next merge needed. After a save the count starts over."""
    path = tmp_path / "history.json"
    mine, theirs = HistoryStore(max_total_sequence_tokens=10), HistoryStore(max_total_sequence_tokens=10)
    mine.record([1], 8, token_ids=[5] * 8)
    mine.save(path)
    mine.record([2], 4, token_ids=[6] * 4)
    mine.record([1], 3, token_ids=[7] * 3)
    theirs.record([3], 1)
    theirs.save(path)
    mine.save(path)
    saved = HistoryStore.load(path)
    assert saved.sequences([2]) == [[6] * 4] and saved.sequences([1]) == [[7] * 3]
    assert saved.sequence_tokens == mine.sequence_tokens == 7 and [3] in saved


def test_a_save_takes_memory_for_one_prompt_at_a_time(tmp_path):
    """Saving (at every weight update and at shutdown) built the whole store as lists of
    Python ints, about ten times the 4 bytes a token it keeps (GBs at the 2^26-token
    total), and encoded it in pure Python; it writes a prompt at a time now."""
    import tracemalloc

    store = HistoryStore()
    for k in range(64):
        store.record([k], 4096, token_ids=range(1000, 5096))
    held = 4 * store.sequence_tokens
    tracemalloc.start()
    try:
        store.save(tmp_path / "history.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < held // 2, (peak, held)
    again = HistoryStore.load(tmp_path / "history.json")
    assert again.sequences([63]) == [list(range(1000, 5096))]
    assert again.lengths([0], before=1) == [(4096, 1.0)]


def test_a_save_does_not_wait_for_good_on_another_processs_lock(tmp_path, monkeypatch):
    """A process stopped mid-save (SIGSTOP) holds the directory's lock: another server's
    save gives up after LOCK_TIMEOUT_S with an error naming the lock (its weight update
    then goes on, the store kept in memory) instead of waiting for good; once the lock is
    free, the same store saves."""
    import fcntl
    import os

    from seer_engine.rollout import history

    monkeypatch.setattr(history, "LOCK_TIMEOUT_S", 0.2)
    store = HistoryStore()
    store.record([1, 2, 3], 2, token_ids=[7, 8])
    path = tmp_path / "history.json"
    held = os.open(tmp_path, os.O_RDONLY)  # another open file description: flock conflicts
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="held the lock on .* for 0.2 s"):
            store.save(path)
        assert not path.exists()
    finally:
        os.close(held)
    store.save(path)
    assert HistoryStore.load(path).sequences([1, 2, 3]) == [[7, 8]]


def _several(tmp_path) -> tuple[HistoryStore, object]:
    """A store of several prompts over iterations, saved: lengths, sequences, a tokenizer."""
    store = HistoryStore(max_prompts=50, max_lengths=4, max_sequences=3, max_sequence_tokens=6)
    store.bind_tokenizer("9:abcd", 1 << 20)
    for it in range(3):
        for k in range(5):
            store.record([k, it % 2], 10 * k + it, token_ids=[1000 * k + it + j for j in range(k + 3)])
        store.add_sequence([4, 0], [7] * 9)
        store.next_iteration()
    path = tmp_path / "history.json"
    store.save(path)
    return store, path


def _same(a: HistoryStore, b: HistoryStore) -> None:
    assert (a.iteration, a.tokenizer, a.half_life, a.sequence_tokens) == (
        b.iteration,
        b.tokenizer,
        b.half_life,
        b.sequence_tokens,
    )
    assert list(a._prompts) == list(b._prompts) and list(a._prompts.holding) == list(b._prompts.holding)
    for key, entry in a._prompts.items():
        other = b._prompts[key]
        assert list(entry.lengths) == list(other.lengths)
        assert [s.tolist() for s in entry.sequences] == [s.tolist() for s in other.sequences]


def test_a_store_of_several_prompts_loads_as_it_was_saved(tmp_path):
    store, path = _several(tmp_path)
    again = HistoryStore.load(path)
    _same(again, store)
    assert len(again) == 10 and again.sequences([4, 0])[-1] == [7] * 6


def test_a_store_whose_fields_come_in_another_order_loads(tmp_path):
    """The file is JSON: one written by hand or another tool may put "prompts" first, or
    space it out; it holds the same store."""
    store, path = _several(tmp_path)
    data = json.loads(path.read_text())
    prompts = data.pop("prompts")
    path.write_text(json.dumps({"prompts": prompts, **dict(reversed(data.items()))}, indent=2))
    _same(HistoryStore.load(path), store)
    path.write_text(json.dumps({"tokenizer": data["tokenizer"], "prompts": prompts, **data}) + "\n ")
    _same(HistoryStore.load(path), store)
    path.write_text(json.dumps({"prompts": prompts, **data, "version": 2}))
    with pytest.raises(ValueError, match=f"history store '{path}' is not valid: version 2, expected 1"):
        HistoryStore.load(path)
    del data["bounds"]
    path.write_text(json.dumps({"prompts": prompts, **data}))
    with pytest.raises(ValueError, match=f"history store '{path}' is not valid: no 'bounds' field"):
        HistoryStore.load(path)


def test_a_cut_off_or_foreign_file_is_a_clear_error(tmp_path):
    """Wherever a save was cut off, or whatever follows or replaces the store's JSON, the
    load says the file is not valid, naming it."""
    _, path = _several(tmp_path)
    text = path.read_text()
    damaged = [text[:n] for n in range(0, len(text), 7)]
    damaged += [text + "x", text + "{}", text[:-1] + ", }}", text.replace(": {", " {", 1), "\x00", "null"]
    damaged += [text.replace('"prompts": {', '"prompts": {"k": 1, ', 1), "{" + text]
    # nested past Python's recursion limit: was a RecursionError traceback at start
    damaged += [text.replace('"prompts": {', '"prompts": {"k": ' + "[" * 100_000 + "]" * 100_000 + ", ", 1)]
    for bad in damaged:
        path.write_text(bad)
        with pytest.raises(ValueError, match=f"history store '{path}' is not valid"):
            HistoryStore.load(path)


def test_loading_takes_memory_for_one_prompt_at_a_time(tmp_path):
    """Loading (each server start on a --history directory) parsed the whole file into
    Python ints, about ten times the 4 bytes a token the store keeps (GBs at the 2^26-token
    total); it parses a prompt at a time now: about the file's text and the store."""
    import tracemalloc

    store = HistoryStore()
    for k in range(50):
        for s in range(4):
            store.record([k], 1000, token_ids=range(10_000 + s, 11_000 + s))
    path = tmp_path / "history.json"
    store.save(path)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        again = HistoryStore.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert again.sequence_tokens == 200_000 and again.sequences([49]) == store.sequences([49])
    assert peak < 4 * size, f"peak {peak} bytes, {peak / size:.1f} times the file's {size}"
