"""Batch finalization is atomic: a server stopped at any point of writing a batch's
results comes back with the batch finished from its plan or run again, never with a
missing, partial or orphaned result file.

The stop points are reached deterministically through the test-only pause
(``SEER_ENGINE_TEST_PAUSE_FINALIZING``): finalization stops there and waits, so the
"kill" never races the writes. The unit tests stop the manager at the pause (nothing
runs after it, as after a kill); the server test SIGKILLs a real server there.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from seer_engine.entrypoints.openai import batch as batch_module
from seer_engine.entrypoints.openai import files as files_module
from seer_engine.entrypoints.openai.batch import TERMINAL, BatchManager
from seer_engine.entrypoints.openai.batch_store import TEST_PAUSE_ENV, BatchAPIClaim, BatchStore
from seer_engine.entrypoints.openai.errors import APIError
from seer_engine.entrypoints.openai.files import FileStore
from seer_engine.entrypoints.openai.protocol import BatchCreateRequest

pytest_plugins = ["server_harness"]

ENDPOINT = "/v1/completions"


def _lines(n: int, bad: int) -> bytes:
    """n lines, of which the first ``bad`` fail (an error record each)."""
    rows = [
        {"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT, "body": {"prompt": f"q{i}", "bad": i < bad}}
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


async def _answer(body: dict, request_id: str) -> dict:
    if body.get("bad"):
        raise APIError(400, "refused", param="prompt")
    return {"id": request_id, "text": body["prompt"], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}


def _manager(root: Path) -> BatchManager:
    """A manager over the folders of ``root``: a new one is what a restarted server builds."""
    return BatchManager(BatchStore(root / "batches"), FileStore(root / "files"), {ENDPOINT: _answer}, "m")


async def _wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _submit(manager: BatchManager, content: bytes) -> str:
    input_id = (await manager.files.create(content, "in.jsonl", "batch"))["id"]
    req = BatchCreateRequest(input_file_id=input_id, endpoint=ENDPOINT)
    return manager.create(req)["id"]


def _stop_at(root: Path, stage: str, monkeypatch, content: bytes) -> tuple[str, dict]:
    """Run a batch until finalization pauses at ``stage``, then stop the manager there.

    Returns the batch id and its finalization plan as it is on disk.
    """
    marker = root / f"paused-{stage}"
    monkeypatch.setenv(TEST_PAUSE_ENV, f"{stage}:{marker}")

    async def run() -> str:
        manager = _manager(root)
        manager.start()
        batch_id = await _submit(manager, content)
        await _wait_for(marker.exists, f"finalization to pause at {stage}")
        await manager.stop()  # nothing after the pause runs: the state a kill leaves
        return batch_id

    batch_id = asyncio.run(run())
    monkeypatch.delenv(TEST_PAUSE_ENV)
    plan = BatchStore(root / "batches").load_plan(batch_id)
    assert plan is not None
    return batch_id, plan


def _restart(root: Path, batch_id: str) -> tuple[dict, FileStore]:
    """Start a new manager on the same folders and wait for the batch to finish."""

    async def run() -> dict:
        manager = _manager(root)
        manager.start()
        await _wait_for(lambda: manager.get(batch_id)["status"] == "completed", "the batch to complete")
        await manager.stop()
        return manager.get(batch_id)

    batch = asyncio.run(run())
    return batch, FileStore(root / "files")


def _records(files: FileStore, file_id: str) -> dict[str, dict]:
    return {r["custom_id"]: r for r in map(json.loads, files.read(file_id).decode().splitlines())}


def _on_disk(root: Path) -> set[str]:
    return {p.name for p in (root / "files").iterdir()} | {p.name for p in (root / "batches").iterdir()}


def test_a_batch_killed_with_every_file_written_is_finished_from_its_plan(tmp_path, monkeypatch):
    batch_id, plan = _stop_at(tmp_path, "files", monkeypatch, _lines(5, bad=2))
    store = BatchStore(tmp_path / "batches")
    assert store.load_all()[batch_id]["status"] == "finalizing"
    assert store.load_all()[batch_id]["output_file_id"] is None  # the record never points ahead

    batch, files = _restart(tmp_path, batch_id)
    assert batch["output_file_id"] == plan["files"]["output_file_id"]  # finished, not run again
    assert batch["error_file_id"] == plan["files"]["error_file_id"]
    assert batch["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert batch["usage"]["input_tokens"] == 6 and batch["completed_at"] == plan["fields"]["completed_at"]
    assert set(_records(files, batch["output_file_id"])) == {"c2", "c3", "c4"}
    assert set(_records(files, batch["error_file_id"])) == {"c0", "c1"}
    assert store.load_plan(batch_id) is None
    assert not any(name.startswith(".") or name.endswith(".plan") for name in _on_disk(tmp_path))


def test_a_batch_killed_between_its_files_is_run_again_without_orphans(tmp_path, monkeypatch):
    batch_id, plan = _stop_at(tmp_path, "partial", monkeypatch, _lines(5, bad=2))
    written, missing = plan["files"]["output_file_id"], plan["files"]["error_file_id"]
    assert FileStore(tmp_path / "files").exists(written) and not FileStore(tmp_path / "files").exists(missing)

    batch, files = _restart(tmp_path, batch_id)
    assert batch["output_file_id"] not in (None, written) and batch["error_file_id"] not in (None, missing)
    assert not files.exists(written)  # the half set of results is gone
    assert {m["id"] for m in files.list(None, None, 100, "asc")["data"]} == {
        batch["input_file_id"],
        batch["output_file_id"],
        batch["error_file_id"],
    }
    assert set(_records(files, batch["output_file_id"])) == {"c2", "c3", "c4"}
    assert set(_records(files, batch["error_file_id"])) == {"c0", "c1"}
    assert batch["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert not any(name.endswith(".plan") for name in _on_disk(tmp_path))


def test_leftovers_of_interrupted_writes_are_removed_at_start(tmp_path):
    files = FileStore(tmp_path / "files")
    kept = asyncio.run(files.create(b"{}\n", "kept.jsonl", "batch"))["id"]
    (tmp_path / "files" / f".{kept}.tmp123").write_bytes(b"half a file")  # killed mid-write
    (tmp_path / "files" / "file-deadbeef.data").write_bytes(b"{}\n")  # its file object never written
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / ".batch_x.json.tmp9").write_bytes(b"{")
    files = FileStore(tmp_path / "files")
    BatchStore(tmp_path / "batches")
    assert _on_disk(tmp_path) == {f"{kept}.data", f"{kept}.json"}
    assert files.read(kept) == b"{}\n"


def test_a_stale_plan_beside_a_finished_batch_is_dropped(tmp_path):
    async def run() -> str:
        manager = _manager(tmp_path)
        manager.start()
        batch_id = await _submit(manager, _lines(2, bad=0))
        await _wait_for(lambda: manager.get(batch_id)["status"] == "completed", "the batch")
        await manager.stop()
        return batch_id

    batch_id = asyncio.run(run())
    store = BatchStore(tmp_path / "batches")
    done = store.load_all()[batch_id]
    store.save_plan(batch_id, {"status": "completed", "fields": {}, "files": {"output_file_id": "file-x"}})
    batch, _ = _restart(tmp_path, batch_id)  # killed after the record, before dropping the plan
    assert batch == done and store.load_plan(batch_id) is None


# ------------------------------------------------------------------- a real server


@pytest.fixture
def batch_server(server_models, tmp_path):
    from server_harness import MODEL_NAME, ServerProcess

    args = [
        "--model", str(server_models[0]), "--served-model-name", MODEL_NAME,
        "--data-dir", str(tmp_path / "data"), "--max-model-len", "128", "--num-kv-blocks", "128",
        "--num-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    proc = ServerProcess(args, tmp_path / "server.log")
    yield proc
    proc.stop()


@pytest.mark.parametrize("stage", ["partial", "files"])
def test_server_killed_while_finalizing_reports_each_batch_whole(batch_server, tmp_path, stage):
    """SIGKILL a real server paused in finalization; after a restart the batch is
    completed with complete files (from the plan, or run again), and nothing is orphaned."""
    marker = tmp_path / "paused"
    batch_server.env = {TEST_PAUSE_ENV: f"{stage}:{marker}"}
    batch_server.start()
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT,
         "body": {"prompt": f"Question {i}:", "max_tokens": 4, "seed": i, "n": 0 if i == 0 else 1}}
        for i in range(6)
    ]  # fmt: skip
    with batch_server.openai() as client:
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        input_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
        batch_id = client.batches.create(
            input_file_id=input_id, endpoint=ENDPOINT, completion_window="24h"
        ).id
    batch_server.wait_until(marker.exists, timeout=60, what=f"finalization to pause at {stage}")
    batch_server.kill()
    data = tmp_path / "data"
    plan = BatchStore(data / "batches").load_plan(batch_id)
    assert plan is not None and json.loads((data / "batches" / f"{batch_id}.json").read_text())["status"] == (
        "finalizing"
    )

    batch_server.env = {}
    batch_server.start()
    with batch_server.openai() as client:
        batch = batch_server.wait_until(
            lambda: (b := client.batches.retrieve(batch_id)).status == "completed" and b,
            timeout=60,
            what="the batch to complete after the restart",
        )
        assert batch.request_counts.total == 6 and batch.request_counts.completed == 5
        outputs = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        listed = {f.id for f in client.files.list()}
    assert sorted(r["custom_id"] for r in outputs) == [f"c{i}" for i in range(1, 6)]
    assert all(r["response"]["status_code"] == 200 for r in outputs)
    assert [r["custom_id"] for r in errors] == ["c0"]
    assert listed == {input_id, batch.output_file_id, batch.error_file_id}
    finished_from_plan = batch.output_file_id == plan["files"]["output_file_id"]
    assert finished_from_plan == (stage == "files")
    on_disk = {p.name for p in (data / "files").iterdir()}
    assert on_disk == {f"{f}.{ext}" for f in listed for ext in ("data", "json")}
    assert not (data / "batches" / f"{batch_id}.plan").exists()


@pytest.mark.parametrize(
    "damaged",
    [
        "null",
        "[]",
        '"text"',
        "{}",
        '{"id": 5, "status": "in_progress"}',
        pytest.param("[" * 100_000, id="deep"),
    ],
)
def test_a_record_that_is_json_but_not_a_record_is_skipped_at_start(tmp_path, damaged):
    """A batch or file record that parses but is not one this server wrote (damaged, or of
    another version) used to stop the server from starting (a TypeError or KeyError); it is
    skipped with a warning, and the other batches and files come back and run. The skipped
    file's bytes stay on disk: they used to be removed as if its record had never been written."""
    batch_id, _ = _stop_at(tmp_path, "files", pytest.MonkeyPatch(), _lines(2, bad=0))
    (tmp_path / "batches" / "batch_damaged.json").write_text(damaged)
    (tmp_path / "files" / "file-damaged.json").write_text(damaged)
    (tmp_path / "files" / "file-damaged.data").write_bytes(b"{}\n")
    batch, files = _restart(tmp_path, batch_id)
    assert batch["request_counts"]["completed"] == 2 and files.exists(batch["output_file_id"])
    listed = {f["id"] for f in files.list(None, None, 100, "asc")["data"]}
    assert listed == {batch["input_file_id"], batch["output_file_id"]}
    assert (tmp_path / "files" / "file-damaged.data").read_bytes() == b"{}\n"


