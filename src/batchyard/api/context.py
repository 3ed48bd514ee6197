"""What every handler needs: the service, the caller, the body, its IDs, its key.

What each scope may call is the one table in ``service.access``, looked up by
the route that matched. Everything a handler reads from a request is read here,
so the rules are the same at every door and a malformed request is a coded 400
(or 404, 413, 415) before anything is claimed, charged or written: a body is read
with a size cap (a 50 MB upload is refused without being held whole) and parsed
strictly (``core.inputs``); paging parameters are never clamped; an ID in a path
that cannot name anything is 404 before the store is asked.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from collections.abc import Awaitable, Callable
from typing import IO, Annotated, Any

from fastapi import Depends, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import Connection

from batchyard.api.envelope import ANTHROPIC_DOOR, HeldSlot, envelope_of
from batchyard.core import idempotency as idem_rules
from batchyard.core.accounts import Principal
from batchyard.core.ids import is_id
from batchyard.core.inputs import parse_json, printable
from batchyard.core.limits import Limit
from batchyard.core.tiers import Tier
from batchyard.errors import (
    InsufficientScope,
    InvalidApiKey,
    InvalidJson,
    InvalidRequest,
    MissingApiKey,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    UnknownField,
    UnsupportedMediaType,
)
from batchyard.service.access import access_for
from batchyard.service.deployment import Service, service_of
from batchyard.service.idempotency import Stream, run_once, unkeyed
from batchyard.service.uploads import Upload, read_multipart
from batchyard.store import accounts

__all__ = [
    "Caller",
    "Empty",
    "ServiceDep",
    "allow_query",
    "authenticate",
    "camel_page",
    "check_tier_limits",
    "finished_query",
    "listing",
    "once",
    "path_id",
    "query_cursor",
    "query_id_cursor",
    "query_limit",
    "read_empty",
    "read_json",
    "read_upload",
    "row_id",
]

#: Row IDs are 32-bit integers in the store (PostgreSQL ``integer``).
MAX_ROW_ID = 2**31 - 1
_DIGITS = re.compile(r"[0-9]{1,10}")
_JSON_TYPE = re.compile(r"application/(?:[a-z0-9.+-]+\+)?json")
EVENT_STREAM = "text/event-stream"
#: Multipart framing around an upload's file part, allowed on top of the file limit.
_SLACK = 64 * 1024
#: How long past its time a refused request's place in line waits for it to come back.
LINE_HOLD_S = 5.0


async def _service(request: Request) -> Service:
    # A coroutine, so FastAPI calls it on the loop rather than in its thread pool.
    return service_of(request)


#: The deployment's service as a handler parameter (``svc: ServiceDep``).
ServiceDep = Annotated[Service, Depends(_service)]


def _presented_key(request: Request, x_api_key: bool) -> str:
    if x_api_key and (value := request.headers.get("x-api-key", "").strip()):
        return value
    header = request.headers.get("authorization") or ""
    scheme, _, value = header.partition(" ")
    if scheme.lower() not in ("bearer", "apikey") or not value.strip():
        hint = "`x-api-key: <key>` or " if x_api_key else ""
        raise MissingApiKey(f"send your API key as {hint}`Authorization: Bearer <key>`")
    return value.strip()


async def authenticate(request: Request) -> Principal:
    """The caller, checked against the route's row of ``service.access.ACCESS``; 401 or 403.

    At Anthropic's door the key may also come as its ``x-api-key`` header.
    """
    route = request.scope.get("route")
    rule = access_for(request.method, getattr(route, "path", ""))
    if rule is None or rule.kind != "key":
        raise RuntimeError(f"{request.method} {getattr(route, 'path', '?')} has no key rule")
    svc = service_of(request)
    secret = _presented_key(request, request.url.path.startswith(ANTHROPIC_DOOR))

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
    limits = [limit for limit, _ in tier_limits(svc.tier(principal.tier), 0.0)]
    envelope_of(request).peek = (svc.limiter, f"org:{principal.org_id}", limits)
    return principal


#: The authenticated caller as a handler parameter; put it first, so a request without a
#: key is 401 before its IDs are looked at.
Caller = Annotated[Principal, Depends(authenticate)]


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
    request: Request, principal: Principal, *, tokens: float, kind: str = "decide"
) -> None:
    """The organisation's tier limits, shared by all its keys: 429 when over.

    A model call takes one of the tier's concurrency slots (held until its
    answer is sent, see ``api.envelope``) and its place in the requests and
    tokens schedules. A call that would be admitted within the deployment's
    ``limits_queue_s`` waits for its turn here instead of being refused; past
    that it is a 429 whose ``retry_after`` is when it would be admitted. An
    estimate spends only from the tier's estimate budget.
    """
    svc = service_of(request)
    tier = svc.tier(principal.tier)
    env = envelope_of(request)
    key = f"org:{principal.org_id}"
    queue_s = svc.settings.limits_queue_s
    estimate = kind == "estimate"
    if estimate:
        # Like the tokens limit: a burst of ``concurrency`` average requests.
        per_minute = float(tier.estimate_tokens_per_minute)
        burst = max(1.0, tier.max_in_flight * per_minute / tier.requests_per_minute)
        limits = [(Limit("estimate_tpm", per_minute, burst=burst), float(tokens))]
    else:
        limits = tier_limits(tier, tokens)
    # A request refused now is given a place in line (``Limiter.try_acquire(hold_s=)``),
    # so each refused caller of a burst is told its own time and their retries come
    # back spread, not together.
    hold_s = 0.0 if estimate else max(queue_s, LINE_HOLD_S)
    admission = await svc.limiter.try_acquire(key, limits, max_delay=queue_s, hold_s=hold_s)
    # Its x-ratelimit-* headers are the budget it spent from.
    env.standing = admission.standing
    if not admission.allowed and estimate:
        raise RateLimited(
            f"over your tier's estimate budget ({tier.estimate_tokens_per_minute} tokens "
            "a minute); retry after the delay",
            retry_after=admission.retry_after,
        )
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
    if estimate:
        return
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


async def once(
    request: Request,
    principal: Principal,
    body: Any,
    answer: Callable[[], Awaitable[Any]],
    *,
    status: int = 200,
    min_len: int = 1,
    required: bool = False,
    answers_text: bool = True,
    stream_replay: Callable[[Any], bytes] | None = None,
) -> Response:
    """``answer`` once per Idempotency-Key, its saved answer replayed (see ``run_once``).

    Without the header it simply runs, unless ``required``; its body leaves
    with ``status``. ``answers_text=False`` marks an answer with no customer
    text in it (a submission's batch object), kept even under zero data
    retention. An answer that is a ``Stream`` is sent as server-sent events,
    and ``stream_replay`` writes its saved answer back as the stream it was.
    """
    key = request.headers.get("idempotency-key")
    if key is None:
        if required:
            raise InvalidRequest(
                "this call needs an Idempotency-Key header",
                param="Idempotency-Key",
                code="idempotency_key_required",
            )
        payload = await answer()
        if isinstance(payload, Stream):
            return StreamingResponse(unkeyed(payload), status, media_type=EVENT_STREAM)
        return JSONResponse(payload, status)
    idem_rules.validate_key(key, min_len=min_len)
    fp = idem_rules.fingerprint(request.method, request.url.path, body)

    async def handler() -> tuple[int, Any]:
        return status, await answer()

    svc = service_of(request)
    saved = await run_once(svc, principal, key, fp, handler, answers_text=answers_text)
    if saved.stream is not None:
        return StreamingResponse(saved.stream, saved.status, media_type=EVENT_STREAM)
    if saved.replayed and saved.status == 200 and stream_replay is not None:
        resp = Response(stream_replay(json.loads(saved.text)), media_type=EVENT_STREAM)
    else:
        resp = Response(saved.text, status_code=saved.status, media_type="application/json")
    if saved.replayed:
        resp.headers["Idempotent-Replayed"] = "true"
    return resp


def listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """A page of objects as OpenAI lists them."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


def camel_page(items: list[Any], limit: int, cursor: Callable[[Any], str]) -> dict[str, Any]:
    """A page as the runs API writes it: ``limit + 1`` items were read, ``limit`` are shown."""
    more = len(items) > limit
    last = cursor(items[limit - 1]) if more else None
    return {"object": "list", "data": items[:limit], "hasMore": more, "nextCursor": last}


# -- bodies ---------------------------------------------------------------------


def json_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``…+json``, UTF-8)."""
    header = request.headers.get("content-type")
    if header is None:
        raise UnsupportedMediaType(
            "send the body with Content-Type: application/json", param="Content-Type"
        )
    media, _, params = header.partition(";")
    if not _JSON_TYPE.fullmatch(media.strip().lower()):
        raise UnsupportedMediaType(
            f"this call reads JSON; Content-Type {media.strip()[:60]!r} is not application/json",
            param="Content-Type",
        )
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            raise UnsupportedMediaType(
                "JSON bodies are UTF-8; send charset=utf-8 or no charset", param="Content-Type"
            )


async def _read_bytes(request: Request, cap: int) -> bytes:
    """The raw body, refused with 413 as soon as it passes ``cap`` bytes."""
    declared = request.headers.get("content-length")
    if declared and _DIGITS.fullmatch(declared) and int(declared) > cap:
        raise PayloadTooLarge(f"the request body is over {cap} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise PayloadTooLarge(f"the request body is over {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, *, limit: int | None = None) -> Any:
    """The body as one strict JSON object, declared ``application/json``, size-capped."""
    json_content_type(request)
    cap = limit or service_of(request).settings.max_body_bytes
    body = parse_json(await _read_bytes(request, cap), request=True)
    if not isinstance(body, dict):
        raise InvalidJson("the request body must be a JSON object")
    return body


async def read_empty(request: Request) -> dict[str, Any]:
    """A call that takes no body: nothing, or ``{}``; any field is refused by name."""
    raw = await _read_bytes(request, 64 * 1024)
    if not raw.strip():
        return {}
    json_content_type(request)
    body = parse_json(raw, request=True)
    if not isinstance(body, dict):
        raise InvalidJson("this call takes no body (or an empty JSON object)")
    for key in body:
        raise UnknownField(f"this call takes no body; {key[:60]!r} is not a field", param=key)
    return body


#: A call that takes no body, as a handler parameter after the path's IDs (so a bad ID
#: is 404 before the body is read); the OpenAPI document shows it as ``EmptyBody``.
Empty = Annotated[dict[str, Any], Depends(read_empty)]


async def read_upload(
    request: Request,
    fields: tuple[str, ...],
    max_bytes: int,
    spool: Callable[[], IO[bytes]] = tempfile.TemporaryFile,
) -> Upload:
    """A ``multipart/form-data`` upload of one ``file`` part and ``fields`` (``service.uploads``).

    Declared larger than ``max_bytes`` and its framing, it is a 413 before a byte is read.
    """
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes + _SLACK:
        raise PayloadTooLarge(
            f"the file is over {max_bytes} bytes", param="file", code="file_too_large"
        )
    content_type = request.headers.get("content-type")
    return await read_multipart(
        request.stream(),
        content_type,
        file_field="file",
        fields=fields,
        max_file_bytes=max_bytes,
        spool=spool,
    )


# -- query parameters -------------------------------------------------------------


def allow_query(request: Request, *names: str) -> dict[str, str]:
    """The query, refused by name where it holds a parameter not in ``names``."""
    for key in sorted(request.query_params.keys() - set(names)):
        raise InvalidRequest(
            f"{key} is not a query parameter here", param=key, code="unsupported_parameter"
        )
    return dict(request.query_params)


def _query(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name} is given {len(values)} times; give it once", param=name)
    return values[0] if values else None


def query_limit(request: Request, *, default: int, most: int, name: str = "limit") -> int:
    """A page size from 1 to ``most``, in ASCII digits; 400 ``invalid_limit`` otherwise."""
    raw = _query(request, name)
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= most:
        raise InvalidRequest(
            f"{name} must be a whole number from 1 to {most}, not {raw[:40]!r}",
            param=name,
            code="invalid_limit",
        )
    return int(raw)


def _cursor(request: Request, name: str, valid: Callable[[str], bool]) -> str | None:
    raw = _query(request, name)
    if raw is None or raw == "":
        return None
    if not valid(raw):
        raise InvalidRequest(
            f"{name} {raw[:80]!r} is not a cursor this API gave out",
            param=name,
            code="invalid_cursor",
        )
    return raw


def query_cursor(request: Request, *, name: str = "cursor") -> int | None:
    """A numeric cursor (a row ID this API gave out), or None; 400 ``invalid_cursor``."""
    raw = _cursor(request, name, lambda v: bool(_DIGITS.fullmatch(v)) and int(v) <= MAX_ROW_ID)
    return None if raw is None else int(raw)


def query_id_cursor(request: Request, prefix: str, *, name: str = "cursor") -> str | None:
    """A cursor that is an object ID (``prefix.<uuid7>``), or None; 400 ``invalid_cursor``."""
    return _cursor(request, name, lambda v: is_id(v, prefix))


def finished_query(request: Request) -> tuple[int, int]:
    """``after`` (a cursor a page of finished items gave, 0 from the start) and ``limit``.

    The query of every batch kind's ``/finished`` (``service.following``).
    """
    allow_query(request, "after", "limit")
    after = query_cursor(request, name="after") or 0
    return after, query_limit(request, default=100, most=1000)


# -- IDs --------------------------------------------------------------------------


def path_id(name: str, prefix: str, what: str, *, param: str = "", code: str | None = None) -> Any:
    """The path parameter ``name`` as a dependency: an ID with its prefix and a UUIDv7, or 404.

    ``param`` is the name the error gives (the wire's, where it differs from the path's).
    """

    # A default, not ``Annotated``: the annotation is a string, and ``name`` is local.
    async def check(value: str = Path(alias=name)) -> str:
        if not is_id(value, prefix):  # it can name nothing
            raise NotFound(f"{what} {printable(value)!r} not found", param=param or name, code=code)
        return value

    return Depends(check)


def row_id(value: str) -> int:
    """A row ID from a path: ASCII digits within the store's range, or 404."""
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= MAX_ROW_ID:
        raise NotFound(f"row {value[:40]!r} not found", param="rowId")
    return int(value)
