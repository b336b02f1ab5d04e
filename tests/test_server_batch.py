"""The Files and Batch APIs through the ``openai`` client, including a server restart."""

from __future__ import annotations

import json
import time

import openai
import pytest

pytest_plugins = ["server_harness"]

TERMINAL = ("completed", "failed", "cancelled", "expired")


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _completion_line(custom_id: str, model: str, **body) -> dict:
    body = {"model": model, "prompt": f"Question {custom_id}:", "max_tokens": 6, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def _upload(client, lines: list[dict]) -> str:
    return client.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch").id


def _wait(server, client, batch_id: str, statuses=TERMINAL, timeout: float = 30.0):
    return server.wait_until(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout=timeout,
        interval=0.05,
        what=f"batch {batch_id} to reach {statuses}",
    )


def _records(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {r["custom_id"]: r for r in map(json.loads, text.splitlines())}


def test_batch_round_trip(server, client, model):
    lines = [_completion_line(f"req-{i}", model, n=1 + i % 3, seed=i) for i in range(6)]
    lines.append(_completion_line("bad-n", model, n=0))
    lines.append(_completion_line("bad-model", "other-model"))
    lines.append(
        {
            "custom_id": "tokens-0",
            "method": "POST",
            "url": "/v1/completions",
            # unseeded, so the engine draws its seed: ignore_eos keeps its length whatever it draws
            "body": {
                "model": model,
                "prompt": [1, 2, 3],
                "max_tokens": 3,
                "return_token_ids": True,
                "ignore_eos": True,
            },  # fmt: skip
        }
    )
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint="/v1/completions", completion_window="24h"
    )
    assert batch.status == "validating" and batch.object == "batch"
    batch = _wait(server, client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 9
    assert batch.request_counts.completed == 7 and batch.request_counts.failed == 2
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.usage.output_tokens == sum(6 * (1 + i % 3) for i in range(6)) + 3
    outputs, errors = _records(client, batch.output_file_id), _records(client, batch.error_file_id)
    assert set(outputs) == {f"req-{i}" for i in range(6)} | {"tokens-0"}
    for i in range(6):
        record = outputs[f"req-{i}"]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        assert len(record["response"]["body"]["choices"]) == 1 + i % 3
    assert outputs["tokens-0"]["response"]["body"]["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert errors["bad-n"]["response"]["status_code"] == 400
    assert "n must be" in errors["bad-n"]["response"]["body"]["error"]["message"]
    assert errors["bad-model"]["response"]["status_code"] == 404
    # Seeded lines give what the online endpoint gives.
    online = client.completions.create(model=model, prompt="Question req-4:", max_tokens=6, n=2, seed=4)
    assert [c["text"] for c in outputs["req-4"]["response"]["body"]["choices"]] == [
        c.text for c in online.choices
    ]
    assert batch.id in [b.id for b in client.batches.list()]


def test_chat_batch(server, client, model):
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4},
        }
        for i in range(3)
    ]
    batch = client.batches.create(
        input_file_id=_upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = _wait(server, client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3
    outputs = _records(client, batch.output_file_id)
    assert outputs["c1"]["response"]["body"]["object"] == "chat.completion"


def test_broken_batch_files_fail_with_line_errors(server, client, model):
    good = _completion_line("ok", model)
    content = b"\n".join(
        [
            json.dumps(good).encode(),
            b"{not json",
            json.dumps({**good, "custom_id": ""}).encode(),
            json.dumps(good).encode(),  # duplicate custom_id
            json.dumps({**good, "custom_id": "u", "url": "/v1/embeddings"}).encode(),
            json.dumps({**good, "custom_id": "b", "body": "text"}).encode(),
        ]
    )
    file_id = client.files.create(file=("broken.jsonl", content), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait(server, client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    codes = {(e.line, e.code) for e in batch.errors.data}
    assert codes == {
        (2, "invalid_json_line"),
        (3, "missing_custom_id"),
        (4, "duplicate_custom_id"),
        (5, "mismatched_url"),
        (6, "invalid_body"),
    }
    empty = client.files.create(file=("empty.jsonl", b"\n"), purpose="batch").id
    batch = client.batches.create(input_file_id=empty, endpoint="/v1/completions", completion_window="24h")
    assert _wait(server, client, batch.id).errors.data[0].code == "empty_file"


def test_batch_create_errors(client, http):
    with pytest.raises(openai.NotFoundError) as missing:
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h"
        )
    assert missing.value.body["param"] == "input_file_id", missing.value.body
    file_id = _upload(client, [{"custom_id": "x"}])
    for body, status in [
        ({"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "1h"}, 400),
        ({"input_file_id": 5, "endpoint": "/v1/completions"}, 400),
        ({"endpoint": "/v1/completions"}, 400),
        # OpenAI's metadata bounds: 16 pairs, 64-character keys, 512-character values
        (
            {
                "input_file_id": file_id,
                "endpoint": "/v1/completions",
                "metadata": {f"k{i}": "v" for i in range(17)},
            },
            400,
        ),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "metadata": {"k" * 65: "v"}}, 400),
        ({"input_file_id": file_id, "endpoint": "/v1/completions", "metadata": {"k": "v" * 513}}, 400),
    ]:
        resp = http.post("/v1/batches", json=body)
        assert resp.status_code == status and "message" in resp.json()["error"], resp.text
        assert "metadata" not in body or resp.json()["error"]["param"].startswith("metadata"), resp.text
    assert http.get("/v1/batches/batch_missing").status_code == 404
    assert http.post("/v1/batches/batch_missing/cancel").status_code == 404
    assert http.get("/v1/batches", params={"limit": 0}).status_code == 400


def test_files_api(client, http):
    uploaded = client.files.create(file=("notes.jsonl", b'{"a": 1}\n'), purpose="batch")
    assert uploaded.bytes == 9 and uploaded.filename == "notes.jsonl" and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == b'{"a": 1}\n'
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert http.get(f"/v1/files/{uploaded.id}/content").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert http.post("/v1/files", data={"purpose": "batch"}).status_code == 400  # no file part
    assert http.post("/v1/files", json={"purpose": "batch"}).status_code == 400


def test_files_and_batches_made_in_the_same_second_list_newest_first(server, client, model):
    file_ids = [_upload(client, [_completion_line("a", model, max_tokens=1)]) for _ in range(5)]
    assert [f.id for f in client.files.list(purpose="batch", limit=5).data] == file_ids[::-1]
    create = client.batches.create
    batch_ids = [
        create(input_file_id=file_ids[0], endpoint="/v1/completions", completion_window="24h").id
        for _ in range(5)
    ]
    assert [b.id for b in client.batches.list(limit=5).data] == batch_ids[::-1]
    for batch_id in batch_ids:
        _wait(server, client, batch_id)


def test_cancel_batch(server, client, http, model):
    assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    try:
        lines = [_completion_line(f"k{i}", model, max_tokens=50) for i in range(4)]
        batch = client.batches.create(
            input_file_id=_upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        )
        _wait(server, client, batch.id, statuses=("in_progress",))
        cancelled = client.batches.cancel(batch.id)
        assert cancelled.status in ("cancelling", "cancelled")
        batch = _wait(server, client, batch.id)
    finally:
        http.post("/resume_generation")
    assert batch.status == "cancelled" and batch.cancelled_at and batch.output_file_id is None
    errors = _records(client, batch.error_file_id)
    assert set(errors) == {f"k{i}" for i in range(4)}
    assert all(r["error"]["code"] == "batch_cancelled" for r in errors.values())
    assert http.post(f"/v1/batches/{batch.id}/cancel").json()["status"] == "cancelled"  # idempotent
    server.wait_until(lambda: server.metrics()["num_requests_held"] == 0, what="held requests to go")
    completed = client.batches.create(
        input_file_id=_upload(client, [_completion_line("one", model)]),
        endpoint="/v1/completions",
        completion_window="24h",
    )
    assert _wait(server, client, completed.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(completed.id)


def test_restart_keeps_files_and_batches_and_resumes(server, client, http, model):
    lines = [_completion_line(f"r{i}", model, seed=i) for i in range(3)]
    finished = _wait(
        server,
        client,
        client.batches.create(
            input_file_id=_upload(client, lines), endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert finished.status == "completed"
    before = client.files.content(finished.output_file_id).text
    # A batch accepted but not finished when the server stops is run again after the restart.
    assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    pending = client.batches.create(
        input_file_id=_upload(client, [_completion_line("p0", model), _completion_line("p1", model)]),
        endpoint="/v1/completions",
        completion_window="24h",
    )
    started = _wait(server, client, pending.id, statuses=("in_progress",)).in_progress_at
    server.restart()
    with server.openai() as fresh:
        again = fresh.batches.retrieve(finished.id)
        assert again.status == "completed" and again.output_file_id == finished.output_file_id
        assert fresh.files.content(finished.output_file_id).text == before
        assert finished.input_file_id in [f.id for f in fresh.files.list()]
        resumed = _wait(server, fresh, pending.id)
        assert resumed.status == "completed" and resumed.request_counts.completed == 2
        assert resumed.in_progress_at == started  # its start, not the restart's
        assert set(_records(fresh, resumed.output_file_id)) == {"p0", "p1"}


def test_the_input_file_of_an_unfinished_batch_cannot_be_deleted(server, client, http, model):
    """A restart runs an unfinished batch again from its input file, so that file refuses
    deletion (409 ``file_in_use``, naming the batch) until the batch ends. A ``keep``
    pause holds the batch in progress for as long as the test needs."""
    assert http.post("/pause_generation", json={"mode": "keep"}).status_code == 200
    try:
        file_id = _upload(client, [_completion_line(f"k{i}", model) for i in range(2)])
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        _wait(server, client, batch.id, statuses=("in_progress",))
        resp = http.delete(f"/v1/files/{file_id}")
        assert resp.status_code == 409, resp.text
        error = resp.json()["error"]
        assert error["code"] == "file_in_use" and error["param"] == "file_id" and batch.id in error["message"]
        assert client.files.retrieve(file_id).id == file_id
    finally:
        assert http.post("/resume_generation").status_code == 200
    assert _wait(server, client, batch.id).status == "completed"
    assert client.files.delete(file_id).deleted


def test_a_file_of_junk_fails_its_batch_with_a_bounded_error_list(server, client):
    """Every bad line used to be listed: a big junk file made a huge batch record, sent
    with every GET. At most MAX_LINE_ERRORS are listed, then where reading stopped."""
    from seer_engine.entrypoints.openai.batch_input import MAX_LINE_ERRORS

    file_id = client.files.create(file=("junk.jsonl", b"x\n" * 5_000), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait(server, client, batch.id)
    assert batch.status == "failed"
    errors = batch.errors.data
    assert len(errors) == MAX_LINE_ERRORS + 1 and errors[-1].code == "too_many_errors"
    assert [e.line for e in errors[:MAX_LINE_ERRORS]] == list(range(1, MAX_LINE_ERRORS + 1))


def test_a_batch_of_more_than_the_request_cap_fails_naming_the_cap(server, client, model):
    """OpenAI caps a batch at 50,000 requests; one more fails the batch (each request
    would be a task of its own) with an error at the line past the cap."""
    from seer_engine.entrypoints.openai.batch_input import MAX_BATCH_REQUESTS

    line = '{"custom_id":"r%d","url":"/v1/completions","body":{"model":"m","prompt":"x","max_tokens":1}}\n'
    text = "".join(line % i for i in range(MAX_BATCH_REQUESTS + 1)).encode()
    file_id = client.files.create(file=("big.jsonl", text), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait(server, client, batch.id)
    assert batch.status == "failed" and batch.request_counts.total == 0
    [error] = batch.errors.data
    assert error.code == "too_many_requests" and error.line == MAX_BATCH_REQUESTS + 1
    assert f"{MAX_BATCH_REQUESTS:,}" in error.message


def test_a_line_may_hold_unicode_line_separators(server, client, model):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped; only "\\n" ends a line."""
    lines = [
        _completion_line(f"s{i}", model, prompt=f"one{sep}two") for i, sep in enumerate("\u2028\u2029\x85")
    ]
    text = "".join(json.dumps(line, ensure_ascii=False) + "\r\n" for line in lines).encode()
    file_id = client.files.create(file=("seps.jsonl", text), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    batch = _wait(server, client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch


def test_an_error_of_the_whole_file_names_no_line_and_bad_bytes_name_theirs(server, client, model):
    """Lines count from 1: an empty file's error used to say line 0 (a client reading
    ``lines[e.line - 1]`` got the last line), and bytes that are not UTF-8 said line 0
    wherever they were; now the one has no line and the other names the line they are on."""
    good = json.dumps(_completion_line("a", model)).encode()
    for content, code, line in [
        (b"\n\n", "empty_file", None),
        (good + b"\n" + b'{"x": "\xff"}\n', "invalid_file", 2),
    ]:
        file_id = client.files.create(file=("in.jsonl", content), purpose="batch").id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        [error] = _wait(server, client, batch.id).errors.data
        assert (error.code, error.line) == (code, line), error


def test_a_second_server_on_the_data_dir_leaves_the_first_ones_batches_alone(tiny_model, tmp_path):
    """Servers on one host share the default --data-dir. A second one used to load the
    first one's batches and run its unfinished ones again beside it (each then pointing
    the batch at its own output file); now only the server holding the folder's claim
    serves the Batch and Files APIs, the other answers 503 naming the folder, and once the
    first one stops the next server takes the folder over."""
    import asyncio

    import httpx

    from seer_engine.engine.config import EngineConfig
    from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client, create_app

    settings = ServerSettings(served_model_names=["m"], data_dir=tmp_path)
    engine = build_engine_client(EngineConfig(model=str(tiny_model("qwen3")), num_kv_blocks=32), settings)

    def client(app) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)

    async def run() -> None:
        first = create_app(engine, settings)
        async with first.router.lifespan_context(first), client(first) as one:
            assert (await one.post("/pause_generation", json={"mode": "keep"})).status_code == 200
            upload = await one.post(
                "/v1/files", files={"file": ("in.jsonl", _jsonl([_completion_line("a", "m")]))},
                data={"purpose": "batch"},
            )  # fmt: skip
            body = {
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            }
            batch = (await one.post("/v1/batches", json=body)).json()

            second = create_app(engine, settings)
            async with second.router.lifespan_context(second), client(second) as two:
                for path in ("/v1/batches", f"/v1/batches/{batch['id']}", "/v1/files"):
                    resp = await two.get(path)
                    assert resp.status_code == 503, resp.text
                    error = resp.json()["error"]
                    assert error["code"] == "batch_api_unavailable" and str(tmp_path) in error["message"]
                assert (await one.post("/resume_generation")).status_code == 200
                completion = {"model": "m", "prompt": [1], "max_tokens": 1}
                assert (await two.post("/v1/completions", json=completion)).status_code == 200, "it serves"

            for _ in range(2400):  # a condition, polled for up to 2 minutes
                done = (await one.get(f"/v1/batches/{batch['id']}")).json()
                if done["status"] in TERMINAL:
                    break
                await asyncio.sleep(0.05)
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 1

        third = create_app(engine, settings)  # the first one stopped: its folder is free
        async with third.router.lifespan_context(third), client(third) as three:
            again = (await three.get(f"/v1/batches/{batch['id']}")).json()
            assert again["output_file_id"] == done["output_file_id"]

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_batch_whose_completion_window_ends_expires(tiny_model, tmp_path, monkeypatch):
    """When its completion window ends, a batch is ``expired``, as OpenAI's: the lines done
    keep their results and the others end with a ``batch_expired`` error (here generation
    is held, so they cannot finish). One whose window ended while no server ran it expires
    at the next start instead of running again."""
    import asyncio

    import httpx

    from seer_engine.engine.config import EngineConfig
    from seer_engine.entrypoints.openai import batch as batch_module
    from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client, create_app
    from seer_engine.entrypoints.openai.batch_store import BatchStore

    monkeypatch.setitem(batch_module.COMPLETION_WINDOWS, "24h", 1)  # seconds
    settings = ServerSettings(served_model_names=["m"], data_dir=tmp_path)
    engine = build_engine_client(EngineConfig(model=str(tiny_model("qwen3")), num_kv_blocks=32), settings)
    lines = [_completion_line("held", "m"), _completion_line("refused", "m", temperature=-1)]

    async def wait_done(http: httpx.AsyncClient, batch_id: str) -> dict:
        for _ in range(2400):  # a condition, polled for up to 2 minutes
            done = (await http.get(f"/v1/batches/{batch_id}")).json()
            if done["status"] in TERMINAL:
                return done
            await asyncio.sleep(0.05)
        raise AssertionError(f"batch {batch_id} did not end: {done}")

    async def errors_of(http: httpx.AsyncClient, batch: dict) -> dict[str, dict]:
        text = (await http.get(f"/v1/files/{batch['error_file_id']}/content")).text
        return {r["custom_id"]: r for r in map(json.loads, text.splitlines())}

    async def run() -> None:
        app = create_app(engine, settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                assert (await http.post("/pause_generation", json={"mode": "keep"})).status_code == 200
                upload = await http.post(
                    "/v1/files", files={"file": ("in.jsonl", _jsonl(lines))}, data={"purpose": "batch"}
                )
                body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/completions"}
                created = (await http.post("/v1/batches", json=body)).json()
                done = await wait_done(http, created["id"])
                assert done["status"] == "expired" and done["expired_at"] >= created["created_at"], done
                assert done["output_file_id"] is None
                errors = await errors_of(http, done)
                held = errors["held"]
                assert held["error"]["code"] == "batch_expired" and held["response"] is None
                refused = errors["refused"]["response"]
                assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
                # A window that ends while no server runs the batch (generation still held).
                monkeypatch.setitem(batch_module.COMPLETION_WINDOWS, "24h", 3600)
                late = (await http.post("/v1/batches", json=body)).json()
        store = BatchStore(tmp_path / "batches")
        record = store.load_all()[late["id"]]
        assert record["status"] not in TERMINAL, "its lines were held: it was still running at the stop"
        store.save({**record, "expires_at": int(time.time()) - 1})
        app = create_app(engine, settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                assert (await http.post("/resume_generation")).status_code == 200
                done = await wait_done(http, late["id"])
                assert done["status"] == "expired", done
                codes = {r["error"]["code"] for r in (await errors_of(http, done)).values()}
                assert codes == {"batch_expired"}

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
