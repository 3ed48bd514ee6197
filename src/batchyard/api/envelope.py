"""What every answer carries, whichever handler made it.

A small ASGI middleware around the whole app:

- ``x-request-id``: the id of this request (the caller's own, when it sent a
  sane one, else a new ``req_…``), also put on the logging context so every log
  line the request writes names it;
- ``x-ratelimit-limit|remaining|reset-requests`` and ``-tokens``: where the
  caller's organisation stands against its tier, OpenAI's way, on every answer
  to an authenticated caller (from the check the request made, or a look that
  consumes nothing);
- the organisation's concurrency slot, given back before the last byte of the
  answer leaves, so a client that sends its next request the moment it has the
  answer never finds its own previous request still counted in flight. A
  stream holds its slot until its last event; a client that hangs up frees it
  at once.

Handlers reach the request's ``Envelope`` through ``envelope_of``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchyard import logs
from batchyard.api.errors import client_gone, error_response
from batchyard.core.clock import Clock
from batchyard.core.limits import Limit, Limiter, Standing
from batchyard.errors import InternalError

__all__ = [
    "Envelope",
    "EnvelopeMiddleware",
    "HeldSlot",
    "envelope_of",
    "ratelimit_headers",
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
                    "answered",
                    extra={"status": message["status"], "path": scope.get("path")},
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
