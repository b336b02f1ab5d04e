"""The OpenAI Files API, backed by a folder: uploads (batch inputs) and batch results.

Each file is ``<id>.data`` (the bytes) plus ``<id>.json`` (the file object), both
written to a temporary name and renamed into place, metadata last: a file either
exists whole after a crash or restart, or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse

from seer_engine.entrypoints.openai.errors import APIError
from seer_engine.entrypoints.openai.json_body import JSONRoute
from seer_engine.entrypoints.openai.protocol import ERROR_RESPONSES

logger = logging.getLogger(__name__)

UPLOAD_PURPOSES = ("batch",)
# What listing and serving read, of the types they read it as.
_FILE_FIELDS = {"id": str, "created_at": int, "filename": str, "purpose": str, "bytes": int}


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary sibling and rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def storing(what: str) -> Iterator[None]:
    """A disk error (full, read-only) while keeping ``what`` under the data folder, as a
    500 that names it, not an anonymous internal error."""
    try:
        yield
    except OSError as e:
        message = f"could not save {what} under --data-dir: {e.strerror or e}"
        raise APIError(500, message, code="storage_error") from None


def ordered_hex() -> str:
    """32 hex digits that sort in creation order (nanoseconds, then random bits), so ids
    of the same second list newest first, as OpenAI's lists do, after a restart too."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def new_file_id() -> str:
    return f"file-{ordered_hex()}"


_FILE_ID = re.compile(r"file-([0-9a-f]{16})[0-9a-f]{16}")


def minted_at(file_id: str) -> int | None:
    """The second ``new_file_id`` made ``file_id`` (a file's ``created_at``), or None
    for an id of another form."""
    match = _FILE_ID.fullmatch(file_id)
    return int(match.group(1), 16) // 10**9 if match else None


def _listing_key(meta: dict) -> tuple[int, str]:
    return meta["created_at"], meta["id"]


def remove_partial_writes(root: Path) -> None:
    """Remove the temporary files of writes that a killed process left unfinished."""
    for tmp in root.glob(".*"):
        if tmp.is_file():
            logger.info("removing %s, left by an interrupted write", tmp)
            tmp.unlink(missing_ok=True)


def read_record(path: Path, fields: dict[str, type]) -> dict | None:
    """The JSON object saved at ``path``, or None (with a warning) when it cannot be used:
    unreadable, not an object, or without one of ``fields`` of its type. One damaged or
    foreign record is skipped rather than keeping the server from starting, or (a
    ``created_at`` of another type) every listing from being sorted."""
    try:
        record = json.loads(path.read_text())
    except (OSError, RecursionError, ValueError) as e:  # RecursionError: nested too deep
        logger.warning("skipping unreadable record %s: %s", path, e)
        return None
    if not isinstance(record, dict):
        record = {}
    missing = [f for f, kind in fields.items() if not isinstance(record.get(f), kind)]
    if missing:
        why = f"not one this server wrote (missing or invalid: {missing})"
        logger.warning("skipping record %s: %s", path, why)
        return None
    return record


