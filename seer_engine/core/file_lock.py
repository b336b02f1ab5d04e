"""An exclusive ``flock`` that gives up: a process stopped (SIGSTOP, a debugger) while
holding a lock that processes share must not hold up the others for good."""

from __future__ import annotations

import fcntl
import time


def flock_within(fd: int, timeout_s: float, max_pause_s: float) -> bool:
    """Take ``fd``'s exclusive ``flock``, polling with pauses that double from 50 µs up to
    ``max_pause_s``; False once ``timeout_s`` has passed without it (0: one try)."""
    deadline = time.monotonic() + timeout_s
    pause = 5e-5
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, max_pause_s)
