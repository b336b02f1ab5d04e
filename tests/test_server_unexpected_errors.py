"""An exception no handler expects (a bug) still answers with an OpenAI error object: a
500 ``server_error`` the openai client can read, not Starlette's plain-text page."""

from __future__ import annotations

import asyncio

import httpx

from seer_engine.engine.config import EngineConfig
from seer_engine.entrypoints.openai.api_server import ServerSettings, build_engine_client, create_app


def test_an_unexpected_exception_is_an_openai_error_object(tiny_model, tmp_path, monkeypatch):
    settings = ServerSettings(served_model_names=["m"], data_dir=tmp_path)
    engine = build_engine_client(EngineConfig(model=str(tiny_model("qwen3")), num_kv_blocks=32), settings)
    try:

        async def a_bug(*args, **kwargs) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(engine, "update_weights_from_disk", a_bug)  # the real engine, one method broken
        app = create_app(engine, settings)

        async def run() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                broken = await client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
                fine = await client.post(
                    "/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2}
                )
                return [broken, fine]

        broken, fine = asyncio.run(run())
        assert broken.status_code == 500, broken.text
        assert broken.json()["error"] == {
            "message": "internal server error: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        assert fine.status_code == 200, "the server keeps serving"
    finally:
        engine.shutdown()
