"""Seer's distributed grouped draft server, for engine instances in their own processes.

In one process all instances share one ``SuffixProposer``. Across processes each
engine drafts from its own replica of the trees (``ReplicaProposer``): it appends the
tokens its requests generate, hands them out as ``TokenAppend`` records
(``take_updates``), and appends the records of the other instances (``apply``). The
``DraftServer`` in the rollout's process keeps, per group, the log of every record
published and a cursor per instance, so each instance fetches only what is new for
the groups it runs now.

Drafts depend only on tree contents: the C++ tree counts the occurrences of every
substring of every sequence, and both draft rules break ties by token id, never by
sequence key or by the order in which sequences or tokens arrived. A replica that
holds the same sequences as the shared proposer (the prompt once, every response's
output as one sequence) therefore proposes exactly the same drafts. A stale replica
(records still in flight) only drafts from less, which lowers acceptance; every
draft is verified by the target model, so outputs never change.

The protocol, per engine step of instance ``i``::

    worker:  replica.apply(updates); engine.step(); reply(..., replica.take_updates())
    main:    server.publish(i, reply.draft_updates)   # before acting on the outputs
             updates = server.updates_for(i, groups instance i runs now)  # sent with the next step

With a history store, the rollout's process seeds a group before its first step:
``server.seed(g, prompt, responses)`` puts a ``HistorySeed`` at the head of the group's
log, so every replica that runs the group builds the same seeded tree (and proposes
the drafts one shared, seeded proposer would).

When a group is done: ``server.finish_group(g)`` and ``replica.finish_group(g)`` on
every worker (its pipe is FIFO, so no record of the group arrives after that). Group
ids may come back (a later iteration, a caller's ``group_id``): a worker that is given
a request of group ``g`` calls ``replica.reopen(g)``, or the records it receives for
``g`` before the request's first step are ignored as late ones (fewer drafts, nothing
worse). ``take_updates`` must be called every step: the outbox only grows until then.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from seer_engine.core.draft import DraftTree
from seer_engine.core.request import Request
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.proposers import SuffixProposer
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY

MAX_TOMBSTONES = 4096  # finished groups a replica remembers (records in flight are a few steps old)
SEED_SOURCE = -1  # the publisher of history seeds: no instance, so every instance gets them


class TokenAppend(NamedTuple):
    """Output tokens ``[start, start + len(tokens))`` of one response (a named tuple:
    small and fast to pickle, one per response and step).

    ``prompt_token_ids`` comes with the first record of a tree that its publisher built
    itself, so that a replica that never ran the group can build the tree too."""

    group_id: str | None
    sequence_id: str
    start: int
    tokens: tuple[int, ...]
    prompt_token_ids: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class HistorySeed(NamedTuple):
    """Earlier iterations' responses to a group's prompt, for every replica's tree of the
    group (``SuffixProposer.seed_group``)."""

    group_id: str | None
    prompt_token_ids: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]


@dataclass
class ReplicaStats:
    published_records: int = 0  # returned by take_updates
    published_tokens: int = 0
    applied_records: int = 0  # records that appended something
    applied_tokens: int = 0
    overlap_tokens: int = 0  # already in the tree (own or earlier records): trimmed
    gap_records: int = 0  # started beyond what the replica had: dropped
    finished_records: int = 0  # for groups finished here: ignored
    seed_tokens: int = 0  # history tokens seeded into trees


class ReplicaProposer(SuffixProposer):
    """A ``SuffixProposer`` whose trees are kept in sync with the other instances' through
    a ``DraftServer`` (grouped, or per-request as ``SuffixProposer``).

    Foreign records go through the same per-sequence bookkeeping as ``observe``
    (``_seq_keys``, ``_appended``: output tokens of the sequence in the tree), so a
    response that resumes here after running elsewhere appends only what is beyond
    the tokens that already arrived: no token is ever appended twice.

    Overlaps (tokens the replica already has) are trimmed, trusting that the same
    offsets of one response hold the same tokens. A gap (a record that starts beyond
    what the replica has) is dropped and the sequence kept as it is: appending it would
    join tokens that are not adjacent and count substrings that never occurred. The
    server's per-group log in publish order makes gaps impossible (a publisher's
    offsets come from records earlier in the same log); should one happen, the
    sequence stops growing here until the response itself runs here, whose ``observe``
    fills the gap from its own tokens.
    """

    def __init__(self, config: SpeculativeConfig, grouped: bool) -> None:
        super().__init__(config, grouped)
        self.stats = ReplicaStats()
        self._outbox: list[TokenAppend] = []
        self._outbox_at: dict[str, int] = {}  # sequence id -> index of its record in the outbox
        # Finished groups, oldest first, bounded: group ids may be reused (a later
        # iteration, a caller's group_id), so this only shields against late records.
        self._finished: dict[Hashable, None] = {}

    def observe(self, request: Request) -> None:
        sid = request.sequence_id
        start = self._appended.get(sid, 0)
        prompt = None
        if start == 0:  # new here: the group runs here (again), and its tree needs its prompt
            self.reopen(request.group_id)
            tree = self._tree_of(request)
            if tree not in self.trees:  # built here first: the others may not have the prompt
                prompt = tuple(request.prompt_token_ids)
            elif not self._has_prompt(tree):  # built from prompt-less records (never from the server)
                prompt = tuple(request.prompt_token_ids)
                self.trees.append(tree, PROMPT_KEY, prompt)
        super().observe(request)
        end = self._appended[sid]
        if end > start or prompt is not None:
            self._queue(request.group_id, sid, start, request.output_token_ids[start:end], prompt)

    def propose(self, request: Request, budget: int, multi_path: bool) -> DraftTree:
        done = self._appended.get(request.sequence_id)
        if done is not None and done < request.num_output_tokens:
            # A chunk that resumed here before the drafter observed it, its earlier tokens
            # known from records: its own sequence must end where the request does.
            self.observe(request)
        elif done is not None and done > request.num_output_tokens:
            # Records carry this response beyond the request (a chunk re-run from an
            # earlier point): its stored sequence is not its context, its tokens are.
            tail = request.all_token_ids[-self.match_cap :]
            return self.trees.speculate(self._tree_of(request), tail, budget, multi_path)
        return super().propose(request, budget, multi_path)

    def take_updates(self) -> list[TokenAppend]:
        """What this replica observed since the last call, at most one record per response."""
        out, self._outbox = self._outbox, []
        self._outbox_at.clear()
        self.stats.published_records += len(out)
        self.stats.published_tokens += sum(len(r.tokens) for r in out)
        return out

    def apply(self, updates: Iterable[TokenAppend | HistorySeed]) -> None:
        """Append other instances' tokens and history seeds; see the class docstring for
        overlaps and gaps."""
        stats = self.stats
        for rec in updates:
            if rec.group_id in self._finished:
                stats.finished_records += 1
                continue
            if type(rec) is HistorySeed:
                stats.seed_tokens += self.seed_group(rec.group_id, rec.prompt_token_ids, rec.responses)
                continue
            gid, sid, start, tokens, prompt = rec
            tree = gid if self.grouped else sid
            if prompt is not None and not self._has_prompt(tree):
                self.trees.append(tree, PROMPT_KEY, prompt)
                if sid not in self._seq_keys:  # so that finish_group finds its tree
                    self._register(gid, sid)
            done = self._appended.get(sid, 0)
            if start > done:
                stats.gap_records += 1
                continue
            skip = done - start
            stats.overlap_tokens += min(skip, len(tokens))
            if skip >= len(tokens):
                continue
            if sid not in self._seq_keys:
                self._register(gid, sid)
            self.trees.append(tree, self._seq_keys[sid], tokens[skip:])
            self._appended[sid] = start + len(tokens)
            stats.applied_records += 1
            stats.applied_tokens += len(tokens) - skip

    def finish_group(self, group_id: str) -> None:
        """Free the group, drop its unsent records, and ignore records that still arrive
        for it (until a request of the group runs here again: ids may be reused)."""
        super().finish_group(group_id)
        if any(r.group_id == group_id for r in self._outbox):
            self._outbox = [r for r in self._outbox if r.group_id != group_id]
            self._outbox_at = {r.sequence_id: i for i, r in enumerate(self._outbox)}
        self._finished[group_id] = None
        if len(self._finished) > MAX_TOMBSTONES:
            del self._finished[next(iter(self._finished))]

    def reopen(self, group_id: str | None) -> None:
        """The group runs here again (a reused id): accept its records. ``observe`` does
        this itself; call it when a request of a finished group is added, so records
        that arrive before its first step are not ignored."""
        self._finished.pop(group_id, None)

    def _register(self, group_id: str | None, sid: str) -> None:
        self._seq_keys[sid] = next(self._next_key)
        self._appended[sid] = 0
        self._sequences.setdefault(group_id, []).append(sid)

    def _has_prompt(self, tree: Hashable) -> bool:
        t = self.trees.tree(tree)
        return t is not None and PROMPT_KEY in t

    def _queue(
        self, gid: str | None, sid: str, start: int, tokens: list[int], prompt: tuple[int, ...] | None
    ) -> None:
        """Outbox a record, merged into this response's earlier one if not yet taken."""
        at = self._outbox_at.get(sid)
        if at is not None and self._outbox[at].end == start:
            prev = self._outbox[at]
            self._outbox[at] = prev._replace(tokens=prev.tokens + tuple(tokens))
            return
        self._outbox_at[sid] = len(self._outbox)
        self._outbox.append(TokenAppend(gid, sid, start, tuple(tokens), prompt))