@pytest.mark.parametrize("content", [_lines(2, 0), b"not json\n"], ids=["good", "malformed"])
def test_a_batch_cancelled_while_validating_ends_cancelled(tmp_path, content):
    """Cancelled before its file is read (the run has not started), a batch ends cancelled,
    with a malformed file too (not failed: the cancel came first), and runs no line."""

    async def run() -> dict:
        manager = _manager(tmp_path)
        batch_id = await _submit(manager, content)
        assert manager.cancel(batch_id)["status"] == "cancelling"
        await _wait_for(lambda: manager.get(batch_id)["status"] in TERMINAL, "the batch to end")
        return manager.get(batch_id)

    batch = asyncio.run(run())
    assert batch["status"] == "cancelled" and batch["cancelled_at"] and batch["failed_at"] is None
    assert batch["request_counts"]["completed"] == 0 and batch["output_file_id"] is None


def test_a_finished_batch_leaves_no_running_state(tmp_path):
    """What a batch needs only while it runs (its task, its lines' tasks, when its record
    was last saved) goes when it ends: a trainer's server runs a batch per iteration for
    days. The time of the last save was kept for every batch that ever ran."""

    async def run() -> BatchManager:
        manager = _manager(tmp_path)
        manager.start()
        ids = [await _submit(manager, _lines(3, bad=1)) for _ in range(4)]
        await _wait_for(lambda: all(manager.get(i)["status"] in TERMINAL for i in ids), "the batches to end")
        await _wait_for(lambda: not manager._runs, "their tasks to end")
        await manager.stop()
        return manager

    manager = asyncio.run(run())
    assert (manager._runs, manager._lines, manager._saved_at) == ({}, {}, {})


