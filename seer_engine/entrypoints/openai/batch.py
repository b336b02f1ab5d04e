"""The OpenAI Batch API: a JSONL file of requests in, output and error files out.

A batch goes validating -> in_progress -> finalizing -> completed (or failed when
its file is malformed; cancelling -> cancelled when cancelled; expired when its
completion window ends first: the lines done keep their results, the others get a
``batch_expired`` error, as OpenAI's do). All its lines are
submitted to the engine together, so a batch runs as one rollout: the scheduler
sees every request (and every group) at once.

Batch objects are saved under the data folder at every status change (and at most
once a second while lines finish), so a restart loses nothing accepted. A batch
that was validating or in progress when the server stopped is run again from its
first line on the next start (lines that had finished are computed again; seeded
requests give the same results). One that was finalizing is finished from its
finalization plan when all its result files were written, else run again
(batch_store.py); it is never reported with a missing or partial file. One that was
cancelling is marked cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Query

from seer_engine.engine.client import EngineDeadError
from seer_engine.entrypoints.openai.batch_input import (
    BatchLineError,
    BatchValidationError,
    parse_lines,
)
from seer_engine.entrypoints.openai.batch_store import BatchStore, pause_for_test, plan_fields
from seer_engine.entrypoints.openai.errors import APIError, as_api_error, error_body
from seer_engine.entrypoints.openai.files import FileStore, new_file_id, ordered_hex, page, storing
from seer_engine.entrypoints.openai.json_body import JSONRoute
from seer_engine.entrypoints.openai.protocol import ERROR_RESPONSES, BatchCreateRequest

logger = logging.getLogger(__name__)

# endpoint -> handler(body, request_id) returning the response body (raises APIError)
LineHandler = Callable[[dict, str], Awaitable[dict]]

TERMINAL = ("completed", "failed", "cancelled", "expired")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
RESULT_KINDS = ("output", "error")  # the result files a batch may get, in this order
PERSIST_INTERVAL_S = 1.0
_CANCELLED = {"code": "batch_cancelled", "message": "the batch was cancelled before this request finished"}
_EXPIRED = {
    "code": "batch_expired",
    "message": "the batch's completion window ended before this request finished",
}


class BatchManager:
    """Creates, runs, cancels and lists batches; one asyncio task per running batch."""

    def __init__(
        self, store: BatchStore, files: FileStore, handlers: dict[str, LineHandler], model: str
    ) -> None:
        self.store = store
        self.files = files
        self.handlers = handlers
        self.model = model
        self._batches = store.load_all()
        self._runs: dict[str, asyncio.Task] = {}
        self._lines: dict[str, list[asyncio.Task]] = {}
        self._saved_at: dict[str, float] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Resume what a previous server left unfinished (see the module docstring)."""
        for batch in self._batches.values():
            if self._settle_finalization(batch):
                continue
            if batch["status"] == "cancelling":
                self._update(batch, "cancelled", cancelled_at=int(time.time()))
            elif batch["status"] not in TERMINAL:
                logger.info("resuming batch %s (was %s)", batch["id"], batch["status"])
                batch["request_counts"] = {"total": 0, "completed": 0, "failed": 0}
                self._update(batch, "validating")
                self._launch(batch)

    def _settle_finalization(self, batch: dict) -> bool:
        """Apply or undo the finalization plan a killed server left; True when that
        finished the batch."""
        plan = self.store.load_plan(batch["id"])
        if plan is None:
            if batch["status"] not in TERMINAL:  # result files of a plan lost or unreadable
                names = {_result_filename(batch["id"], kind) for kind in RESULT_KINDS}
                for file_id in self.files.outputs_named(names):
                    logger.info("removing %s, a result file batch %s left unlisted", file_id, batch["id"])
                    self.files.discard(file_id)
            return False
        file_ids = [file_id for file_id in plan["files"].values() if file_id is not None]
        if batch["status"] not in TERMINAL and all(self.files.exists(f) for f in file_ids):
            logger.info("finishing batch %s from its finalization plan", batch["id"])
            if not self._update(batch, plan["status"], **plan_fields(plan)):
                return True  # finished in memory; the plan is kept for the next start
        elif batch["status"] not in TERMINAL:
            logger.info("batch %s was killed while writing its results: running it again", batch["id"])
            for file_id in file_ids:
                self.files.discard(file_id)
        self.store.drop_plan(batch["id"])
        return batch["status"] in TERMINAL

    async def stop(self) -> None:
        """Stop running batches without changing their status: the next start resumes them."""
        runs = list(self._runs.values())
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)

    # -- API -----------------------------------------------------------------------------------

    def create(self, req: BatchCreateRequest) -> dict:
        if req.endpoint not in self.handlers:
            raise APIError(
                400,
                f"endpoint must be one of {sorted(self.handlers)}, got {req.endpoint!r}",
                param="endpoint",
            )
        window = COMPLETION_WINDOWS.get(req.completion_window)
        if window is None:
            raise APIError(
                400,
                f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {req.completion_window!r}",
                param="completion_window",
            )
        meta = self.files.get(req.input_file_id, param="input_file_id")
        if meta["purpose"] != "batch":
            message = f"file {req.input_file_id!r} was not uploaded with purpose 'batch'"
            raise APIError(400, message, param="input_file_id")
        now = int(time.time())
        batch = {
            "id": f"batch_{ordered_hex()}",
            "object": "batch",
            "endpoint": req.endpoint,
            "model": self.model,
            "errors": None,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": None,
            "metadata": req.metadata,
        }
        self.store.save(batch)  # first: a batch that could not be saved (a full disk) is not listed
        self._batches[batch["id"]] = batch
        self._launch(batch)
        return batch

    def get(self, batch_id: str) -> dict:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found")
        return batch

    def reader_of(self, file_id: str) -> str | None:
        """The unfinished batch whose input file is ``file_id``, if any: a restart runs it
        again from that file, so the file must stay until the batch ends."""
        return next(
            (
                b["id"]
                for b in self._batches.values()
                if b["input_file_id"] == file_id and b["status"] not in TERMINAL
            ),
            None,
        )

    def list(self, after: str | None, limit: int) -> dict:
        items = sorted(self._batches.values(), key=lambda b: (b["created_at"], b["id"]), reverse=True)
        return page(items, after, limit)

    def cancel(self, batch_id: str) -> dict:
        batch = self.get(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] in (*TERMINAL, "finalizing"):  # finalizing: its results are being written
            raise APIError(
                409, f"cannot cancel a batch that is {batch['status']}", code="batch_not_cancellable"
            )
        self._set(batch, "cancelling", cancelling_at=int(time.time()))
        for task in self._lines.get(batch_id, []):
            task.cancel()  # closing a request's stream aborts it in the engine
        return batch

    # -- running -------------------------------------------------------------------------------

    def _launch(self, batch: dict) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._runs[batch["id"]] = task
        task.add_done_callback(lambda _: self._runs.pop(batch["id"], None))

    def _set(self, batch: dict, status: str, **fields: Any) -> None:
        """Save the batch with these fields, then take them: a save that fails (a full
        disk) leaves the batch as it was, not pointing at result files being undone."""
        updated = {**batch, "status": status, **fields}
        self.store.save(updated)
        batch.update(updated)
        self._saved_at[batch["id"]] = time.monotonic()

    def _update(self, batch: dict, status: str, **fields: Any) -> bool:
        """``_set``, or where the disk refuses the save (full), the change in memory alone:
        the batch still ends in a status; its record keeps the old one, which the next
        start settles again. Whether the save went through."""
        try:
            self._set(batch, status, **fields)
        except OSError as e:
            logger.error("could not save batch %s as %s: %s", batch["id"], status, e)
            batch.update(status=status, **fields)
            return False
        return True

    async def _run(self, batch: dict) -> None:
        try:
            await self._execute(batch)
        except asyncio.CancelledError:
            raise  # server shutdown: the status stays, the next start resumes
        except Exception as e:  # noqa: BLE001 - a batch must end in a status, never vanish
            logger.exception("batch %s failed", batch["id"])
            record = {"code": "internal_error", "message": str(e), "param": None, "line": None}
            self._update(batch, "failed", failed_at=int(time.time()), errors=_errors([record]))
        finally:
            self._lines.pop(batch["id"], None)
            self._saved_at.pop(batch["id"], None)

    async def _execute(self, batch: dict) -> None:
        try:
            if batch["endpoint"] not in self.handlers:  # a record another server (or version) wrote
                message = (
                    f"this server does not serve the batch's endpoint {batch['endpoint']!r}; "
                    f"it serves {sorted(self.handlers)}"
                )
                raise BatchValidationError(
                    [{"code": "unsupported_endpoint", "message": message, "param": "endpoint", "line": None}]
                )
            content = await asyncio.to_thread(self.files.read, batch["input_file_id"])
            lines = await asyncio.to_thread(parse_lines, content, batch["endpoint"])
        except (APIError, BatchLineError, BatchValidationError) as e:
            if isinstance(e, BatchValidationError):
                records = e.records
            elif isinstance(e, BatchLineError):
                records = [e.record]
            else:
                records = [
                    {
                        "code": "invalid_input_file",
                        "message": e.message,
                        "param": "input_file_id",
                        "line": None,
                    }
                ]
            if batch["status"] == "cancelling":  # cancelled while validating: as asked
                self._set(batch, "cancelled", cancelled_at=int(time.time()))
            else:
                self._set(batch, "failed", failed_at=int(time.time()), errors=_errors(records))
            return
        if batch["status"] == "cancelling":
            self._set(batch, "cancelled", cancelled_at=int(time.time()))
            return
        batch["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        left_s = batch["expires_at"] - time.time()
        if left_s <= 0:  # its window ended while no server ran it
            await self._finalize(batch, lines, [TimeoutError()] * len(lines), "expired")
            return
        started = batch["in_progress_at"] or int(time.time())  # a batch run again keeps its start
        self._set(batch, "in_progress", in_progress_at=started)
        handler = self.handlers[batch["endpoint"]]
        tasks = [asyncio.create_task(self._run_line(batch, handler, i, line)) for i, line in enumerate(lines)]
        self._lines[batch["id"]] = tasks
        gathered = asyncio.gather(*tasks, return_exceptions=True)
        expired = False
        try:
            results = await asyncio.wait_for(asyncio.shield(gathered), left_s)
        except asyncio.TimeoutError:  # the lines still running end; those done keep their results
            expired = True
            for t in tasks:
                t.cancel()
            results = await gathered
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        if any(isinstance(r, EngineDeadError) for r in results):
            logger.warning("the engine stopped under batch %s: the next start runs it again", batch["id"])
            return  # as for a server stopped under it: its status stays
        status = "cancelled" if batch["status"] == "cancelling" else "expired" if expired else "completed"
        if status == "completed":
            self._set(batch, "finalizing", finalizing_at=int(time.time()))
        await self._finalize(batch, lines, results, status)

    async def _finalize(self, batch: dict, lines: list[dict], results: list, status: str) -> None:
        """Write the result files and then the record that points at them, through a plan
        that a restart can apply or undo (batch_store.py)."""
        outputs, errors = [], []
        in_tokens = out_tokens = 0
        unfinished = _EXPIRED if status == "expired" else _CANCELLED
        for line, result in zip(lines, results):
            if isinstance(result, BaseException):
                errors.append(_record(line["custom_id"], None, None, unfinished))
                continue
            record, ok, usage = result
            (outputs if ok else errors).append(record)
            in_tokens += usage.get("prompt_tokens", 0)
            out_tokens += usage.get("completion_tokens", 0)
        by_kind = dict(zip(RESULT_KINDS, (outputs, errors)))
        plan = {
            "status": status,
            "fields": {
                f"{status}_at": int(time.time()),
                "usage": _usage(in_tokens, out_tokens),
                "request_counts": dict(batch["request_counts"]),
            },
            "files": {f"{kind}_file_id": new_file_id() if rows else None for kind, rows in by_kind.items()},
        }
        self.store.save_plan(batch["id"], plan)
        try:
            for kind, rows in by_kind.items():
                if rows:
                    content = await asyncio.to_thread(_jsonl, rows)
                    file_id, name = plan["files"][f"{kind}_file_id"], _result_filename(batch["id"], kind)
                    await self.files.create(content, name, "batch_output", file_id)
                    await pause_for_test("partial")
            await pause_for_test("files")
            self._set(batch, status, **plan_fields(plan))
        except Exception:
            self._undo_plan(batch["id"], plan)
            raise
        self.store.drop_plan(batch["id"])

    def _undo_plan(self, batch_id: str, plan: dict) -> None:
        """Remove what a failed finalization wrote (a full disk, say): the batch then fails
        with no result file, instead of leaving listed files no batch points at."""
        for file_id in plan["files"].values():
            if file_id is not None:
                try:
                    self.files.discard(file_id)
                except OSError as e:
                    logger.warning("could not remove result file %s of batch %s: %s", file_id, batch_id, e)
        try:
            self.store.drop_plan(batch_id)
        except OSError as e:
            logger.warning("could not remove the finalization plan of batch %s: %s", batch_id, e)

    async def _run_line(
        self, batch: dict, handler: LineHandler, index: int, line: dict
    ) -> tuple[dict, bool, dict]:
        request_id = line["body"].get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = f"{batch['id']}-{index}"
        try:
            body = await handler(line["body"], request_id)
            status, ok, usage = 200, True, body.get("usage") or {}
        except EngineDeadError:
            raise  # not the line's failure: the batch is left for the next start (see _execute)
        except Exception as e:  # noqa: BLE001 - one line's failure is that line's error record
            err = as_api_error(e)
            body = error_body(err.status, err.message, err.param, err.code)
            status, ok, usage = err.status, False, {}
        record = _record(line["custom_id"], status, request_id, None, body)
        counts = batch["request_counts"]
        counts["completed" if ok else "failed"] += 1
        if time.monotonic() - self._saved_at.get(batch["id"], 0.0) > PERSIST_INTERVAL_S:
            self._save_progress(batch)
        return record, ok, usage

    def _save_progress(self, batch: dict) -> None:
        """Save the counts so far; a failed save (a full disk) costs only the counts on disk,
        never the line's result, which the batch's result files hold."""
        self._saved_at[batch["id"]] = time.monotonic()
        try:
            self.store.save(batch)
        except OSError as e:
            logger.warning("could not save the progress of batch %s: %s", batch["id"], e)


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _record(
    custom_id: str, status: int | None, request_id: str | None, error: dict | None, body: dict | None = None
) -> dict:
    """One line of an output or error file."""
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def _result_filename(batch_id: str, kind: str) -> str:
    return f"{batch_id}_{kind}.jsonl"


def _errors(records: list[dict]) -> dict:
    return {"object": "list", "data": records}


def _usage(input_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def refusing_router(message: str) -> APIRouter:
    """The Batch and Files APIs of a server that does not hold its data folder's claim
    (``BatchAPIClaim``): every call is a 503 that says why."""
    router = APIRouter(tags=["batches"], responses=ERROR_RESPONSES, route_class=JSONRoute)

    async def refuse() -> None:
        raise APIError(503, message, code="batch_api_unavailable")

    for path in ("/v1/files", "/v1/files/{rest:path}", "/v1/batches", "/v1/batches/{rest:path}"):
        router.add_api_route(path, refuse, methods=["GET", "POST", "DELETE"])
    return router


def batches_router(manager: BatchManager) -> APIRouter:
    router = APIRouter(tags=["batches"], responses=ERROR_RESPONSES, route_class=JSONRoute)

    @router.post("/v1/batches")
    async def create_batch(req: BatchCreateRequest) -> dict:
        with storing("the batch"):
            return manager.create(req)

    @router.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict:
        return manager.list(after, limit)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> dict:
        return manager.get(batch_id)

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> dict:
        with storing("the batch"):
            return manager.cancel(batch_id)

    return router
