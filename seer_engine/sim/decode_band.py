"""Decoding rows of a modeled instance that gain alike each step.

Rows whose drafts weigh alike in the draft budget (one band per draft priority) gain
the same tokens per step between two events, so one counter, ``progress``, stands for
all of them: a row has written ``generated + progress - progress_start`` and its chunk
ends when ``progress`` reaches its ``progress_end``.
"""

from __future__ import annotations

import heapq

from seer_engine.sim.requests import SimRequest

EPS = 1e-9  # progress closer than this counts as reached


class DecodeBand:
    def __init__(self) -> None:
        self.progress = 0.0
        self.rows: dict[str, SimRequest] = {}
        self._ends: list[tuple[float, int, str]] = []  # (progress_end, order, request id), lazily pruned
        self._context_base = 0.0  # sum of (context - progress_start) over the rows
        self._start_sum = 0.0  # sum of progress_start over the rows

    def __len__(self) -> int:
        return len(self.rows)

    def start(self, req: SimRequest) -> None:
        req.progress_start = self.progress
        self.rows[req.request_id] = req
        self._context_base += req.context - self.progress
        self._start_sum += self.progress
        heapq.heappush(self._ends, (self._progress_end(req), req.arrival_order, req.request_id))

    def stop(self, rid: str) -> SimRequest:
        """Take a row out, its output tokens brought up to date."""
        req = self.rows.pop(rid)
        self._context_base -= req.context - req.progress_start
        self._start_sum -= req.progress_start
        req.generated = min(req.end, self.written(req))
        return req

    def written(self, req: SimRequest) -> float:
        """A row's output tokens now."""
        return req.generated + self.progress - req.progress_start

    def context(self) -> float:
        """The rows' context tokens, all together."""
        return self._context_base + len(self.rows) * self.progress

    def chunk_tokens(self) -> float:
        """Tokens the rows have written since they started decoding here, all together."""
        return len(self.rows) * self.progress - self._start_sum

    def first_end(self) -> float:
        """The ``progress`` at which the first row's chunk ends (inf: no rows)."""
        while self._ends and not self._is_current(self._ends[0]):
            heapq.heappop(self._ends)
        return self._ends[0][0] if self._ends else float("inf")

    def growth(self, gain: float) -> float:
        """Tokens the rows write in a step (or steps) of ``gain`` each: none past its chunk's
        end (a speculative step may accept more than a row has left; the engine neither
        holds KV for those tokens nor counts them as generated or accepted)."""
        if self.first_end() - self.progress >= gain - EPS:
            return len(self.rows) * gain
        return sum(min(gain, self._progress_end(req) - self.progress) for req in self.rows.values())

    def accepted(self, steps: int, gain: float) -> float:
        """Draft tokens the rows accept in ``steps`` steps of ``gain`` each: what each writes
        beyond one token a step, up to its chunk's end. A last step cut short by the end
        accepts none, rather than taking back what earlier steps accepted (the count only
        grows, as an engine's does)."""
        if self.first_end() - self.progress >= steps * gain - EPS:
            return len(self.rows) * steps * (gain - 1)
        left = (self._progress_end(req) - self.progress for req in self.rows.values())
        return sum(max(0.0, min(steps * gain, n) - steps) for n in left)

    def advance(self, tokens: float) -> None:
        """Every row gains ``tokens``."""
        self.progress += tokens

    def take_ended(self) -> list[SimRequest]:
        """The rows whose chunks have ended, taken out."""
        ended = []
        while self._ends and self._ends[0][0] <= self.progress + EPS:
            entry = heapq.heappop(self._ends)
            if self._is_current(entry):
                ended.append(self.stop(entry[2]))
        return ended

    def _progress_end(self, req: SimRequest) -> float:
        return req.progress_start + (req.end - req.generated)

    def _is_current(self, entry: tuple[float, int, str]) -> bool:
        """Entries of rows that stopped (or stopped and restarted) stay in the heap until seen."""
        req = self.rows.get(entry[2])
        return req is not None and abs(self._progress_end(req) - entry[0]) < EPS
