"""A client that hangs up before a streamed response's first byte leaves nothing behind:
its engine requests are aborted and its request id leaves the abort-by-id table.

The hang-up is driven through the app's ASGI interface, as a server that implements ASGI
spec 2.4 reports it: ``send`` raises ``OSError`` for the response start. Starlette then
never starts the response's body iterator, so cleanup that lives in the iterator's
``finally`` never runs. Everything is held by a keep pause, so no request ends on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client, create_app
from seer_engine.rollout.config import RolloutConfig


async def _hang_up_at_the_first_byte(app, path: str, body: dict) -> list[dict]:
    """POST ``body`` and hang up when the response starts; returns what the app sent."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(raw)).encode())],
    }  # fmt: skip
    gone = asyncio.Event()
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        gone.set()
        raise OSError("the client closed the connection")  # ASGI 2.4: send on a closed connection

    with contextlib.suppress(Exception):  # the app may re-raise the disconnect
        await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("rollout_mode", [False, True], ids=["engine", "rollout"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": ["a", "b"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
    ids=["completion", "chat"],
)
def test_a_hang_up_before_the_stream_starts_leaves_nothing_behind(
    tiny_model, tmp_path, rollout_mode, path, body
):
    rollout = RolloutConfig(rollout_mode=rollout_mode, instances=2 if rollout_mode else 1,
                            distributed_backend="inproc", chunk_tokens=4)  # fmt: skip
    settings = ServerSettings(served_model_names=["m"], data_dir=tmp_path, rollout=rollout)
    engine = build_engine_client(EngineConfig(model=str(tiny_model("qwen3")), num_kv_blocks=64), settings)
    try:
        app = create_app(engine, settings)
        registry = app.state.request_registry
        request = {"model": "m", "max_tokens": 200, "stream": True, "ignore_eos": True,
                   "request_id": "hung-up", **body}  # fmt: skip

        async def run() -> None:
            await engine.pause("keep")
            sent = await _hang_up_at_the_first_byte(app, path, request)
            assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, sent
            # Aborts reach the engine thread before this later call does: no waiting needed.
            stats = await engine.stats()
            left = {"held engine requests": stats.num_requests_held, "abort-by-id entries": len(registry)}
            assert left == {"held engine requests": 0, "abort-by-id entries": 0}
            await engine.resume()

        asyncio.run(run())
    finally:
        engine.shutdown()
