"""What every answer carries, whichever handler made it, and how every error leaves.

A small ASGI middleware around the whole app adds ``x-request-id`` (also on the
logging context, so every log line of the request names it) and, on every
answer to an authenticated caller, OpenAI's ``x-ratelimit-*`` headers. It gives
the organisation's concurrency slot back before the last byte of the answer
leaves, so a client that sends its next request the moment it has the answer
never finds its previous one still counted in flight.

Every error leaves in one envelope with a stable ``code`` (Anthropic's on its
door), FastAPI's 422 and Starlette's 404/405 included, so a client branches on
``code`` and never on prose. Every error also says ``x-should-retry``: the
OpenAI SDKs retry 409, 429 and 5xx by status unless told otherwise, so a 409
``idempotency_conflict`` would be sent twice more for nothing. A wait is sent as
``retry-after-ms`` beside ``Retry-After`` (whole seconds, rounded up so it is
never early).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchyard import logs
from batchyard.core.anthropic_bodies import error_type
from batchyard.core.clock import Clock
from batchyard.core.limits import Limit, Limiter, Standing
from batchyard.errors import (
    BatchyardError,
    InternalError,
    InvalidRequest,
    ModelWarming,
    UpstreamRateLimited,
)

__all__ = [
    "Envelope",
    "EnvelopeMiddleware",
    "HeldSlot",
    "envelope_of",
    "error_headers",
    "install_error_handlers",
]

log = logging.getLogger("batchyard.api")

_KEY = "batchyard.envelope"
_SANE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# Header names per limit name; the tier's limits are named rpm and tpm in the limiter.
_HEADER_NAMES = {"rpm": "requests", "tpm": "tokens", "estimate_tpm": "tokens"}


class HeldSlot:
    """One concurrency slot of an organisation, its lease renewed until given back."""

    def __init__(
        self, limiter: Limiter, clock: Clock, key: str, token: str, lease_s: float
    ) -> None:
        self._limiter, self._key, self._token = limiter, key, token
        self._renewer = asyncio.create_task(self._renew(clock, lease_s))
        self._released = False

    async def _renew(self, clock: Clock, lease_s: float) -> None:
        while True:
            await clock.sleep(lease_s / 3)
            await self._limiter.renew_slot(self._key, self._token, lease_s)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._renewer.cancel()
        await asyncio.shield(self._limiter.free_slot(self._key, self._token))


@dataclass
class Envelope:
    """The request's id and what its answer must say about limits."""

    request_id: str
    standing: tuple[Standing, ...] = ()
    slot: HeldSlot | None = None
    #: Set by authentication: how to look at the organisation's limits without spending.
    peek: tuple[Limiter, str, Sequence[Limit]] | None = None
    extra_headers: dict[str, str] = field(default_factory=dict)

    async def release(self) -> None:
        if self.slot is not None:
            slot, self.slot = self.slot, None
            await slot.release()


def envelope_of(request: Request) -> Envelope:
    env = request.scope.get("state", {}).get(_KEY)
    if env is None:  # an app without the middleware (a bare router in a test)
        env = Envelope(new_request_id())
        request.scope.setdefault("state", {})[_KEY] = env
    assert isinstance(env, Envelope)
    return env


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def ratelimit_headers(standing: Sequence[Standing]) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in standing:
        name = _HEADER_NAMES.get(s.name)
        if name is None:
            continue
        out[f"x-ratelimit-limit-{name}"] = str(int(s.limit))
        out[f"x-ratelimit-remaining-{name}"] = str(int(s.remaining))
        out[f"x-ratelimit-reset-{name}"] = _duration(s.reset_s)
    return out


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``0s``, ``120ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms" if seconds > 0 else "0s"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


class EnvelopeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        env = Envelope(asked if _SANE_ID.match(asked) else new_request_id())
        scope.setdefault("state", {})[_KEY] = env
        token = logs.request_id.set(env.request_id)

        started = False

        async def send_with_envelope(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                log.debug(
                    "answered", extra={"status": message["status"], "path": scope.get("path")}
                )
                headers = list(message.get("headers") or [])
                extra = {"x-request-id": env.request_id, **env.extra_headers}
                standing = env.standing or await _peek(env)
                extra.update(ratelimit_headers(standing))
                present = {k.lower() for k, _ in headers}
                for name, value in extra.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                await env.release()
            await send(message)

        try:
            await self.app(scope, receive, send_with_envelope)
        except Exception as exc:
            if client_gone(exc):
                # The client hung up (mid-body or mid-answer): no one to answer, nothing broke.
                log.info("client disconnected", extra={"event": "client_disconnected"})
                return
            # Answered here rather than by the server's last-resort handler
            # (outside this middleware), so a 500 carries its request id too.
            if started:
                raise
            log.exception("unhandled error", extra={"error_type": type(exc).__name__})
            response = error_response(InternalError("internal error; it has been logged"))
            await response(scope, receive, send_with_envelope)
        finally:
            await env.release()
            logs.request_id.reset(token)


async def _peek(env: Envelope) -> tuple[Standing, ...]:
    if env.peek is None:
        return ()
    limiter, key, limits = env.peek
    try:
        admission = await limiter.try_acquire(key, [(limit, 0.0) for limit in limits])
    except Exception:  # headers are advice; never fail an answer over them
        return ()
    return admission.standing


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

#: The codes of the errors Starlette's router raises itself (no route, wrong method).
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


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


#: The paths of Anthropic's door: its errors leave in Anthropic's envelope.
ANTHROPIC_DOOR = "/v1/messages"


def anthropic_status(exc: BatchyardError) -> int:
    """Anthropic's status for an error: 529 where the model or its upstream is overloaded."""
    return 529 if isinstance(exc, UpstreamRateLimited | ModelWarming) else exc.status


def anthropic_error(
    status: int, message: str, code: str, request_id: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    """Anthropic's error body; batchyard's stable ``code`` (and ``param``) ride beside its type."""
    error: dict[str, Any] = {
        "type": error_type(status),
        "message": message,
        "code": code,
    }
    error.update({k: v for k, v in extra.items() if k in ("param", "retry_after")})
    body: dict[str, Any] = {"type": "error", "error": error}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(exc: BatchyardError, request: Request | None = None) -> JSONResponse:
    """The error's answer: batchyard's envelope, or Anthropic's on its door (and its header)."""
    status, body, headers = exc.status, exc.to_body(), error_headers(exc)
    if request is not None and request.url.path.startswith(ANTHROPIC_DOOR):
        status, request_id = anthropic_status(exc), envelope_of(request).request_id
        body = anthropic_error(status, exc.message, exc.code, request_id, body["error"])
        headers["request-id"] = request_id
    return JSONResponse(_encodable(body), status_code=status, headers=headers)


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
    async def _batchyard(request: Request, exc: BatchyardError) -> JSONResponse:
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc or 'request'}: {first.get('msg', 'invalid')}"
        return error_response(InvalidRequest(message, param=loc or None), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "http_error")
        error = BatchyardError(str(exc.detail), code=code, status=exc.status_code)
        response = error_response(error, request)
        if exc.status_code == 405:
            response.headers["Allow"] = allowed_methods(request)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if client_gone(exc):
            log.info("client disconnected", extra={"event": "client_disconnected"})
            return error_response(InternalError("the client disconnected"), request)
        log.exception("unhandled error", extra={"error_type": type(exc).__name__})
        return error_response(InternalError("internal error; it has been logged"), request)
