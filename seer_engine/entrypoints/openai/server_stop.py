"""How ``seer_engine serve`` stops: the drain after a stop signal, a second signal that
skips it, and the wait for the engine's own shutdown.

A stop signal lets the requests in flight finish for ``--drain-timeout`` seconds; then
the engine stops, which ends each one still running with a 503 ``engine_dead`` (in-band
on a stream). A second stop signal, SIGINT or SIGTERM, ends them that way at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from typing import Any

import uvicorn

from seer_engine.engine.client import EngineClient

logger = logging.getLogger("seer_engine.serve")

DEFAULT_DRAIN_S = 5.0
FORCED_END_S = 5.0  # after a forced exit, how long the handlers have to send the engine's error
UVICORN_MARGIN_S = 10  # uvicorn's own graceful period outlasts the drain: the engine ends what is left first


class StoppingServer(uvicorn.Server):
    """uvicorn, with what is still running at the end of the drain ended by the engine.

    uvicorn itself cancels the requests left when its graceful period ends: a plain-text
    500 and a stream cut off mid-message, with a traceback in the log. Here the engine
    stops ``drain_s`` after the signal, before that period ends, so their handlers send a
    clear error in time (and the Batch API leaves its batches to the next start).
    """

    def __init__(
        self, config: uvicorn.Config, engine: EngineClient, drain_s: float = DEFAULT_DRAIN_S
    ) -> None:
        super().__init__(config)
        self._engine = engine
        self._stop_engine = threading.Timer(drain_s, engine.stop)
        self._stop_engine.daemon = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        """A second stop signal of either kind skips the drain (uvicorn alone forces its
        exit on a second SIGINT only, so a supervisor's second SIGTERM would wait it out)."""
        if not self.should_exit:
            self._stop_engine.start()
        elif not self.force_exit:
            logger.warning("a second stop signal: not waiting for the requests still running")
            self.force_exit = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """A forced exit skips the drain and the lifespan's end, and the requests still
        running would be cancelled mid-response: the engine stops at once instead, their
        handlers send its error, then the app shuts down (the engine's own shutdown, which
        saves the history store, is waited for after)."""
        await super().shutdown(sockets)
        if self.force_exit:
            self._engine.stop()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._handlers_done(), FORCED_END_S)
            await self.lifespan.shutdown()

    async def _handlers_done(self) -> None:
        while self.server_state.tasks:
            await asyncio.sleep(0.05)


def shutdown_engine(engine: EngineClient) -> None:
    """Wait for the engine's shutdown, which saves the history store and stops the
    instances and has no fixed end (a large store on a slow disk, a weight update still
    running), logging what it waits for. Another stop signal meanwhile ends the process
    at once, with a warning naming what is lost: an operator who asks twice, or a grace
    period's end, is not held up, and SIGKILL would lose the same without a word. The
    shutdown runs on a thread of its own: a signal that interrupts ``Thread.join`` can
    leave the joined thread marked as stopped while it still runs."""
    done = threading.Event()

    def stop() -> None:
        try:
            engine.shutdown()
        finally:
            done.set()

    threading.Thread(target=stop, name="seer-shutdown", daemon=True).start()
    try:
        done.wait()
    except (KeyboardInterrupt, SystemExit):
        status = engine.shutdown_status()
        logger.warning("stop signal during the engine's shutdown: exiting before it is done (%s)", status)
        raise
