"""``seer_engine serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This module wires the pieces: it picks the backend (``build_engine_client``, the one
place where that choice is made), builds the app (routes, error handlers, guards)
and runs uvicorn. The routes themselves live in serving_*.py, files.py, batch.py
and admin.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import socket
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from seer_engine.engine.async_engine import AsyncEngine
from seer_engine.engine.client import EngineClient
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import resolve_model_path
from seer_engine.entrypoints.openai.admin import admin_router, package_version
from seer_engine.entrypoints.openai.batch import BatchManager, batches_router, refusing_router
from seer_engine.entrypoints.openai.batch_store import BatchAPIClaim, BatchStore
from seer_engine.entrypoints.openai.chat_output import REASONING_PARSERS
from seer_engine.entrypoints.openai.errors import APIError, install_error_handlers, validate_body
from seer_engine.entrypoints.openai.files import FileStore, files_router
from seer_engine.entrypoints.openai.json_body import JSONRequest, JSONRoute
from seer_engine.entrypoints.openai.limits import DEFAULT_MAX_UPLOAD_BYTES, BodyLimits, RequestBounds
from seer_engine.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from seer_engine.entrypoints.openai.protocol import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from seer_engine.entrypoints.openai.server_stop import (
    DEFAULT_DRAIN_S,
    UVICORN_MARGIN_S,
    StoppingServer,
    shutdown_engine,
)
from seer_engine.entrypoints.openai.serving_base import EventStream, RequestRegistry
from seer_engine.entrypoints.openai.serving_chat import OpenAIServingChat
from seer_engine.entrypoints.openai.serving_completions import OpenAIServingCompletion
from seer_engine.entrypoints.openai.serving_generate import ServingGenerate
from seer_engine.entrypoints.openai.serving_tokenize import ServingTokenize, tokenize_router
from seer_engine.entrypoints.openai.tool_parsers import TOOL_PARSERS, make_tool_parser
from seer_engine.model_executor.model_source import cache_root
from seer_engine.rollout.backend import RolloutBackend
from seer_engine.rollout.config import RolloutConfig
from seer_engine.rollout.report import writable_dir

logger = logging.getLogger("seer_engine.serve")


def default_data_dir() -> Path:
    """``$SEER_ENGINE_CACHE/server``: a run pointed at another cache keeps its files there too."""
    return cache_root() / "server"


T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerSettings:
    """Server-level options (everything that is not an engine flag)."""

    served_model_names: list[str]
    data_dir: Path = field(default_factory=default_data_dir)
    api_key: str | None = None
    max_body_bytes: int | None = None  # JSON routes; None: sized to max_model_len (limits.py)
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES  # POST /v1/files
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser with --enable-auto-tool-choice
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser


# ----------------------------------------------------------------------------- backend


def build_engine_client(config: EngineConfig, settings: ServerSettings) -> EngineClient:
    """The one place where the backend is chosen: one engine on a background thread,
    or in rollout mode (or with several instances) the rollout backend: an engine
    pool behind the Request Buffer with a rollout policy, driven the same way."""
    name = settings.served_model_names[0]
    if not settings.rollout.needs_pool:
        return AsyncEngine.for_engine(config, model_name=name).start()
    tokenizer = str(config.tokenizer or resolve_model_path(config.model, config.dtype))
    rollout = settings.rollout
    data_dir = settings.data_dir
    return AsyncEngine(
        lambda: RolloutBackend(config, rollout, data_dir), name, tokenizer_path=tokenizer
    ).start()


# ---------------------------------------------------------------------------------- app


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it when the client goes away (its requests are aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():  # cancelled above: it ends at its next await
        raise APIError(499, "the client closed the connection", code="client_closed")
    return task.result()


class EventStreamResponse(StreamingResponse):
    """A streamed completion or chat: once the response is over, sent in full, cut short
    or never started (a client that hung up before its first byte), its events are closed,
    which ends the engine requests behind them and unlinks the request id."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(stream, media_type="text/event-stream")
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.aclose()


def parse_body(model: type[M], body: dict, request_id: str) -> M:
    """A batch line's body as a request model (stream off, the line's request id)."""
    req = validate_body(model, body)
    if req.stream:
        raise APIError(400, "stream is not supported in a batch", param="stream")
    return req.model_copy(update={"request_id": request_id})