@dataclass(frozen=True)
class ReplicaSpec:
    """How a worker process builds its replica (picklable; ``None`` for ``ngram``,
    which keeps no trees)."""

    config: SpeculativeConfig

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> ReplicaSpec | None:
        return None if config is None or config.method == "ngram" else cls(config)

    def open(self) -> ReplicaProposer:
        return ReplicaProposer(self.config, grouped=self.config.method == "group_suffix")


@dataclass
class DraftServerStats:
    published_records: int = 0
    published_tokens: int = 0
    served_records: int = 0  # after merging a response's adjacent records
    served_tokens: int = 0  # output tokens
    served_prompt_tokens: int = 0
    seeded_groups: int = 0
    seed_tokens: int = 0  # history tokens published as seeds
    calls: int = 0  # updates_for calls


class DraftServer:
    """Per group, every record published, in publish order, tagged with its source; per
    group and instance, how far the instance has read. ``updates_for`` costs the number
    of records new to the instance (plus one lookup per group asked about).

    The log is the group's contents (its prompt, at most once per instance, and its
    responses' tokens); the server builds no trees, the replicas do."""

    def __init__(self) -> None:
        self.stats = DraftServerStats()
        self._logs: dict[str | None, list[tuple[int, TokenAppend]]] = {}
        self._cursors: dict[str | None, dict[int, int]] = {}  # group -> instance -> records read

    def publish(self, source: int, updates: Iterable[TokenAppend]) -> None:
        """Records from instance ``source``; publish a step's records before acting on its
        outputs, so no record of a group arrives after the group is finished."""
        stats = self.stats
        for rec in updates:
            log = self._logs.get(rec.group_id)
            if log is None:
                log = self._logs[rec.group_id] = []
            log.append((source, rec))
            stats.published_records += 1
            stats.published_tokens += len(rec.tokens)

    def seed(
        self, group_id: str | None, prompt_token_ids: Sequence[int], responses: Sequence[Sequence[int]]
    ) -> None:
        """History seeds for a group, served to every instance that runs it; call it
        before the group's first step anywhere, so the seed heads its log."""
        if not responses:
            return
        rec = HistorySeed(group_id, tuple(prompt_token_ids), tuple(tuple(r) for r in responses))
        self._logs.setdefault(group_id, []).append((SEED_SOURCE, rec))
        self.stats.seeded_groups += 1
        self.stats.seed_tokens += sum(len(r) for r in rec.responses)

    def updates_for(self, instance: int, group_ids: Iterable[str | None]) -> list[TokenAppend | HistorySeed]:
        """Records of these groups that other instances published since this instance last
        asked, each given once; a response's adjacent or overlapping records are merged."""
        stats = self.stats
        stats.calls += 1
        out: list[TokenAppend | HistorySeed] = []
        for gid in group_ids:
            log = self._logs.get(gid)
            if not log:
                continue
            cursors = self._cursors.setdefault(gid, {})
            read = cursors.get(instance, 0)
            if read == len(log):
                continue
            cursors[instance] = len(log)
            last: dict[str, int] = {}  # sequence id -> index in `out` of its latest record
            for source, rec in log[read:] if read else log:
                if source == instance:
                    continue
                if source == SEED_SOURCE:
                    out.append(rec)
                    continue
                at = last.get(rec.sequence_id)
                if at is not None and out[at].start <= rec.start <= out[at].end:
                    out[at] = _merged(out[at], rec)
                else:
                    last[rec.sequence_id] = len(out)
                    out.append(rec)
        stats.served_records += len(out)
        for rec in out:
            if type(rec) is HistorySeed:
                continue
            stats.served_tokens += len(rec.tokens)
            if rec.prompt_token_ids is not None:
                stats.served_prompt_tokens += len(rec.prompt_token_ids)
        return out

    def finish_group(self, group_id: str | None) -> None:
        """Every response of the group is done: drop its log and cursors."""
        self._logs.pop(group_id, None)
        self._cursors.pop(group_id, None)

    @property
    def num_groups(self) -> int:
        return len(self._logs)

    def num_records(self, group_id: str | None) -> int:
        """Records kept for a group (0 once finished)."""
        return len(self._logs.get(group_id, ()))


def _merged(a: TokenAppend, b: TokenAppend) -> TokenAppend:
    """``a`` then ``b`` (``b`` starts inside or right after ``a``), as one record."""
    extra = b.tokens[a.end - b.start :] if b.end > a.end else ()
    prompt = a.prompt_token_ids if a.prompt_token_ids is not None else b.prompt_token_ids
    return TokenAppend(a.group_id, a.sequence_id, a.start, a.tokens + extra, prompt)