def test_a_disk_error_while_writing_results_fails_the_batch_without_orphans(tmp_path, monkeypatch):
    """A result file that cannot be written (a full disk) fails the batch; the files of
    its plan written before it are removed, not left listed with no batch pointing at them."""
    real_save = FileStore._save

    def save(self, file_id, copy_in, filename, purpose):
        if filename.endswith("_error.jsonl"):
            raise OSError(28, "No space left on device")
        return real_save(self, file_id, copy_in, filename, purpose)

    monkeypatch.setattr(FileStore, "_save", save)

    async def run() -> tuple[dict, FileStore]:
        manager = _manager(tmp_path)
        manager.start()
        batch_id = await _submit(manager, _lines(4, bad=1))
        await _wait_for(lambda: manager.get(batch_id)["status"] in TERMINAL, "the batch to end")
        await manager.stop()
        return manager.get(batch_id), manager.files

    batch, files = asyncio.run(run())
    assert batch["status"] == "failed" and "No space left" in batch["errors"]["data"][0]["message"]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert [m["id"] for m in files.list(None, None, 100, "asc")["data"]] == [batch["input_file_id"]]
    assert not any(name.endswith(".plan") for name in _on_disk(tmp_path))
    restarted = BatchStore(tmp_path / "batches").load_all()[batch["id"]]
    assert restarted["status"] == "failed"


