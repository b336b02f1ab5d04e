"""Operating-system plumbing of the local KV pool: POSIX shared-memory segments that
outlive the process attaching them, room in ``/dev/shm``, and whether a writer still runs."""

from __future__ import annotations

import errno
import os
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux


def check_shm_room(size: int) -> None:
    """Refuse a pool larger than the free space of ``SHM_DIR``. Segments are sparse, so
    creating one always succeeds; the page a put then cannot get kills the writing
    process with SIGBUS (Docker's default ``/dev/shm`` is 64 MiB)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return  # not Linux, or no such mount: nothing to check against
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ValueError(
            f"a local KV pool of {size} bytes does not fit in {SHM_DIR} ({free} bytes free): its "
            f"writes would crash with SIGBUS; lower --kv-pool-gib or enlarge {SHM_DIR} "
            "(docker run --shm-size)"
        )


def reserve(shm: SharedMemory, slots: list[int], slot_bytes: int) -> bool:
    """Allocate the pages of ``slots`` (of ``slot_bytes`` each) in ``shm`` now; False where
    ``SHM_DIR`` has no room for them. The room checked when the pool was made may since have
    gone to others, and a copy into a page that cannot be had is SIGBUS, not an error.
    True where the system cannot tell (no ``posix_fallocate``, a file system without it)."""
    fd = getattr(shm, "_fd", -1)
    if fd < 0 or not hasattr(os, "posix_fallocate"):
        return True
    slots = sorted(slots)
    start = 0
    for i in range(1, len(slots) + 1):  # one call per run of adjacent slots
        if i < len(slots) and slots[i] == slots[i - 1] + 1:
            continue
        try:
            os.posix_fallocate(fd, slots[start] * slot_bytes, (i - start) * slot_bytes)
        except OSError as e:
            return e.errno not in (errno.ENOSPC, errno.ENOMEM)  # other errors: it cannot tell
        start = i
    return True


def lock_file_for(segment: str, fallback: str) -> str:
    """The file to ``flock`` for a pool: its ``segment``'s own file where shared memory has a
    path, which goes with the segment (a killed owner's resource tracker unlinks it; a
    separate lock file would be left behind), else ``fallback``, created here."""
    path = os.path.join(SHM_DIR, segment)
    if os.path.exists(path):
        return path
    os.close(os.open(fallback, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return fallback


TRACKER_LOCK = threading.Lock()  # held while segments are made or attached: the tracker is patched meanwhile


def _skip_register(name: str, rtype: str) -> None:
    return None


def attach(name: str) -> SharedMemory:
    """Attach to an existing segment without handing it to this process's resource tracker.

    Python < 3.13 registers every attached segment with the resource tracker, which
    unlinks it when the process exits: a worker that exits would destroy the pool under
    everyone else. Unregistering afterwards is no cure: a spawned child shares its
    parent's tracker and would drop the owner's registration too. So registration is
    skipped for the duration of the attach.
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    with TRACKER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = _skip_register
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A killed process that nobody has reaped yet (a zombie)
    still answers ``kill(pid, 0)``, but it will never finish a put: it counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False  # reaped since the kill above
    except (OSError, IndexError):
        return True  # no /proc here: trust kill()
    return state not in ("Z", "X")
