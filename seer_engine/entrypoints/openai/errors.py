"""Every failure becomes an OpenAI error object with a fitting status code.

Bad input is always a 4xx: malformed JSON, a body of the wrong shape or a refused value
400 (as OpenAI and vLLM answer them, so clients raise ``BadRequestError``), a body not sent
as JSON 415, unknown ids 404, state conflicts 409. Only a bug is a 500.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from seer_engine.engine.client import EngineBusyError, EngineDeadError
from seer_engine.sampling_params import InvalidRequestError

M = TypeVar("M", bound=BaseModel)

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to return as-is to the client."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class BodyError(StarletteHTTPException):
    """A request body refused while it is read or parsed (too large, not UTF-8, not JSON,
    too deep, a lone surrogate, a non-finite number).

    An HTTPException so that FastAPI's body reading passes it through unchanged (it
    turns other exceptions into a generic "error parsing the body").
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message)
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def as_api_error(exc: BaseException) -> APIError:
    """Map engine-side exceptions to client errors (used by batches as well as routes)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineBusyError):
        return APIError(409, str(exc), code="engine_busy")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, ValueError):  # ModelLoadError and other refusals of a value
        return APIError(400, str(exc))
    logger.error("internal error", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")


def invalid_body(exc: ValidationError, prefix: str = "") -> APIError:
    """A body validated outside a route's signature (batch lines, /tokenize's two shapes)
    refused as a route's body is: a 400 naming the first field at fault (``prefix``: where
    the validated part sits in the body, e.g. ``sampling_params.``)."""
    first = exc.errors()[0] if exc.errors() else {}
    where = prefix + (".".join(str(p) for p in first.get("loc", ())) or "body")
    return APIError(400, f"{where}: {first.get('msg', 'invalid')}", param=where)


def validate_body(model: type[M], body: Any, prefix: str = "") -> M:
    """``body`` as ``model``, or the 400 ``invalid_body`` makes of what is wrong with it."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_body(e, prefix) from None


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "the request body is not valid JSON", None
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "finite_number":
        return 400, f"{param or 'body'} must be a finite number, got {first.get('input')}", param
    parts = []
    for e in errors[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return 400, "; ".join(parts) or "invalid request body", param


def _not_json(content_type: str | None) -> JSONResponse:
    """A body of a JSON route sent under another Content-Type, or none (``curl -d`` sends
    a form's, ``requests.post(data=...)`` none): FastAPI leaves it unparsed (its strict
    content type, which keeps browsers' cross-site form posts out), so say that."""
    sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
    message = f"the body must be JSON sent with Content-Type: application/json; this request has {sent}"
    return error_response(415, message, code="unsupported_media_type")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    async def on_engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)
        return error_response(err.status, err.message, err.param, err.code)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes):  # a body FastAPI did not parse: not sent as JSON
            return _not_json(request.headers.get("content-type"))
        status, message, param = _validation_message(exc)
        return error_response(status, message, param)

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyError):
            return error_response(exc.status_code, exc.message, exc.param, exc.code)
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(InvalidRequestError, on_engine_error)
    app.add_exception_handler(EngineBusyError, on_engine_error)
    app.add_exception_handler(EngineDeadError, on_engine_error)
    app.add_exception_handler(ValueError, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # A bug: still an OpenAI error object (500, logged), not Starlette's plain-text page.
    app.add_exception_handler(Exception, on_engine_error)
