"""Every error leaves as ``{"error": {"code", "type", "message", "retryable"}}``.

FastAPI's own 422 for a malformed body and Starlette's 404/405 are mapped to
the same shape, so a client branches on ``code`` (or on OpenAI's ``type``) and
never on prose. A 405 says in ``Allow`` which methods the path takes.

Every error also says ``x-should-retry``: the OpenAI SDKs (and the clients
built on them) retry 408, 409, 429 and 5xx by status unless this header says
otherwise, so a 409 ``idempotency_conflict`` would be sent twice more for
nothing. It is ``true`` exactly where sending the same request again soon can
succeed. A wait is sent as ``retry-after-ms`` (exact) beside ``Retry-After``
(whole seconds, rounded up so it is never early).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from batchyard.errors import BatchyardError, InternalError, error_type

__all__ = [
    "HTTP_CODES",
    "allowed_methods",
    "client_gone",
    "error_response",
    "install_error_handlers",
]

_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

#: The codes of the errors Starlette's router raises itself (no route, wrong method).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}

log = logging.getLogger("batchyard.api")


def _encodable(value: Any) -> Any:
    """A body that always encodes: a message that echoes input may hold a lone surrogate."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    return value


def should_retry(exc: BatchyardError) -> bool:
    """Whether an immediate retry of the same request can succeed.

    A 402 is retryable in the documented sense (after buying credit, the same key
    succeeds) but not soon: an SDK's automatic retries would only be refused again.
    """
    return exc.retryable and exc.status != 402


def error_headers(exc: BatchyardError) -> dict[str, str]:
    headers = {"x-should-retry": "true" if should_retry(exc) else "false"}
    if exc.retry_after is not None:
        wait = max(0.0, exc.retry_after)
        headers["Retry-After"] = str(max(1, math.ceil(wait)))
        headers["retry-after-ms"] = str(math.ceil(wait * 1000))
    return headers


def error_response(exc: BatchyardError) -> JSONResponse:
    return JSONResponse(
        _encodable(exc.to_body()), status_code=exc.status, headers=error_headers(exc)
    )


#: What reading a body from, or sending an answer to, a client that hung up raises:
#: Starlette's ``ClientDisconnect``, uvicorn's ``ClientDisconnected`` (an ``OSError``),
#: and anyio's closed-stream errors.
_GONE = ("ClientDisconnect", "ClientDisconnected")


def client_gone(exc: BaseException) -> bool:
    """Whether ``exc`` only says the client went away (a stream cut, a body never finished)."""
    if isinstance(exc, ClientDisconnect | anyio.EndOfStream | anyio.BrokenResourceError):
        return True
    return type(exc).__name__ in _GONE


def allowed_methods(request: Request) -> str:
    """The ``Allow`` of a 405: every method some route of this path takes.

    Starlette's own header names the methods of the first route that matched the
    path, but a path served by two routes (``GET`` and ``POST /v1/batches``) has
    both, and FastAPI nests included routers; so each method is tried on the router.
    """
    routes = request.app.router.routes
    methods = {
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    }
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BatchyardError)
    async def _batchyard(_: Request, exc: BatchyardError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        body = {
            "error": {
                "code": "invalid_request",
                "type": error_type(400),
                "message": f"{loc or 'request'}: {first.get('msg', 'invalid')}",
                "retryable": False,
                "param": loc or None,
            }
        }
        return JSONResponse(body, status_code=400, headers={"x-should-retry": "false"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "http_error")
        body = {
            "error": {
                "code": code,
                "type": error_type(exc.status_code),
                "message": str(exc.detail),
                "retryable": False,
            }
        }
        headers = {"x-should-retry": "false"}
        if exc.status_code == 405:
            headers["Allow"] = allowed_methods(request)
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        if client_gone(exc):
            log.info("client disconnected", extra={"event": "client_disconnected"})
            return error_response(InternalError("the client disconnected"))
        log.exception("unhandled error", extra={"error_type": type(exc).__name__})
        return error_response(InternalError("internal error; it has been logged"))
