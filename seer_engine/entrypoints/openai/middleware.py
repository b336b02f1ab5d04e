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

from seer_engine.entrypoints.openai.errors import error_body

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
    """Refuse bodies over ``max_bytes`` with 413, by Content-Length or while reading.

    The body is read here (up to the limit) and replayed to the route, so a client
    that lies about, or omits, Content-Length is caught as well.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, self._message(), code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending the body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await send_error(send, 413, self._message(), code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as ASGI does

        await self.app(scope, replay, send)

    def _message(self) -> str:
        return f"request body exceeds the limit of {self.max_bytes} bytes"
