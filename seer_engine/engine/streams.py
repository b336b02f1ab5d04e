"""Handing outputs from the engine thread to callers on asyncio loops.

Each request's outputs go to a ``Sink`` (an asyncio queue on the caller's loop),
read through a ``RequestStream``; results of control calls travel in
``concurrent.futures.Future``s. Everything here is safe to call from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from seer_engine.outputs import RequestOutput


class Outputs(asyncio.Queue):
    """A request's outputs not read yet. A streaming request's progress output holds every
    sample's output so far, so one still unread is replaced by the next: a client that
    reads slowly (or not at all) leaves one output waiting, not one per step (each as long
    as the output so far: memory quadratic in the output length)."""

    def _put(self, item: RequestOutput | BaseException) -> None:
        last = self._queue[-1] if self._queue else None  # type: ignore[attr-defined]
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._queue[-1] = item  # type: ignore[attr-defined]
        else:
            self._queue.append(item)  # type: ignore[attr-defined]


class Sink:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = Outputs()


def deliver(items: list[tuple[Sink, RequestOutput | BaseException]]) -> None:
    """Hand outputs to their loops, one wake-up per loop and batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, Any]]] = {}
    for sink, item in items:
        by_loop.setdefault(sink.loop, []).append((sink, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is waiting any more


def _put_all(batch: list[tuple[Sink, Any]]) -> None:
    for sink, item in batch:
        sink.queue.put_nowait(item)


def resolve(fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class RequestStream:
    """The outputs of one request, as an async iterator.

    Ends after the finished output. Closing it, dropping it, or cancelling a read
    before the end aborts the request, so a caller that goes away never leaves work
    behind in the engine.
    """

    def __init__(self, request_id: str, sink: Sink, on_abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._sink = sink
        self._on_abandon = on_abandon
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._sink.queue.get()
        except asyncio.CancelledError:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        self._abandon()

    def _abandon(self) -> None:
        if not self._finished:
            self._finished = True
            self._on_abandon(self.request_id)

    def __del__(self) -> None:
        self._abandon()


class TokenRate:
    """Generated tokens per second over a sliding window, readable from any thread."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self._points: collections.deque[tuple[float, int]] = collections.deque(maxlen=8192)
        self._lock = threading.Lock()

    def record(self, total_tokens: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._points.append((now, total_tokens))
            while self._points and self._points[0][0] < now - 2 * self.window_s:
                self._points.popleft()

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [p for p in self._points if p[0] >= now - self.window_s]
        if len(recent) < 2:
            return 0.0
        (t0, g0), (_, g1) = recent[0], recent[-1]
        return (g1 - g0) / max(now - t0, 1e-6)
