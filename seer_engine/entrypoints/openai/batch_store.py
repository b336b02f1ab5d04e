"""Batch objects on disk, and the plan that makes finalizing a batch atomic.

A batch's results are written in this order: a *plan* beside its record (the final
status, counts and usage, and the ids of its output and error files, chosen up
front); the files, each complete before it is listed (files.py); the record, now
pointing at the files; then the plan is removed. So the record only ever points at
complete files, and a server killed at any point leaves something a restart can
settle (``BatchManager.start``): a plan whose files all exist is applied (the batch
is finished without running again); a plan with a file missing has its files
removed and the batch is run again; no plan means no result file was written (or that
the plan was unreadable: the result files named after an unfinished batch are removed
before it runs again).

One server at a time keeps a data folder's files and batches (``BatchAPIClaim``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

from seer_engine.entrypoints.openai.files import atomic_write, read_record, remove_partial_writes

logger = logging.getLogger(__name__)

# For tests only: "<stage>:<path>" stops finalization at <stage> ("partial": the plan
# and the first result file are written; "files": every result file is written, the
# record not yet), creates <path>, and waits there until the process is killed. This
# lets a test SIGKILL a server at a known point of finalization instead of racing it.
TEST_PAUSE_ENV = "SEER_ENGINE_TEST_PAUSE_FINALIZING"
# What resuming, listing and serving a batch read from its record.
_BATCH_FIELDS = {
    "id": str, "status": str, "endpoint": str, "input_file_id": str,
    "created_at": int, "request_counts": dict,
}  # fmt: skip


async def pause_for_test(stage: str) -> None:
    spec = os.environ.get(TEST_PAUSE_ENV, "")
    wanted, _, marker = spec.partition(":")
    if wanted == stage:
        logger.warning("finalization paused at %r for a test (%s)", stage, TEST_PAUSE_ENV)
        Path(marker).touch()
        await asyncio.Event().wait()


class BatchAPIClaim:
    """This server's hold on the files and batches of a data folder, for as long as it runs.

    Servers on one host share the default ``--data-dir`` (and may share one for their
    history store). A second one that loaded the folder's batches would run the first
    one's unfinished batches again beside it (each then points the batch at its own
    output file) and remove its uploads in progress as leftovers; so only the server
    holding the claim serves the Batch and Files APIs, and ``refusal`` says why another
    does not. The lock goes with the process, so a restart after a kill takes it.
    """

    LOCK_FILE = ".batch_api.lock"

    def __init__(self, data_dir: Path) -> None:
        self.refusal: str | None = None
        path = data_dir / self.LOCK_FILE
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            self._lock: Any = open(path, "a+")  # noqa: SIM115 - held while serving
        except OSError as e:  # a directory in the way, no permission: a startup error naming it
            why = e.strerror or e
            raise ValueError(f"cannot open the lock file {str(path)!r} of --data-dir: {why}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            owner = self._lock.read().strip() or "?"
            self.release()
            self.refusal = (
                f"the files and batches in --data-dir {str(data_dir)!r} are served by another running "
                f"server (pid {owner}); start this server with a --data-dir of its own to use the "
                "Batch and Files APIs here"
            )
            return
        try:  # whose the claim is, for another server's refusal: not worth failing a start over
            os.ftruncate(self._lock.fileno(), 0)
            os.pwrite(self._lock.fileno(), f"{os.getpid()}\n".encode(), 0)  # unbuffered: none left to flush
        except OSError as e:  # a full disk
            logger.warning("could not write this server's pid into %s: %s", path, e)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class BatchStore:
    """Batch objects, one JSON file each, and the plans of batches being finalized."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(root)

    def save(self, batch: dict) -> None:
        atomic_write(self.root / f"{batch['id']}.json", json.dumps(batch).encode())

    def load_all(self) -> dict[str, dict]:
        out = {}
        for path in self.root.glob("batch_*.json"):
            batch = read_record(path, _BATCH_FIELDS)
            if batch is not None:
                out[batch["id"]] = batch
        return out

    # -- finalization plans ---------------------------------------------------------------

    def _plan_path(self, batch_id: str) -> Path:
        return self.root / f"{batch_id}.plan"

    def save_plan(self, batch_id: str, plan: dict) -> None:
        atomic_write(self._plan_path(batch_id), json.dumps(plan).encode())

    def load_plan(self, batch_id: str) -> dict | None:
        """The batch's plan, or None: none, or one that is unreadable or not a plan (a
        damaged disk, a foreign file), which leaves the batch to run again."""
        try:
            plan = json.loads(self._plan_path(batch_id).read_text())
        except FileNotFoundError:
            return None
        except (OSError, RecursionError, ValueError) as e:  # written atomically: a damaged disk
            logger.warning("ignoring unreadable finalization plan of %s: %s", batch_id, e)
            return None
        if not _is_plan(plan):
            logger.warning("ignoring the finalization plan of %s: not one this server wrote", batch_id)
            return None
        return plan

    def drop_plan(self, batch_id: str) -> None:
        self._plan_path(batch_id).unlink(missing_ok=True)


def _is_plan(plan: Any) -> bool:
    """Whether ``plan`` has the shape ``BatchManager._finalize`` writes."""
    return (
        isinstance(plan, dict)
        and isinstance(plan.get("status"), str)
        and isinstance(plan.get("fields"), dict)
        and isinstance(plan.get("files"), dict)
        and all(f is None or isinstance(f, str) for f in plan["files"].values())
    )


def plan_fields(plan: dict) -> dict[str, Any]:
    """The record fields a plan sets (besides the status): counts, usage, time, files."""
    files = {name: file_id for name, file_id in plan["files"].items() if file_id is not None}
    return {**plan["fields"], **files}