def create_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    registry = RequestRegistry()
    completions = OpenAIServingCompletion(engine, settings.served_model_names, registry)
    parser = make_tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
    reasoning = REASONING_PARSERS[settings.reasoning_parser]() if settings.reasoning_parser else None
    chat = OpenAIServingChat(engine, settings.served_model_names, registry, parser, reasoning)
    generate = ServingGenerate(engine, settings.served_model_names, registry)
    data_dir = settings.data_dir.expanduser()
    claim = BatchAPIClaim(data_dir)
    bounds = RequestBounds(engine.max_model_len)
    limits = BodyLimits.for_model(engine.max_model_len, settings.max_body_bytes, settings.max_upload_bytes)

    async def completion_line(body: dict, request_id: str) -> dict:
        bounds.completion(body)
        return await completions.create(parse_body(CompletionRequest, body, request_id))  # type: ignore[return-value]

    async def chat_line(body: dict, request_id: str) -> dict:
        bounds.chat(body)
        return await chat.create(parse_body(ChatCompletionRequest, body, request_id))  # type: ignore[return-value]

    # Run on the parsed JSON before pydantic validates the body (see limits.py).
    async def bound_completion(request: JSONRequest) -> None:
        bounds.completion(request.parsed)

    async def bound_chat(request: JSONRequest) -> None:
        bounds.chat(request.parsed)

    tokenizing = ServingTokenize(engine, chat, bounds)
    batches: BatchManager | None = None
    if claim.refusal is None:
        batches = BatchManager(
            BatchStore(data_dir / "batches"),
            FileStore(data_dir / "files"),
            {"/v1/completions": completion_line, "/v1/chat/completions": chat_line},
            settings.served_model_names[0],
        )
    else:
        logger.warning("%s", claim.refusal)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            if batches is not None:
                batches.start()
            yield
            if batches is not None:
                await batches.stop()
        finally:
            tokenizing.close()
            claim.release()

    app = FastAPI(title="seer_engine", version=package_version(), lifespan=lifespan)
    app.router.route_class = JSONRoute
    app.state.request_registry = registry
    install_error_handlers(app)

    async def respond(request: Request, work: Awaitable[dict | list | EventStream]):
        result = await until_disconnect(request, work)
        if isinstance(result, (dict, list)):
            return JSONResponse(result)
        return EventStreamResponse(result)

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "seer_engine",
            "root": name,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models", tags=["openai"], responses=ERROR_RESPONSES)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in settings.served_model_names]}

    # ``path``: served names may hold a slash ("Qwen/Qwen3-8B"), as the openai client sends them.
    @app.get("/v1/models/{model:path}", tags=["openai"], responses=ERROR_RESPONSES)
    async def retrieve_model(model: str) -> dict:
        completions.check_model(model)
        return model_card(model)

    @app.post(
        "/v1/completions",
        tags=["openai"],
        responses=ERROR_RESPONSES,
        dependencies=[Depends(bound_completion)],
    )
    async def create_completion(req: CompletionRequest, request: Request):
        return await respond(request, completions.create(req))

    @app.post(
        "/v1/chat/completions", tags=["openai"], responses=ERROR_RESPONSES, dependencies=[Depends(bound_chat)]
    )
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await respond(request, chat.create(req))

    @app.post("/generate", tags=["sglang"], responses=ERROR_RESPONSES)
    async def sglang_generate(request: JSONRequest):
        """SGLang's native generation API (serving_generate.py)."""
        body = await request.json()
        if isinstance(body, dict):
            bounds.completion({"prompt": body.get("text", body.get("input_ids"))})
        return await respond(request, generate.create(body))

    if batches is not None:
        app.include_router(files_router(batches.files, batches.reader_of))
        app.include_router(batches_router(batches))
    else:
        app.include_router(refusing_router(claim.refusal or ""))
    app.include_router(tokenize_router(tokenizing))
    app.include_router(admin_router(engine, registry.expand))
    app.add_middleware(BodySizeLimitMiddleware, limits=limits)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)  # outermost: before reading bodies
    return app


