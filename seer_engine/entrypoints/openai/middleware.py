"""ASGI guards in front of every route: the API key and the request body size.

Both answer with OpenAI error objects before any route code runs. They are plain
ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses pass through
untouched.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from seer_engine.entrypoints.openai.errors import BodyError, error_body
from seer_engine.entrypoints.openai.limits import BodyLimits

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})


async def send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route except /health."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await send_error(send, 401, "invalid or missing API key", code="invalid_api_key")
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse a body over its route's limit (``BodyLimits``) with 413, early.

    A declared Content-Length over the limit is refused before a byte is read. The
    body is not buffered here: it streams to the route through a counting ``receive``
    that raises a 413 ``BodyError`` once the bytes read pass the limit, so a client
    that lies about, or omits, Content-Length is caught as well, and a 200 MB upload
    is never held in memory twice. (uvicorn discards the rest of a refused body.)
    """

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, source = self.limits.limit(scope["method"], scope["path"])
        too_large = BodyError(
            413,
            f"the request body is larger than {limit} bytes, the limit for {scope['path']} ({source})",
            code="request_too_large",
        )
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await send_error(send, too_large.status_code, too_large.message, too_large.code)
        size = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    raise too_large
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyError as e:  # a route that let it escape: answer here if nothing was sent
            if started or e is not too_large:
                raise
            await send_error(send, e.status_code, e.message, e.code)