def _full_disk_for(monkeypatch, refuse) -> None:
    """``BatchStore.save`` raises ENOSPC for the batch states ``refuse(batch)`` picks."""
    real_save = BatchStore.save

    def save(self, batch):
        if refuse(batch):
            raise OSError(28, "No space left on device")
        real_save(self, batch)

    monkeypatch.setattr(BatchStore, "save", save)


def _run_to_end(root: Path, content: bytes) -> tuple[dict, FileStore]:
    async def run() -> tuple[dict, FileStore]:
        manager = _manager(root)
        manager.start()
        batch_id = await _submit(manager, content)
        await _wait_for(lambda: manager.get(batch_id)["status"] in TERMINAL, "the batch to end")
        await manager.stop()
        return manager.get(batch_id), manager.files

    return asyncio.run(run())


def test_a_record_that_cannot_be_saved_when_finalized_points_at_no_removed_file(tmp_path, monkeypatch):
    """The record pointing at the result files could not be saved (a full disk): the files
    were removed, but the batch had taken their ids before the save, so it failed (in
    memory and on disk) with an output_file_id of a file that did not exist."""
    _full_disk_for(monkeypatch, lambda b: b["status"] == "completed")
    batch, files = _run_to_end(tmp_path, _lines(3, bad=1))
    assert batch["status"] == "failed" and "No space left" in batch["errors"]["data"][0]["message"]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert batch["completed_at"] is None
    assert [m["id"] for m in files.list(None, None, 100, "asc")["data"]] == [batch["input_file_id"]]
    on_disk = BatchStore(tmp_path / "batches").load_all()[batch["id"]]
    assert on_disk["status"] == "failed" and on_disk["output_file_id"] is None


