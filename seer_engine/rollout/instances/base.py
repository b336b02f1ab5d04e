"""How the dispatcher talks to one engine instance, wherever it runs.

Every backend offers the same calls: ``submit`` a chunk, ``start_step`` and later
``poll_reply`` (never blocking), ``abort`` chunks, ``call`` a serving primitive on the
engine, ``close``. In this process (``local``) a step runs when its reply is polled;
in a process (``process``) or a Ray actor (``ray``) it runs while the dispatcher
waits on several instances at once (``wait_any``). A lost instance raises
``InstanceDied``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from seer_engine.outputs import RequestOutput
from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.types import ChunkRequest, InstanceInfo, StepReply

# Serving calls that load weights take as long as the checkpoint does, not a step: they
# answer within ``load_timeout_s``.
LOADING_CALLS = frozenset({"update_weights", "wake_up"})


class InstanceHandle:
    backend = "abstract"

    def __init__(self, index: int) -> None:
        self.index = index
        self.alive = True
        self.stepping = False  # a step was started and its reply not yet polled
        self.info: InstanceInfo | None = None  # known once the instance is ready
        self.books: InstanceBooks | None = None  # the dispatcher's books, made by the pool
        # A remote step, abort or serving call not answered in this long (a call that
        # loads weights: ``load_timeout_s``) is taken as hung: the instance is killed and
        # lost (None: wait forever). Set by the pool.
        self.reply_timeout_s: float | None = None
        self.load_timeout_s: float | None = None

    def timeout_s(self, method: str | None = None) -> float | None:
        """How long a step or abort (``method`` None) or a serving call may go unanswered."""
        return self.load_timeout_s if method in LOADING_CALLS else self.reply_timeout_s

    def reply_deadline(self, method: str | None = None) -> float | None:
        """By when (``time.monotonic``) a remote call sent now must answer (None: never)."""
        timeout = self.timeout_s(method)
        return None if timeout is None else time.monotonic() + timeout

    def submit(self, chunk: ChunkRequest) -> None:
        raise NotImplementedError

    def start_step(self, draft_updates: list | None = None, finished_groups: list[str] | None = None) -> None:
        """Begin one step. ``draft_updates``: siblings' new tokens from the draft server;
        ``finished_groups``: groups whose drafts can go."""
        raise NotImplementedError

    def poll_reply(self) -> StepReply | None:
        """The started step's reply if it is there (never blocks on a remote step); raises
        ``InstanceDied`` once the step has gone ``reply_timeout_s`` without one."""
        raise NotImplementedError

    @staticmethod
    def wait_any(handles: Sequence[InstanceHandle], timeout: float) -> None:
        """Block until one of ``handles`` (all stepping, all of this class) may have a reply."""

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop chunks; their outputs so far. The books take the engine's stats after it."""
        raise NotImplementedError

    def call(self, method: str, *args: Any) -> Any:
        """A serving primitive on the engine (sleep, wake_up, update_weights, ...)."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the instance (its process, if it has one)."""

    def poll_alive(self) -> bool:
        """Is the instance still there, as far as can be seen without waiting? (A process
        that died while idle is noticed here, before a chunk is sent to it.)"""
        return self.alive
