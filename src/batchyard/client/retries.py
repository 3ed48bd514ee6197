"""What the sync and async clients share: settings, the retry step, error mapping.

Both clients build the same ``Call`` for an endpoint (see ``calls.py``) and
differ only in how they send it and how they wait; the sync client is even
generated from the async one. Every decision about a failed attempt (try
again or not, how long to wait, and whether the wait belongs to the shared
pacer) is ``RetryPolicy.step`` here, so a retry rule changes in one place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchyard.errors import BatchyardError, error_class_for_code

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_TIMEOUT_S",
    "REPLAYED",
    "USER_AGENT",
    "Call",
    "ClientSettings",
    "ConnectionFailed",
    "ReadTimedOut",
    "RetryPolicy",
    "RetryStep",
    "connection_failed",
    "decode",
    "error_from_response",
    "log_retry",
    "new_idempotency_key",
    "request_kwargs",
    "retry_after_of",
]

_log = logging.getLogger("batchyard.client")

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
#: ``error.details[REPLAYED]`` is True when the server replayed a saved failure.
REPLAYED = "idempotent_replayed"
DEFAULT_TIMEOUT_S = 120.0
USER_AGENT = "batchyard-client/0.1"


class ConnectionFailed(BatchyardError):
    """The gateway could not be reached (or the connection broke) after the retries.

    Not a wire code a server sends: it stands for "no answer at all", which a
    caller handles like a retryable error with the same idempotency key.
    """

    code = "connection_error"
    status = 0
    retryable = True


class ReadTimedOut(ConnectionFailed):
    """The request went out but no answer came within the client's timeout.

    Unlike a refused connection, the server may well be working on it: sent
    again with the same idempotency key, it answers the saved result or 409
    ``idempotency_in_progress`` until the first attempt finishes.
    """

    code = "read_timeout"


def new_idempotency_key() -> str:
    """A fresh key for one logical request; the retries of that request reuse it."""
    return f"by-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Call:
    """One request, independent of the transport that will send it."""

    method: str
    path: str
    json: Any = None
    params: Mapping[str, str] | None = None
    idempotency_key: str | None = None
    #: Calls that count against the requests limit; a client's pacer waits before them.
    paced: bool = False
    #: Token cost for the pacer's tokens-per-minute budget, when known.
    tokens: int = 0
    #: A raw body and its media type, sent as is (an uploaded file), instead of ``json``.
    content: tuple[bytes, str] | None = None


@dataclass
class ClientSettings:
    """Where to send requests and as whom; the key never appears in ``repr``."""

    base_url: str
    api_key: str | None = field(repr=False)
    timeout: float = DEFAULT_TIMEOUT_S

    @classmethod
    def resolve(
        cls, base_url: str | None, api_key: str | None, timeout: float | None
    ) -> ClientSettings:
        url = base_url or os.environ.get("BATCHYARD_BASE_URL") or DEFAULT_BASE_URL
        key = api_key if api_key is not None else os.environ.get("BATCHYARD_API_KEY")
        if timeout is None and os.environ.get("BATCHYARD_TIMEOUT"):
            # A read timeout never fails a text (the runner waits for the server's
            # answer under the same key); it only says how long one wait lasts.
            timeout = float(os.environ["BATCHYARD_TIMEOUT"])
        return cls(url.rstrip("/"), key or None, timeout or DEFAULT_TIMEOUT_S)

    def headers(self, call: Call) -> dict[str, str]:
        out = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        if call.idempotency_key is not None:
            out["Idempotency-Key"] = call.idempotency_key
        return out


@dataclass(frozen=True)
class RetryPolicy:
    """When to try a request again and how long to wait first.

    Only errors the server marks retryable (and broken connections) are
    retried: anything else needs the caller to change the request, so trying
    again would only return the same failure. A Retry-After longer than
    ``max_wait`` is not waited out: the error goes back to the caller, who
    may have better things to do than block for minutes.
    """

    max_retries: int = 2
    backoff_base: float = 0.5
    backoff_max: float = 8.0
    max_wait: float = 120.0

    def delay(self, attempt: int, error: BatchyardError) -> float | None:
        """Seconds to wait before retry number ``attempt + 1``, or None to give up."""
        if attempt >= self.max_retries or not error.retryable:
            return None
        if error.retry_after is not None:
            wait = float(error.retry_after)
            return wait if wait <= self.max_wait else None
        # Full jitter: spreads the retries of many workers that failed together.
        cap = min(self.backoff_max, self.backoff_base * (2**attempt))
        return random.uniform(cap / 2, cap)

    def step(
        self, attempt: int, error: BatchyardError, *, slot: float | None = None
    ) -> RetryStep | None:
        """What to do after failed attempt number ``attempt`` (0 for the first).

        ``slot`` is the pacer's interval for this call when the call is paced,
        None otherwise. None back means give up and raise ``error``.
        """
        delay = self.delay(attempt, error)
        if delay is None:
            return None
        if slot is None or error.status != 429:
            return RetryStep(attempt + 1, delay, pacer=False, slow=False)
        # The pacer's next wait() does the waiting, for every worker at once.
        # A wait under half a slot is timing noise (the server's own work
        # before its limit check varies by milliseconds), not a sign that
        # someone else shares the limit: hold the pace, but do not slow it.
        return RetryStep(attempt + 1, delay, pacer=True, slow=delay >= slot / 2)


@dataclass(frozen=True)
class RetryStep:
    """One decided retry: which one it is, and who waits how long before it.

    With ``pacer`` set, the client hands the wait to its pacer
    (``push_back(delay, slow=slow)``) so every worker sharing the pace holds
    back; otherwise the client sleeps ``delay`` itself.
    """

    attempt: int
    delay: float
    pacer: bool
    slow: bool


def log_retry(call: Call, error: BatchyardError, step: RetryStep) -> None:
    """One line per retry, in the same shape from both clients."""
    _log.info(
        "retrying",
        extra={
            "method": call.method,
            "path": call.path,
            "code": error.code,
            "status": error.status,
            "attempt": step.attempt,
            "delay_s": round(step.delay, 3),
        },
    )


def retry_after_of(response: httpx.Response) -> float | None:
    """Retry-After as seconds (the gateway sends whole seconds; dates are not used)."""
    raw = response.headers.get("Retry-After")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return max(0.0, value) if math.isfinite(value) else None


def error_from_response(response: httpx.Response) -> BatchyardError:
    """Rebuild the typed error a server answered, keeping its code and retryability."""
    body: Any
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    retry_after = retry_after_of(response)
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        # Not our wire format (a proxy in between, say): judge by the status.
        retryable = response.status_code in (429, 502, 503, 504)
        return BatchyardError(
            f"HTTP {response.status_code} without an error body",
            code="http_error",
            status=response.status_code,
            retryable=retryable,
            retry_after=retry_after,
        )
    code: str = err["code"]
    exact = err.get("retry_after")
    if isinstance(exact, int | float) and not isinstance(exact, bool) and math.isfinite(exact):
        # The header is rounded up to whole seconds (at least 1); the body keeps
        # the limiter's own figure. Under a limit of 1,200 a minute the next slot
        # is 50 ms away, so waiting the header's full second would idle twenty
        # slots for every 429.
        retry_after = max(0.0, float(exact))
    known = {"code", "type", "message", "retryable", "param", "retry_after"}
    details = {k: v for k, v in err.items() if k not in known}
    if response.headers.get("Idempotent-Replayed") == "true":
        # A failure saved under the key by an earlier request, sent back as it
        # was: whatever changed since (credit bought, say), this key will only
        # ever return it. Kept in ``details`` so callers can choose a new key.
        details[REPLAYED] = True
    cls = error_class_for_code(code)
    flag = err.get("retryable")
    return cls(
        str(err.get("message") or code),
        param=err.get("param") if isinstance(err.get("param"), str) else None,
        retry_after=retry_after,
        details=details,
        code=code,
        status=response.status_code,
        retryable=flag if isinstance(flag, bool) else None,
    )


def connection_failed(exc: httpx.TransportError, base_url: str) -> ConnectionFailed:
    """No answer at all, as an error a caller can retry with the same key."""
    if isinstance(exc, httpx.ReadTimeout):
        return ReadTimedOut(f"no answer from {base_url} in time: {type(exc).__name__}")
    return ConnectionFailed(f"could not talk to {base_url}: {type(exc).__name__}: {exc}")


def request_kwargs(settings: ClientSettings, call: Call) -> dict[str, Any]:
    """Arguments for ``httpx.(Async)Client.request`` shared by both clients."""
    kwargs: dict[str, Any] = {
        "headers": settings.headers(call),
        "params": dict(call.params) if call.params else None,
    }
    if call.content is not None:
        body, media_type = call.content
        kwargs["content"] = body
        kwargs["headers"]["Content-Type"] = media_type
    elif call.json is not None:
        kwargs["json"] = call.json
    return kwargs


def decode(response: httpx.Response) -> Any:
    """The JSON body, or None for an empty one (a 204, say)."""
    if not response.content:
        return None
    return response.json()