def test_a_progress_save_that_fails_loses_no_line(tmp_path, monkeypatch):
    """Saving the counts while lines finish failed (a full disk) inside the line's task,
    so a line that had succeeded was reported as a batch_cancelled error."""
    monkeypatch.setattr(batch_module, "PERSIST_INTERVAL_S", -1.0)  # a save after every line
    _full_disk_for(monkeypatch, lambda b: b["status"] == "in_progress" and b["request_counts"]["completed"])
    batch, files = _run_to_end(tmp_path, _lines(4, bad=0))
    assert batch["status"] == "completed" and batch["error_file_id"] is None
    assert set(_records(files, batch["output_file_id"])) == {"c0", "c1", "c2", "c3"}


def test_a_batch_that_cannot_be_saved_is_not_created(tmp_path, monkeypatch):
    """A batch whose first save failed (a full disk) got a 500 yet stayed listed,
    validating for good, and ran nowhere."""
    _full_disk_for(monkeypatch, lambda b: b["status"] == "validating")

    async def run() -> BatchManager:
        manager = _manager(tmp_path)
        with pytest.raises(OSError, match="No space"):
            await _submit(manager, _lines(1, bad=0))
        return manager

    manager = asyncio.run(run())
    assert manager.list(None, 20)["data"] == [] and manager._runs == {}


@pytest.mark.parametrize(
    "plan",
    [
        "{}",
        "[]",
        '{"status": "completed", "fields": {}, "files": null}',
        pytest.param("[" * 100_000, id="deep"),
    ],
)
def test_a_finalization_plan_that_is_not_a_plan_runs_the_batch_again(tmp_path, monkeypatch, plan):
    """A damaged or foreign plan that parses used to stop the server at start (a
    KeyError or TypeError); it is ignored with a warning and the batch runs again. The
    result files the killed run wrote were left listed beside the new ones (the plan that
    named them unreadable); they are removed as any result file of an unfinished batch."""
    batch_id, first = _stop_at(tmp_path, "files", monkeypatch, _lines(2, bad=1))
    (tmp_path / "batches" / f"{batch_id}.plan").write_text(plan)
    batch, files = _restart(tmp_path, batch_id)
    assert set(_records(files, batch["output_file_id"])) == {"c1"}
    assert not (tmp_path / "batches" / f"{batch_id}.plan").exists()
    listed = {f["id"] for f in files.list(None, None, 100, "asc")["data"]}
    assert listed == {batch["input_file_id"], batch["output_file_id"], batch["error_file_id"]}
    assert not set(first["files"].values()) & listed


def test_an_upload_whose_file_object_cannot_be_written_leaves_no_bytes(tmp_path, monkeypatch):
    """The bytes were renamed into place before the file object was written: a full disk
    then left an unlisted data file behind until the next start."""

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    files = FileStore(tmp_path)
    monkeypatch.setattr(files_module, "atomic_write", full)
    with pytest.raises(OSError, match="No space"):
        asyncio.run(files.create(b"{}\n", "in.jsonl", "batch"))
    assert list(tmp_path.iterdir()) == []