class FileStore:
    """Files on disk with their OpenAI file objects kept in memory for listing.

    At start, what interrupted writes left is removed: temporary files, and data whose
    file object was never written (the file was never listed, so nothing refers to it).
    A file whose object is there but unusable is skipped, and its bytes are left alone.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(root)
        self._files: dict[str, dict] = {}
        for meta_path in root.glob("file-*.json"):
            meta = read_record(meta_path, _FILE_FIELDS)
            if meta is not None and self.data_path(meta["id"]).is_file():
                self._files[meta["id"]] = meta
        for data in root.glob("file-*.data"):
            if not (root / f"{data.stem}.json").exists():  # a skipped record keeps its bytes
                logger.info("removing %s: its file object was never written", data)
                data.unlink(missing_ok=True)

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _save(self, file_id: str, copy_in, filename: str, purpose: str) -> dict:
        """Write the bytes with ``copy_in(fileobj)``, then the file object."""
        data = self.data_path(file_id)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{file_id}.")
        try:
            with os.fdopen(fd, "wb") as f:
                copy_in(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, data)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": data.stat().st_size,
            "created_at": minted_at(file_id) or int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        try:
            atomic_write(self.root / f"{file_id}.json", json.dumps(meta).encode())
        except BaseException:  # a full disk: no bytes are left that no file object names
            data.unlink(missing_ok=True)
            raise
        self._files[file_id] = meta
        return meta

    async def upload(self, source: IO[bytes], filename: str, purpose: str) -> dict:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400, f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}", param="purpose"
            )
        return await asyncio.to_thread(
            self._save, new_file_id(), lambda f: shutil.copyfileobj(source, f, 1 << 20), filename, purpose
        )

    async def create(self, content: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict:
        file_id = file_id or new_file_id()
        return await asyncio.to_thread(self._save, file_id, lambda f: f.write(content), filename, purpose)

    def exists(self, file_id: str) -> bool:
        """Whether the file is complete and listed."""
        return file_id in self._files

    def discard(self, file_id: str) -> None:
        """Remove whatever exists of a file, listed or not."""
        self._files.pop(file_id, None)
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)

    def outputs_named(self, filenames: set[str]) -> list[str]:
        """Ids of the files the server wrote (purpose batch_output) with one of these names."""
        files = self._files.values()
        return [m["id"] for m in files if m["purpose"] == "batch_output" and m["filename"] in filenames]

    def get(self, file_id: str, param: str = "file_id") -> dict:
        """The file's metadata; ``param``: the request field that named it (for the 404)."""
        meta = self._files.get(file_id)
        if meta is None:
            raise APIError(404, f"no file with id {file_id!r}", param=param, code="file_not_found")
        return meta

    def read(self, file_id: str) -> bytes:
        self.get(file_id)
        return self.data_path(file_id).read_bytes()

    def list(self, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        """A page of files. ``after`` is a place in the listing, found from the id alone
        when that file is gone: a client deleting the files it lists asks for the next
        page after one it deleted."""
        descending = order == "desc"
        items = sorted(self._files.values(), key=_listing_key, reverse=descending)
        if purpose is not None:
            items = [m for m in items if m["purpose"] == purpose]
        if after is not None:
            cursor = self._files.get(after) or {"created_at": minted_at(after), "id": after}
            if cursor["created_at"] is None:
                raise APIError(400, f"unknown cursor {after!r}: not a file id", param="after")
            place = _listing_key(cursor)
            items = [m for m in items if (_listing_key(m) < place if descending else _listing_key(m) > place)]
        return page(items, None, limit)

    def delete(self, file_id: str) -> dict:
        self.get(file_id)
        del self._files[file_id]
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}


def page(items: list[dict], after: str | None, limit: int) -> dict:
    """One page of an OpenAI cursor list (``after`` = the last id of the previous page)."""
    if after is not None:
        ids = [m["id"] for m in items]
        if after not in ids:
            raise APIError(400, f"unknown cursor {after!r}", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def files_router(store: FileStore, reader_of: Callable[[str], str | None] = lambda _: None) -> APIRouter:
    """The Files API; ``reader_of(file_id)`` names the unfinished batch that reads a file
    (a restart runs it again from that file, so deleting it is refused)."""
    router = APIRouter(tags=["files"], responses=ERROR_RESPONSES, route_class=JSONRoute)

    @router.post("/v1/files")
    async def upload_file(file: UploadFile = File(...), purpose: str = Form(...)) -> dict:  # noqa: B008
        with storing("the file"):
            return await store.upload(file.file, file.filename or "upload.jsonl", purpose)

    @router.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        order: Literal["asc", "desc"] = "desc",
    ) -> dict:
        return store.list(purpose, after, limit, order)

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> dict:
        return store.get(file_id)

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> FileResponse:
        meta = store.get(file_id)
        data = store.data_path(file_id)
        if not data.is_file():  # removed behind the server's back: say so, not an anonymous 500
            message = f"the content of file {file_id!r} is missing from --data-dir ({data})"
            raise APIError(500, message, code="storage_error")
        return FileResponse(data, media_type="application/jsonl", filename=meta["filename"])

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> dict:
        store.get(file_id)
        batch_id = reader_of(file_id)
        if batch_id is not None:
            raise APIError(
                409,
                f"file {file_id!r} is the input file of batch {batch_id!r}, which has not finished; "
                "cancel the batch or wait for it to end first",
                param="file_id",
                code="file_in_use",
            )
        return store.delete(file_id)

    return router
