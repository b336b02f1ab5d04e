"""What earlier iterations of an RL run showed about each prompt (beyond Seer).

RL revisits every prompt once per epoch. The store keeps, per prompt (keyed by its
token ids), the lengths of its responses in earlier iterations and, capped, some of
their token sequences. The Context Manager uses the lengths as the prior of a
group's longest response; a grouped drafter can seed the group's suffix tree with
the sequences, so drafts work from the first token.

Bounded four ways: at most ``max_prompts`` prompts (least recently used goes
first), ``max_lengths`` lengths per prompt (oldest first), ``max_sequences``
sequences of at most ``max_sequence_tokens`` tokens per prompt, and
``max_total_sequence_tokens`` over all prompts (the least recently used prompts'
oldest sequences go first; their lengths stay). Lengths carry the
iteration they were seen in; ``weight`` halves a length's say every
``half_life_iterations`` (the policy that wrote it has changed since).

Several servers may share one store file (a ``--history`` directory on one host): a
save merges what this store recorded since its last save into whatever the others
saved meanwhile, under a lock, so no server's records are lost.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import stat
import tempfile
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from seer_engine.core.file_lock import flock_within
from seer_engine.core.numbers import is_int
from seer_engine.rollout import history_file

logger = logging.getLogger(__name__)


def prompt_key(prompt_token_ids: Sequence[int]) -> str:
    """The store's key of a prompt: a digest of its token ids. Prompts that are only
    counted (the simulator's ``TokenCount``) carry their own ``history_key`` instead."""
    own = getattr(prompt_token_ids, "history_key", None)
    if own is not None:
        return str(own)
    data = np.asarray(prompt_token_ids, dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """Which tokenizer a store's token ids belong to: its size and a digest of its vocabulary."""
    data = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return f"{len(vocab)}:{hashlib.blake2b(data, digest_size=8).hexdigest()}"


# Sequence tokens the whole store holds at most: 256 MiB of token ids. Without it the
# per-prompt caps allow 100,000 prompts x 16 x 4,096 tokens, 26 GB.
DEFAULT_MAX_TOTAL_SEQUENCE_TOKENS = 1 << 26
# How long a save waits for another process's save in the same directory: a process
# stopped mid-save (SIGSTOP, a debugger) must not hold up this one's weight updates.
LOCK_TIMEOUT_S = 120.0


@dataclass
class PromptHistory:
    """One prompt's record: what its earlier responses were."""

    lengths: deque = field(default_factory=deque)  # (iteration, length), oldest first
    sequences: deque = field(default_factory=deque)  # token ids (array('i')), oldest first


class _Records(OrderedDict):
    """Prompt records by key, least recently used first, with the tokens their sequences
    hold and the keys of those that hold any (in the same order: the total's trim order)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequence_tokens = 0
        self.holding: OrderedDict[str, None] = OrderedDict()

    def clear(self) -> None:
        """No records: no tokens and no keys holding any either."""
        super().clear()
        self.sequence_tokens = 0
        self.holding.clear()


class HistoryStore:
    """Per-prompt lengths and token sequences of earlier iterations, bounded (see module doc).

    One store is shared by every instance's drafter and the Context Manager; it is plain
    data (JSON ``save``/``load``), so a server can persist it between runs.
    """

    def __init__(
        self,
        max_prompts: int = 100_000,
        max_lengths: int = 64,
        max_sequences: int = 16,
        max_sequence_tokens: int = 4096,
        max_total_sequence_tokens: int = DEFAULT_MAX_TOTAL_SEQUENCE_TOKENS,
        half_life_iterations: float | None = None,
    ) -> None:
        bounds = (max_prompts, max_lengths, max_sequences, max_sequence_tokens, max_total_sequence_tokens)
        if not all(is_int(b) for b in bounds):
            raise ValueError(f"history bounds must be integers, got {list(bounds)}")
        if (
            min(max_prompts, max_lengths) < 1
            or min(max_sequences, max_sequence_tokens, max_total_sequence_tokens) < 0
        ):
            raise ValueError("history bounds must be >= 1 (sequences: >= 0)")
        if half_life_iterations is not None and half_life_iterations <= 0:
            raise ValueError(f"half_life_iterations must be > 0, got {half_life_iterations}")
        self.max_prompts = max_prompts
        self.max_lengths = max_lengths
        self.max_sequences = max_sequences
        self.max_sequence_tokens = max_sequence_tokens
        self.max_total_sequence_tokens = max_total_sequence_tokens
        self.half_life = half_life_iterations
        self.iteration = 0
        self.tokenizer: str | None = None  # vocab_fingerprint of the tokenizer (None: not bound yet)
        self._prompts = _Records()
        # What was recorded since the last save (bounded as the store is): a save merges
        # it into a file another server wrote meanwhile.
        self._unsaved = _Records()
        self._file_state: tuple[int, int, int] | None = None  # the file as last read or written
        self._file_iteration = 0  # the iteration it was written with

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def sequence_tokens(self) -> int:
        """Tokens the stored sequences hold, over all prompts."""
        return self._prompts.sequence_tokens

    def __contains__(self, prompt_token_ids: object) -> bool:
        return prompt_key(prompt_token_ids) in self._prompts  # type: ignore[arg-type]

    def bind_tokenizer(self, fingerprint: str, vocab_size: int) -> None:
        """The store's token ids are this tokenizer's (``vocab_fingerprint``) and model's.
        A store kept under another tokenizer is refused: its keys mean other prompts and
        its sequences could draft tokens the model does not have (an unbound store, e.g.
        a server's, is refused for such tokens alone)."""
        if self.tokenizer is not None and self.tokenizer != fingerprint:
            raise ValueError(
                f"the history store was written under another tokenizer ({self.tokenizer}, this "
                f"model's is {fingerprint}); give this model its own --history directory"
            )
        top = max((max(s) for e in self._prompts.values() for s in e.sequences if s), default=-1)
        if top >= vocab_size:
            raise ValueError(
                f"the history store holds token id {top}, beyond this model's vocabulary of "
                f"{vocab_size}: it was written for another model; give this one its own --history directory"
            )
        self.tokenizer = fingerprint

    def next_iteration(self) -> None:
        """A new rollout iteration begins (the weights moved on)."""
        self.iteration += 1

    def record(
        self, prompt_token_ids: Sequence[int], length: int, token_ids: Sequence[int] | None = None
    ) -> None:
        """A response to the prompt finished with ``length`` tokens (its ids, optionally)."""
        record = PromptHistory(deque([(self.iteration, int(length))]))
        if token_ids is not None:
            record.sequences.extend(self._clipped(token_ids))
        self._add(prompt_key(prompt_token_ids), record)

    def add_sequence(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """A finished response's tokens alone (its length is recorded elsewhere)."""
        self._add(prompt_key(prompt_token_ids), PromptHistory(sequences=deque(self._clipped(token_ids))))

    def _add(self, key: str, record: PromptHistory) -> None:
        """Into the store and into what the next save must merge."""
        for records in (self._prompts, self._unsaved):
            self._extend(records, key, record)

    def _clipped(self, token_ids: Sequence[int]) -> list[array]:
        """The sequence as stored (capped; 4 bytes a token, where a list of ints takes about
        36), or none if sequences are not kept."""
        if not self.max_sequences or not len(token_ids):
            return []
        return [array("i", [int(t) for t in list(token_ids)[: self.max_sequence_tokens]])]

    def _extend(self, records: _Records, key: str, more: PromptHistory) -> None:
        """``more``'s lengths and sequences after those of ``key``'s record (made the most
        recently used), oldest dropped past the bounds."""
        entry = self._entry(records, key)
        entry.lengths.extend(more.lengths)
        while len(entry.lengths) > self.max_lengths:
            entry.lengths.popleft()
        if self.max_sequences:
            cap = self.max_sequence_tokens
            for seq in more.sequences:
                # shared, not copied, when within the cap: unsaved records hold the store's own arrays
                entry.sequences.append(seq if len(seq) <= cap else seq[:cap])
                records.sequence_tokens += len(entry.sequences[-1])
            while len(entry.sequences) > self.max_sequences:
                records.sequence_tokens -= len(entry.sequences.popleft())
            if entry.sequences:
                records.holding[key] = None  # a new key goes last; a known one _entry moved there
        self._trim(records)

    def _trim(self, records: _Records) -> None:
        """Within the total: the least recently used prompts' oldest sequences go."""
        while records.sequence_tokens > self.max_total_sequence_tokens:
            key = next(iter(records.holding))
            sequences = records[key].sequences
            records.sequence_tokens -= len(sequences.popleft())
            if not sequences:
                del records.holding[key]

    def _entry(self, records: _Records, key: str) -> PromptHistory:
        """The prompt's record in ``records`` (new, or moved to the most recently used end)."""
        entry = records.get(key)
        if entry is None:
            entry = records[key] = PromptHistory()
            while len(records) > self.max_prompts:
                gone, old = records.popitem(last=False)
                records.sequence_tokens -= sum(map(len, old.sequences))
                records.holding.pop(gone, None)
        else:
            records.move_to_end(key)
            if key in records.holding:
                records.holding.move_to_end(key)
        return entry

    def lengths(self, prompt_token_ids: Sequence[int], before: int | None = None) -> list[tuple[int, float]]:
        """(length, weight) of the prompt's earlier responses (iterations before ``before``,
        default: before the current one), most recent first."""
        entry = self._prompts.get(prompt_key(prompt_token_ids))
        if entry is None:
            return []
        limit = self.iteration if before is None else before
        out = []
        for it, length in reversed(entry.lengths):
            if it < limit:
                out.append((length, self.weight(it)))
        return out

    def weight(self, iteration: int) -> float:
        """How much a length seen in ``iteration`` still says (1 without a half-life)."""
        if self.half_life is None:
            return 1.0
        return 0.5 ** ((self.iteration - iteration) / self.half_life)

    def sequences(self, prompt_token_ids: Sequence[int]) -> list[list[int]]:
        """Copies of the prompt's stored responses (token ids, capped), oldest first."""
        entry = self._prompts.get(prompt_key(prompt_token_ids))
        return [list(s) for s in entry.sequences] if entry is not None else []

    # -- persistence -----------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the store as JSON, atomically (a crash leaves the old file). If another
        server saved to ``path`` since this store last read or wrote it, what this store
        recorded since its last save is merged into that file's records first (and this
        store takes them up); a lock on the directory keeps concurrent saves in turn. A
        file that is not a store is overwritten, with a warning."""
        p = Path(path)
        try:
            with _locked(p):
                state = _file_state(p)
                if state is not None and state != self._file_state:
                    try:
                        saved = HistoryStore.load(p)
                    except ValueError as e:  # not a store: this one is the best there is
                        logger.warning("%s; overwriting it with this store", e)
                    else:
                        self._merge_from(saved)
                        self._file_iteration = saved.iteration
                # The furthest any sharing server has got; this store counts its own updates.
                self._write(p, max(self.iteration, self._file_iteration))
        except OSError as e:
            raise ValueError(f"cannot save the history store to {str(p)!r}: {e}") from None
        self._unsaved.clear()

    def _merge_from(self, saved: HistoryStore) -> None:
        """Take up ``saved``'s records (another server's save) and put this store's
        unsaved ones on top, each within this store's bounds."""
        if saved.tokenizer is not None and self.tokenizer is not None and saved.tokenizer != self.tokenizer:
            raise ValueError(
                f"another server saved this history store under another tokenizer ({saved.tokenizer}, "
                f"this one's is {self.tokenizer})"
            )
        self.tokenizer = self.tokenizer or saved.tokenizer
        merged = _Records()
        for records in (saved._prompts, self._unsaved):
            for key, record in records.items():
                self._extend(merged, key, record)
        self._prompts = merged

    def _write(self, p: Path, iteration: int) -> None:
        head = {
            "version": 1,
            "iteration": iteration,
            "bounds": [
                self.max_prompts,
                self.max_lengths,
                self.max_sequences,
                self.max_sequence_tokens,
                self.max_total_sequence_tokens,
            ],  # fmt: skip
            "half_life_iterations": self.half_life,
            "tokenizer": self.tokenizer,
        }
        # Called under the directory's lock, so no other writer is mid-save: a temporary
        # file there was left by a save that was killed (SIGKILL, a daemon thread cut off).
        for left in p.parent.glob(f"{glob.escape(p.name)}.*.tmp"):
            left.unlink(missing_ok=True)
        tmp = None
        try:
            # A temporary file of its own: writers sharing a directory never touch each other's.
            fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
            with os.fdopen(fd, "w") as f:
                self._dump(f, head)
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename: a power cut leaves old or new
            os.replace(tmp, p)
        except BaseException:  # also a stop signal: the old file stays, no temporary one
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise
        self._file_state, self._file_iteration = _file_state(p), iteration

    def _dump(self, f, head: dict) -> None:
        """``head`` with the prompts' records, as one JSON object written a prompt at a
        time: the whole store as Python ints would take about ten times its 4 bytes a token."""
        f.write(json.dumps(head)[:-1] + ', "prompts": {')
        for n, (key, e) in enumerate(self._prompts.items()):
            entry = {"lengths": list(map(list, e.lengths)), "sequences": [s.tolist() for s in e.sequences]}
            f.write(f"{', ' if n else ''}{json.dumps(key)}: {json.dumps(entry)}")
        f.write("}}")

    @classmethod
    def load(cls, path: str | os.PathLike) -> HistoryStore:
        """The store saved at ``path``, checked: a damaged file is a ValueError saying so,
        and what it holds is cut to its bounds."""
        p = Path(path)
        try:
            with open(p, "rb") as f:  # the state of the version read, whatever replaces it meanwhile
                state = _state(os.fstat(f.fileno()))
                text = history_file.read_text(f)
            store = cls._parse(text)
            store._file_state, store._file_iteration = state, store.iteration
        except FileNotFoundError:
            raise ValueError(f"history store {str(p)!r} not found") from None
        except OSError as e:
            raise ValueError(f"cannot read the history store {str(p)!r}: {e}") from None
        except (AttributeError, KeyError, OverflowError, RecursionError, TypeError, ValueError) as e:
            detail = f"no {e} field" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"history store {str(p)!r} is not valid: {detail}") from None
        return store

    @classmethod
    def _parse(cls, text: str) -> HistoryStore:
        """The store ``text`` holds, its records made compact one prompt at a time as they
        are read (read twice if "prompts" comes before the fields the store is made of)."""
        head: dict[str, Any] = {}
        store = prompts = None
        for name, value in history_file.fields(text):
            if name != "prompts":
                head[name] = value
                continue
            prompts = value
            if {"version", "bounds", "half_life_iterations"} <= head.keys():
                store = cls._made_of(head)
                store._take(prompts)
        if store is None:
            store = cls._made_of(head)
            if prompts is None:
                raise KeyError("prompts")
            store._take(prompts)
        store.iteration = int(head["iteration"])
        store.tokenizer = head.get("tokenizer")
        if store.tokenizer is not None and not isinstance(store.tokenizer, str):
            raise ValueError(f"tokenizer {store.tokenizer!r} is not a string")
        return store

    @classmethod
    def _made_of(cls, head: dict[str, Any]) -> HistoryStore:
        """An empty store of the file's version, bounds and half-life."""
        if head.get("version") != 1:
            raise ValueError(f"version {head.get('version')!r}, expected 1")
        return cls(*head["bounds"], half_life_iterations=head.get("half_life_iterations"))

    def _take(self, prompts: Iterable[tuple[str, Any]]) -> None:
        """The file's records in its order, each cut to the bounds: the store drops the
        least recently used past ``max_prompts``, so the file's last ones stay."""
        for key, entry in prompts:
            item = PromptHistory()
            for it, n in entry["lengths"][-self.max_lengths :]:
                item.lengths.append((_count(it), _count(n)))
            for seq in entry["sequences"][-self.max_sequences :] if self.max_sequences else []:
                if not isinstance(seq, list):
                    raise ValueError(f"a sequence is {type(seq).__name__}, not a list of token ids")
                item.sequences.append(array("i", [_count(t) for t in seq[: self.max_sequence_tokens]]))
            self._extend(self._prompts, str(key), item)


def _file_state(p: Path) -> tuple[int, int, int] | None:
    """Which version of the file is there (every save replaces it with a new inode);
    None if there is no file."""
    try:
        return _state(p.stat())
    except FileNotFoundError:
        return None


def _state(st: os.stat_result) -> tuple[int, int, int] | None:
    if not stat.S_ISREG(st.st_mode):
        return None  # a directory in the way: writing names it
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@contextlib.contextmanager
def _locked(p: Path) -> Iterator[None]:
    """An exclusive lock on ``p``'s directory while the block runs (no lock file is left
    behind; ``flock`` holds between processes on one host)."""
    fd = os.open(p.parent, os.O_RDONLY)
    try:
        if not flock_within(fd, LOCK_TIMEOUT_S, max_pause_s=0.05):
            raise OSError(f"another process has held the lock on {str(p.parent)!r} for {LOCK_TIMEOUT_S:g} s")
        yield
    finally:
        os.close(fd)  # releases the lock


def _count(value: object) -> int:
    """A stored iteration, length or token id: a non-negative integer (not a bool or float)."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{value!r} is not a non-negative integer")
    return value