def test_a_lock_file_that_cannot_be_opened_is_a_startup_error_naming_it(tmp_path):
    """A directory where the data dir's lock file goes stopped the server with an
    IsADirectoryError traceback."""
    (tmp_path / BatchAPIClaim.LOCK_FILE).mkdir()
    with pytest.raises(ValueError, match="cannot open the lock file .*batch_api.lock"):
        BatchAPIClaim(tmp_path)


def test_a_full_disk_at_start_still_settles_every_batch(tmp_path, monkeypatch):
    """Saving a resumed or cancelled batch at start failed (a full disk) out of the
    server's startup: 'Application startup failed', a traceback and exit 3. The start goes
    on; each batch still ends in a status, its record settled again at the next start."""
    batch_id, _ = _stop_at(tmp_path, "partial", monkeypatch, _lines(2, bad=1))  # to run again
    store = BatchStore(tmp_path / "batches")
    cancelling = {**store.load_all()[batch_id], "id": "batch_cancelling", "status": "cancelling"}
    store.save(cancelling)
    _full_disk_for(monkeypatch, lambda b: True)

    async def run() -> BatchManager:
        manager = _manager(tmp_path)
        manager.start()
        await _wait_for(lambda: manager.get(batch_id)["status"] in TERMINAL, "the batch to end")
        await manager.stop()
        return manager

    manager = asyncio.run(run())
    assert manager.get("batch_cancelling")["status"] == "cancelled"
    assert manager.get(batch_id)["status"] == "failed" and manager.get(batch_id)["output_file_id"] is None


def test_a_plan_whose_record_cannot_be_saved_at_start_finishes_in_memory_and_is_kept(tmp_path, monkeypatch):
    """A batch killed with every result file written, restarted on a full disk: it ends
    finished as its plan says, and the plan stays on disk for the next start to apply."""
    batch_id, plan = _stop_at(tmp_path, "files", monkeypatch, _lines(3, bad=1))
    _full_disk_for(monkeypatch, lambda b: True)
    manager = _manager(tmp_path)
    manager.start()
    batch = manager.get(batch_id)
    assert batch["status"] == "completed" and batch["output_file_id"] == plan["files"]["output_file_id"]
    assert BatchStore(tmp_path / "batches").load_plan(batch_id) == plan
    assert BatchStore(tmp_path / "batches").load_all()[batch_id]["status"] == "finalizing"


def test_a_lock_file_whose_pid_cannot_be_written_still_claims_the_folder(tmp_path, monkeypatch):
    """Writing the server's pid into the lock file on a full disk stopped the start."""

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.pwrite", full)
    claim = BatchAPIClaim(tmp_path)
    assert claim.refusal is None
    claim.release()


