"""What every handler needs: the service, the caller, the body, its key.

Authentication accepts ``Authorization: Bearer <key>`` and the runs API's
``Authorization: ApiKey <key>`` (and, at Anthropic's door, ``x-api-key``);
what each scope may call is the one table in ``service.access``, looked up by
the route that matched. Bodies are read with a size cap and parsed strictly
(``api.inputs``), so a 50 MB upload is refused with 413 without being held
whole and a NaN never reaches the store.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import Connection

from batchyard.api.envelope import HeldSlot, envelope_of
from batchyard.api.inputs import read_json
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.limits import Limit
from batchyard.core.tiers import Tier
from batchyard.errors import (
    InsufficientScope,
    InvalidApiKey,
    InvalidRequest,
    MissingApiKey,
    RateLimited,
)
from batchyard.service.access import access_for
from batchyard.service.deployment import Service, service_of
from batchyard.service.idempotency import Stream, run_once, unkeyed
from batchyard.store import accounts

__all__ = [
    "ServiceDep",
    "authenticate",
    "check_tier_limits",
    "idempotent",
    "json_response",
    "read_json",
    "service_of",
]


async def _service(request: Request) -> Service:
    # A coroutine, so FastAPI calls it on the loop rather than in its thread pool.
    return service_of(request)


#: The deployment's service as a handler parameter (``svc: ServiceDep``), so a
#: handler gets it once, from FastAPI, instead of digging it out of the request.
ServiceDep = Annotated[Service, Depends(_service)]


def _presented_key(request: Request, x_api_key: bool) -> str:
    if x_api_key and (value := request.headers.get("x-api-key", "").strip()):
        return value
    hint = "`x-api-key: <key>` or " if x_api_key else ""
    header = request.headers.get("authorization")
    if not header:
        raise MissingApiKey(f"send your API key as {hint}`Authorization: Bearer <key>`")
    scheme, _, value = header.partition(" ")
    if scheme.lower() not in ("bearer", "apikey") or not value.strip():
        raise MissingApiKey(f"send your API key as {hint}`Authorization: Bearer <key>`")
    return value.strip()


async def authenticate(request: Request, *, x_api_key: bool = False) -> Principal:
    """The caller, checked against the route's row of ``service.access.ACCESS``; 401 or 403.

    ``x_api_key``: also take the key from Anthropic's ``x-api-key`` header (its door).
    """
    route = request.scope.get("route")
    rule = access_for(request.method, getattr(route, "path", ""))
    if rule is None or rule.kind != "key":
        raise RuntimeError(f"{request.method} {getattr(route, 'path', '?')} has no key rule")
    svc = service_of(request)
    secret = _presented_key(request, x_api_key)

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
    tier = svc.tier(principal.tier)
    limits = [limit for limit, _ in tier_limits(tier, 0.0)]
    envelope_of(request).peek = (svc.limiter, f"org:{principal.org_id}", limits)
    return principal


EVENT_STREAM = "text/event-stream"

#: How long past its time a refused request's place in line waits for it to come back.
LINE_HOLD_S = 5.0


def json_response(body: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status_code)


def tier_limits(tier: Tier, tokens: float) -> list[tuple[Limit, float]]:
    """A tier's requests and tokens limits, for one request of ``tokens`` input tokens.

    Both tolerate a burst of the tier's concurrency: that many requests may
    start at once (and that many average-sized requests' tokens), so a client
    that keeps at most ``concurrency`` calls in flight and stays under the
    rates over the minute is never refused.
    """
    burst = float(tier.max_in_flight)
    rpm, tpm = float(tier.requests_per_minute), float(tier.tokens_per_minute)
    return [
        (Limit("rpm", rpm, burst=burst), 1.0),
        (Limit("tpm", tpm, burst=max(1.0, burst * tpm / rpm)), tokens),
    ]


async def check_tier_limits(
    request: Request, principal: Principal, *, requests: float, tokens: float, kind: str = "decide"
) -> None:
    """The organisation's tier limits, shared by all its keys: 429 when over.

    A model call takes one of the tier's concurrency slots (held until its
    answer is sent, see ``api.envelope``) and its place in the requests and
    tokens schedules. A call that would be admitted within the deployment's
    ``limits_queue_s`` waits for its turn here instead of being refused; past
    that it is a 429 whose ``retry_after`` is when it would be admitted.
    """
    svc = service_of(request)
    tier = svc.tier(principal.tier)
    env = envelope_of(request)
    key = f"org:{principal.org_id}"
    if kind == "estimate":
        # Like the tokens limit: a burst of ``concurrency`` average requests.
        per_minute = float(tier.estimate_tokens_per_minute)
        burst = max(1.0, tier.max_in_flight * per_minute / tier.requests_per_minute)
        limit = Limit("estimate_tpm", per_minute, burst=burst)
        admission = await svc.limiter.try_acquire(
            key, [(limit, tokens)], max_delay=svc.settings.limits_queue_s
        )
        # Its x-ratelimit-*-tokens headers are the estimate budget it spent from.
        env.standing = admission.standing
        if not admission.allowed:
            raise RateLimited(
                f"over your tier's estimate budget ({tier.estimate_tokens_per_minute} tokens "
                "a minute); retry after the delay",
                retry_after=admission.retry_after,
            )
        if admission.delay > 0:
            await svc.clock.sleep(admission.delay)
        return
    queue_s = svc.settings.limits_queue_s
    limits = tier_limits(tier, tokens)
    limits[0] = (limits[0][0], requests)
    # Its place in the schedule first: a request refused now is given a place in
    # line (``Limiter.try_acquire(hold_s=)``), so each refused caller of a burst
    # is told its own time and their retries come back spread, not together.
    admission = await svc.limiter.try_acquire(
        key, limits, max_delay=queue_s, hold_s=max(queue_s, LINE_HOLD_S)
    )
    env.standing = admission.standing
    if not admission.allowed:
        raise RateLimited(
            f"over your tier's limits (tier {tier.level}: {tier.requests_per_minute} requests "
            f"and {tier.tokens_per_minute} input tokens a minute); your place in line is "
            "kept: retry after the delay, or move up a tier",
            retry_after=admission.retry_after,
            details={
                "limit": {"rpm": "requests", "tpm": "tokens"}.get(str(admission.limit))
                or "upstream"
            },
        )
    if admission.delay > 0:
        await svc.clock.sleep(admission.delay)
    # Then a concurrency slot, held while it is in flight (not while it waits its turn).
    grant = await svc.limiter.occupy(
        key, tier.max_in_flight, svc.settings.slot_lease_s, max_wait=queue_s
    )
    if grant.token is None:
        for limit, cost in limits:
            await svc.limiter.adjust(key, limit, -cost)
        raise RateLimited(
            f"{grant.in_use} requests of your organisation are in flight, the most tier "
            f"{tier.level} allows at once ({tier.max_in_flight}); send the next when one "
            "finishes",
            retry_after=1.0,
            details={"limit": "concurrency"},
        )
    env.slot = HeldSlot(svc.limiter, svc.clock, key, grant.token, svc.settings.slot_lease_s)


async def idempotent(
    request: Request,
    principal: Principal,
    body: Any,
    handler: Callable[[], Awaitable[tuple[int, Any]]],
    *,
    min_len: int = 1,
    required: bool = False,
    answers_text: bool = True,
    stream_replay: Callable[[Any], bytes] | None = None,
) -> Response:
    """Run ``handler`` once per Idempotency-Key, replaying its saved answer (see ``run_once``).

    Without the header the handler simply runs, unless ``required``.
    ``answers_text=False`` marks an answer with no customer text in it (a
    submission's batch object), kept even under zero data retention. A
    handler that answers with a ``Stream`` is sent as server-sent events, and
    ``stream_replay`` writes its saved answer back as the stream it was.
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
        if isinstance(payload, Stream):
            return StreamingResponse(unkeyed(payload), status, media_type=EVENT_STREAM)
        return json_response(payload, status)
    idem_rules.validate_key(key, min_len=min_len)
    fp = idem_rules.fingerprint(request.method, request.url.path, body)
    answer = await run_once(svc, principal, key, fp, handler, answers_text=answers_text)
    if answer.stream is not None:
        return StreamingResponse(answer.stream, answer.status, media_type=EVENT_STREAM)
    if answer.replayed and answer.status == 200 and stream_replay is not None:
        resp = Response(stream_replay(json.loads(answer.text)), media_type=EVENT_STREAM)
    else:
        resp = Response(answer.text, status_code=answer.status, media_type="application/json")
    if answer.replayed:
        resp.headers["Idempotent-Replayed"] = "true"
    return resp
