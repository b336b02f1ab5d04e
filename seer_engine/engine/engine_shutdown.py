"""Waiting for the engine thread to finish shutting down.

The thread's last act is its backend's close: the rollout backend saves the history store
there and stops its instances. A process that exits first cuts that daemon thread off and
loses what it had not saved yet, so the wait has no fixed end. It says every
``LOG_EVERY_S`` what the thread is still doing, and what exiting now would lose, so an
operator (or a grace period about to send SIGKILL) knows what a harder stop costs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

LOG_EVERY_S = 10.0


def join_engine_thread(thread: threading.Thread, status: Callable[[], str], timeout: float | None) -> bool:
    """Join ``thread``, logging ``status()`` every ``LOG_EVERY_S``; with a ``timeout``, give
    up after it with a warning that says what is left behind. Returns whether it ended."""
    start = time.monotonic()
    while True:
        wait = LOG_EVERY_S if timeout is None else min(LOG_EVERY_S, timeout - (time.monotonic() - start))
        thread.join(max(wait, 0.0))
        if not thread.is_alive():
            return True
        if timeout is not None and time.monotonic() - start >= timeout:
            logger.warning("not waiting longer for the engine thread to shut down: %s", status())
            return False
        logger.warning("waiting for the engine thread to finish shutting down: %s", status())


def describe(doing: str, since: float | None, lost: Callable[[], str | None] | None) -> str:
    """One line for the log: what the thread does, since when, what an exit now loses."""
    waited = time.monotonic() - since if since is not None else 0.0
    what = lost() if lost is not None else None
    loses = f"an exit now loses {what}" if what else "an exit now loses nothing that is saved"
    return f"{doing}, {waited:.0f} s so far; {loses}"