def test_an_upload_on_a_full_disk_is_an_error_naming_it(tmp_path, monkeypatch):
    """A disk error while storing an upload was a 500 saying only 'internal server error: OSError'."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from seer_engine.entrypoints.openai.errors import install_error_handlers

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(files_module.files_router(FileStore(tmp_path)))
    monkeypatch.setattr(files_module, "atomic_write", full)
    resp = TestClient(app).post("/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"})
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "storage_error"
    message = resp.json()["error"]["message"]
    assert "could not save the file under --data-dir: No space left on device" in message
    assert list(tmp_path.iterdir()) == []


def test_a_record_with_a_field_of_another_type_is_skipped_not_breaking_listings(tmp_path):
    """A foreign batch or file record whose created_at was not a number was loaded, and
    every listing of batches or files was a 500 (sorting compared it with the others')."""
    batch_id, _ = _stop_at(tmp_path, "files", pytest.MonkeyPatch(), _lines(1, bad=0))
    foreign = {"status": "completed", "endpoint": ENDPOINT, "input_file_id": "file-x", "request_counts": {}}
    foreign |= {"created_at": "yesterday", "filename": "f", "purpose": "batch", "bytes": 3}
    (tmp_path / "batches" / "batch_foreign.json").write_text(json.dumps({**foreign, "id": "batch_foreign"}))
    (tmp_path / "files" / "file-foreign.json").write_text(json.dumps({**foreign, "id": "file-foreign"}))
    (tmp_path / "files" / "file-foreign.data").write_bytes(b"{}\n")

    async def run() -> tuple[list, list]:
        manager = _manager(tmp_path)
        manager.start()
        await _wait_for(lambda: manager.get(batch_id)["status"] == "completed", "the batch to complete")
        await manager.stop()
        return manager.list(None, 20)["data"], manager.files.list(None, None, 100, "asc")["data"]

    batches, files = asyncio.run(run())
    assert [b["id"] for b in batches] == [batch_id] and len(files) == 2


def test_the_content_of_a_file_whose_bytes_were_removed_is_an_error_naming_it(tmp_path):
    """Bytes removed from --data-dir behind the server's back were a 500 saying only
    'internal server error: RuntimeError'."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from seer_engine.entrypoints.openai.errors import install_error_handlers

    files = FileStore(tmp_path)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(files_module.files_router(files))
    file_id = asyncio.run(files.create(b"{}\n", "in.jsonl", "batch"))["id"]
    files.data_path(file_id).unlink()
    resp = TestClient(app, raise_server_exceptions=False).get(f"/v1/files/{file_id}/content")
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "storage_error"
    assert f"the content of file {file_id!r} is missing from --data-dir" in resp.json()["error"]["message"]


def test_a_resumed_batch_whose_endpoint_this_server_does_not_serve_fails_naming_it(tmp_path):
    """A batch record left unfinished by a server (or version) serving other endpoints
    failed at its next start with the message "'/v1/embeddings'" (a KeyError's) and a
    traceback in the log."""
    files = FileStore(tmp_path / "files")
    row = {"custom_id": "c0", "method": "POST", "url": "/v1/embeddings", "body": {"input": "q"}}
    file_id = asyncio.run(files.create((json.dumps(row) + "\n").encode(), "in.jsonl", "batch"))["id"]
    foreign = {"id": "batch_foreign", "object": "batch", "status": "in_progress"}
    foreign |= {"endpoint": "/v1/embeddings"}
    foreign |= {"input_file_id": file_id, "created_at": 1, "request_counts": {}, "expires_at": 2**40}
    foreign |= {"in_progress_at": 1, "completion_window": "24h"}
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "batch_foreign.json").write_text(json.dumps(foreign))

    async def run() -> dict:
        manager = _manager(tmp_path)
        manager.start()
        await _wait_for(lambda: manager.get("batch_foreign")["status"] in TERMINAL, "the batch to end")
        await manager.stop()
        return manager.get("batch_foreign")

    batch = asyncio.run(run())
    assert batch["status"] == "failed", batch
    (error,) = batch["errors"]["data"]
    assert error["code"] == "unsupported_endpoint" and error["param"] == "endpoint", error
    assert error["message"] == (
        f"this server does not serve the batch's endpoint '/v1/embeddings'; it serves {[ENDPOINT]}"
    )


def test_only_the_result_files_of_the_resumed_batch_itself_are_removed(tmp_path):
    """The leftover result files of a batch are found by its exact file names: an upload
    of the same name and the results of a batch whose id extends it stay."""
    files = FileStore(tmp_path)

    def make(name: str, purpose: str) -> str:
        return asyncio.run(files.create(b"{}\n", name, purpose))["id"]

    own = make("batch_a_output.jsonl", "batch_output")
    make("batch_a_b_output.jsonl", "batch_output")
    make("batch_a_error.jsonl", "batch")
    names = {batch_module._result_filename("batch_a", kind) for kind in batch_module.RESULT_KINDS}
    assert files.outputs_named(names) == [own]
