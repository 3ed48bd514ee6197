"""What every handler needs: the service, the caller, the body, its key.

Authentication accepts ``Authorization: Bearer <key>`` and seed 002's
``Authorization: ApiKey <key>``; what each scope may call is the one table in
``service.access``, looked up by the route that matched. Bodies are read with a
size cap and parsed strictly (``api.inputs``), so a 50 MB upload is refused
with 413 without being held whole and a NaN never reaches the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection

from batchyard.api.inputs import read_json
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.limits import Limit
from batchyard.errors import (
    InsufficientScope,
    InvalidApiKey,
    InvalidRequest,
    MissingApiKey,
    RateLimited,
)
from batchyard.service.access import access_for
from batchyard.service.deployment import service_of
from batchyard.service.idempotency import run_once
from batchyard.store import accounts

__all__ = [
    "authenticate",
    "check_tier_limits",
    "idempotent",
    "json_response",
    "read_json",
    "service_of",
]


def _presented_key(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise MissingApiKey("send your API key as `Authorization: Bearer <key>`")
    scheme, _, value = header.partition(" ")
    if scheme.lower() not in ("bearer", "apikey") or not value.strip():
        raise MissingApiKey("send your API key as `Authorization: Bearer <key>`")
    return value.strip()


async def authenticate(request: Request) -> Principal:
    """The caller, checked against the route's row of ``service.access.ACCESS``; 401 or 403."""
    route = request.scope.get("route")
    rule = access_for(request.method, getattr(route, "path", ""))
    if rule is None or rule.kind != "key":
        raise RuntimeError(f"{request.method} {getattr(route, 'path', '?')} has no key rule")
    svc = service_of(request)
    secret = _presented_key(request)

    def lookup(conn: Connection) -> Principal | None:
        return accounts.authenticate(conn, secret)

    principal = await svc.db.read(lookup)
    if principal is None:
        raise InvalidApiKey("the API key is not valid (unknown or revoked)")
    if principal.scope not in rule.scopes:
        names = ", ".join(sorted(s.value for s in rule.scopes))
        raise InsufficientScope(
            f"this call needs a key with scope {names}; this key has scope {principal.scope.value}"
        )
    if principal.scope in rule.own_only:
        principal = dataclasses.replace(principal, own_only=True)
    request.state.principal = principal
    return principal


def json_response(body: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status_code)


async def check_tier_limits(
    request: Request, principal: Principal, *, requests: float, tokens: float, kind: str = "decide"
) -> None:
    """The organisation's tier limits, shared by all its keys: 429 when over."""
    svc = service_of(request)
    tier = svc.tier(principal.tier)
    if kind == "estimate":
        limits = [(Limit("estimate_tpm", float(tier.estimate_tokens_per_minute)), tokens)]
    else:
        rpm = float(tier.requests_per_minute)
        limits = [
            # A tenth of a second of tolerance: a client pacing evenly at the
            # limit still arrives with a few ms of jitter (the server's own work
            # before this check varies), and a zero-tolerance cell turns that
            # jitter into 429s. Over any minute the slack is rpm/600 requests.
            (Limit("rpm", rpm, burst=1.0 + 0.1 * rpm / 60.0), requests),
            (Limit("tpm", float(tier.tokens_per_minute)), tokens),
        ]
    admission = await svc.limiter.try_acquire(f"org:{principal.org_id}", limits)
    if not admission.allowed:
        raise RateLimited(
            f"over your tier's limits (tier {tier.level}: {tier.requests_per_minute} requests "
            f"and {tier.tokens_per_minute} input tokens a minute); retry after the delay "
            "or move up a tier",
            retry_after=admission.retry_after,
        )


async def idempotent(
    request: Request,
    principal: Principal,
    body: Any,
    handler: Callable[[], Awaitable[tuple[int, Any]]],
    *,
    min_len: int = 1,
    required: bool = False,
) -> Response:
    """Run ``handler`` once per Idempotency-Key, replaying its saved answer (see ``run_once``).

    Without the header the handler simply runs, unless ``required``.
    """
    svc = service_of(request)
    key = request.headers.get("idempotency-key")
    if key is None:
        if required:
            raise InvalidRequest(
                "this call needs an Idempotency-Key header",
                param="Idempotency-Key",
                code="idempotency_key_required",
            )
        status, payload = await handler()
        return json_response(payload, status)
    idem_rules.validate_key(key, min_len=min_len)
    fp = idem_rules.fingerprint(request.method, request.url.path, body)
    answer = await run_once(svc, principal, key, fp, handler)
    resp = Response(answer.text, status_code=answer.status, media_type="application/json")
    if answer.replayed:
        resp.headers["Idempotent-Replayed"] = "true"
    return resp
