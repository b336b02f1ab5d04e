"""What callers put on the engine thread's queue (async_engine.py)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

from seer_engine.engine.input_processor import CheckedRequest
from seer_engine.engine.streams import Sink


@dataclass
class Add:
    request_id: str
    checked: CheckedRequest
    stream: bool
    group_id: str | None
    sink: Sink
    future: concurrent.futures.Future
    priority: int = 0


@dataclass
class Call:
    """Run ``fn(future)`` on the engine thread; ``fn`` resolves the future itself. ``what``
    names a call that may take long (a weight update), for the shutdown's log."""

    fn: Callable[[concurrent.futures.Future], None]
    future: concurrent.futures.Future
    what: str | None = None


STOP = object()