# ---------------------------------------------------------------------------------- CLI


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` (server flags plus every engine flag) on the CLI."""
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server with the Batch API and RL trainer endpoints",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/files, "
        "/v1/batches, and trainer endpoints (/update_weights_from_disk, /pause_generation, ...).",
    )
    EngineConfig.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged at start)")
    p.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (not on /health)")
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: --model)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where files and batches are kept (default: $SEER_ENGINE_CACHE/server)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body of the JSON routes (completions, chat, batches, RL endpoints), "
        "refused with 413 before it is read; default: sized to the model, "
        "max_model_len * 32 characters per token * 6 bytes per JSON-escaped character + 1 MiB",
    )
    p.add_argument(
        "--max-upload-bytes",
        type=int,
        default=DEFAULT_MAX_UPLOAD_BYTES,
        help="largest file upload (POST /v1/files, a Batch API input file); default: 200 MiB, as OpenAI",
    )
    RolloutConfig.add_cli_args(p)
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=30,
        help="seconds an idle HTTP connection stays open; longer than clients' own idle expiry "
        "(httpx: 5 s) so that the client, not the server, closes idle connections",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_S,
        help="seconds the requests in flight get to finish after a stop signal (SIGINT, SIGTERM); "
        "then each still running ends with a 503 engine_dead error. A second signal ends them at once",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="read tool calls back from chat responses to requests with tools (tool_choice 'auto'); "
        "needs --tool-call-parser",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are written in the model's text (hermes: Qwen2.5/Qwen3, Hermes)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="return a chat response's <think> block as reasoning (and reasoning_content), apart from "
        "its content",
    )
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    p.set_defaults(func=run_server)
    return p


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for flag in ("max_body_bytes", "max_upload_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: a free one), got {args.port}")
    if args.timeout_keep_alive < 0:
        raise ValueError(f"--timeout-keep-alive must be >= 0, got {args.timeout_keep_alive}")
    if not 0 <= args.drain_timeout < float("inf"):
        raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}")
    if any(not name.strip() for name in args.served_model_name or []):  # no client could name it
        raise ValueError(f"--served-model-name must not be blank, got {args.served_model_name!r}")
    if args.api_key is not None and not args.api_key.strip():  # "" turned the guard off, "  " matches nothing
        raise ValueError(
            "--api-key must not be blank (an unset variable?); leave it out to serve without one"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")
    rollout = RolloutConfig.from_cli_args(args)
    if unused := rollout.unused_flags():
        raise ValueError(
            f"{', '.join(unused)} appl{'ies' if len(unused) == 1 else 'y'} to the rollout backend, which "
            "this server, one engine, does not run: pass --rollout-mode (or --instances N > 1) too"
        )
    args.data_dir = args.data_dir or default_data_dir()
    for folder in ("", "files", "batches"):  # files and batches are kept there: checked before loading
        writable_dir(Path(args.data_dir) / folder, "--data-dir")
    if (history := rollout.history_spec(args.data_dir)) not in ("off", "memory"):
        writable_dir(history, "--history")  # named now, not once every instance has loaded
    config = EngineConfig.from_cli_args(args)
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model],
        data_dir=args.data_dir,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_upload_bytes=args.max_upload_bytes,
        rollout=rollout,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))  # before loading the model: a busy port fails fast
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    engine = build_engine_client(config, settings)
    try:
        app = create_app(engine, settings)
        host, port = sock.getsockname()[:2]
        # Always shown (tests and scripts read the address from it, e.g. with --port 0).
        r = settings.rollout
        mode = (
            f"rollout mode: {r.policy} policy, {r.instances} instance(s), {r.chunk_tokens}-token chunks"
            if r.needs_pool
            else "one engine"
        )
        print(
            f"seer_engine serve: serving {settings.served_model_names[0]} on http://{host}:{port} ({mode})",
            file=sys.stderr,
            flush=True,
        )
        server = StoppingServer(
            uvicorn.Config(
                app,
                log_level=args.log_level,
                access_log=False,
                timeout_keep_alive=args.timeout_keep_alive,
                timeout_graceful_shutdown=math.ceil(args.drain_timeout) + UVICORN_MARGIN_S,
            ),
            engine,
            args.drain_timeout,
        )
        server.run(sockets=[sock])
    finally:
        shutdown_engine(engine)
    return 0
