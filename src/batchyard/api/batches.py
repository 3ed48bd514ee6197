"""``/v1/batches``: deferred batches that wait for a discount (seed 003).

A submission is checked whole first (``api.batch_requests``), then the
bodies are sealed and the batch and all its items are written in one
transaction, so a submission that fails anywhere queues nothing. Execution
is the market worker's (``work.market``); these handlers only submit, show,
cancel and hand out results. The workspace (``web``) calls the same
functions, so it cannot do anything the API would not.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import Connection

from batchyard.api.batch_requests import MAX_BODY_BYTES, WINDOWS, Submission, parse_submission
from batchyard.api.context import authenticate, idempotent, json_response, read_json, service_of
from batchyard.core.accounts import Principal, Scope
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.limits import Limit
from batchyard.errors import InvalidState, NotFound, PendingLimitExceeded, RateLimited
from batchyard.service import Service
from batchyard.store import batches as store
from batchyard.work.batch_sealing import result_aad
from batchyard.work.market import market_of
from batchyard.work.market_housekeeping import RESULTS_KEPT

__all__ = [
    "MAX_PENDING",
    "cancel",
    "result_lines",
    "router",
    "store_submission",
]

router = APIRouter()
log = logging.getLogger("batchyard.api.batches")

MAX_PENDING = 200
SUBMISSIONS_PER_MINUTE = 10


def _number(d: Decimal) -> int | float:
    return int(d) if d == d.to_integral_value() else float(d)


def _view(
    batch: store.BatchRow, per: dict[str, int], items: list[store.ItemRow] | None
) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": batch.id,
        "object": "batch",
        "status": batch.status,
        "created_at": isoformat(batch.created_at),
        "deadline": isoformat(batch.deadline),
        "completed_at": isoformat(batch.completed_at) if batch.completed_at else None,
        "min_discount": _number(batch.min_discount),
        "completion_window": batch.completion_window,
        "request_counts": {"total": batch.request_count, **per},
        "results_url": f"/v1/batches/{batch.id}/results",
        "results_expire_at": (
            isoformat(batch.completed_at + RESULTS_KEPT) if batch.completed_at else None
        ),
        "results_purged": batch.purged_at is not None,
    }
    if items is not None:
        view["requests"] = [
            {"custom_id": it.custom_id, "status": it.status}
            | ({"reason": it.reason} if it.reason else {})
            for it in items
        ]
    return view


def _load_view(conn: Connection, org_id: str, batch_id: str) -> dict[str, Any]:
    batch = store.get_batch(conn, org_id, batch_id)
    if batch is None:
        raise NotFound(f"batch {batch_id} not found", param="batch_id")
    per = store.counts(conn, [batch.id])[batch.id]
    return _view(batch, per, store.items_of(conn, batch.id))


async def _check_rate(svc: Service, principal: Principal) -> None:
    limit = Limit("batch_submissions", SUBMISSIONS_PER_MINUTE, burst=SUBMISSIONS_PER_MINUTE)
    decision = await svc.limiter.try_acquire(f"org:{principal.org_id}", [(limit, 1.0)])
    if not decision.allowed:
        raise RateLimited(
            f"at most {SUBMISSIONS_PER_MINUTE} batch submissions a minute per organisation; "
            "retry after the delay",
            retry_after=decision.retry_after,
        )


async def store_submission(svc: Service, principal: Principal, sub: Submission) -> dict[str, Any]:
    """Seal and keep a parsed submission in one transaction; the new batch's view.

    Shared by the API and the workspace so both queue through the same
    submission rate, pending limit, sealing and persistence.
    """
    sealer = market_of(svc).sealer()
    await _check_rate(svc, principal)
    now = svc.clock.now()
    batch_id = new_id("bat", now)
    items = []
    for pos, req in enumerate(sub.requests):
        item_id = new_id("bti", now)
        blob = sealer.seal(json.dumps(req.stored).encode(), item_id.encode())
        items.append(
            store.NewItem(
                item_id,
                pos,
                req.custom_id,
                req.model,
                req.min_discount,
                req.input_tokens,
                req.max_tokens,
                blob,
            )
        )

    def tx(conn: Connection) -> dict[str, Any]:
        store.lock_org(conn, principal.org_id)
        pending = store.pending_count(conn, principal.org_id)
        if pending + len(items) > MAX_PENDING:
            raise PendingLimitExceeded(
                f"{pending} items are pending and this batch adds {len(items)}; at most "
                f"{MAX_PENDING} may be pending per organisation; retry as items finish",
                details={"pending": pending, "limit": MAX_PENDING},
            )
        store.create_batch(
            conn,
            batch_id=batch_id,
            org_id=principal.org_id,
            key_id=principal.key_id,
            min_discount=sub.min_discount,
            completion_window=sub.window,
            created_at=now,
            deadline=now + WINDOWS[sub.window],
            items=items,
        )
        return _load_view(conn, principal.org_id, batch_id)

    view = await svc.db.run(tx)
    log.info(
        "batch submitted",
        extra={
            "event": "batch_submitted",
            "batch_id": batch_id,
            "org_id": principal.org_id,
            "requests": len(items),
            "privacy_redactions": sub.redactions,
        },
    )
    return view


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    principal = await authenticate(request, Scope.FULL, Scope.INFERENCE)
    svc = service_of(request)
    market_of(svc).sealer()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=MAX_BODY_BYTES)
    sub = parse_submission(svc, raw)

    async def handler() -> tuple[int, Any]:
        return 201, await store_submission(svc, principal, sub)

    return await idempotent(request, principal, raw, handler, min_len=8, required=True)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    svc = service_of(request)
    limit = max(1, min(limit, 100))

    def load(conn: Connection) -> list[dict[str, Any]]:
        rows = store.list_batches(conn, principal.org_id, after=after, limit=limit)
        per = store.counts(conn, [b.id for b in rows])
        return [_view(b, per[b.id], None) for b in rows]

    data = await svc.db.run(load, readonly=True)
    return json_response(
        {
            "object": "list",
            "data": data,
            "next_cursor": data[-1]["id"] if len(data) == limit else None,
        }
    )


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    svc = service_of(request)
    view = await svc.db.run(lambda c: _load_view(c, principal.org_id, batch_id), readonly=True)
    return json_response(view)


async def cancel(svc: Service, principal: Principal, batch_id: str) -> dict[str, Any]:
    """Stop the waiting items of the caller's batch; its view after."""
    now = svc.clock.now()

    def tx(conn: Connection) -> dict[str, Any]:
        batch = store.get_batch(conn, principal.org_id, batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id} not found", param="batch_id")
        if batch.status in ("completed", "expired"):
            raise InvalidState(f"batch {batch_id} is already {batch.status}; nothing to cancel")
        stopped = store.cancel_batch(conn, batch.id, now)
        log.info(
            "batch canceled",
            extra={"event": "batch_canceled", "batch_id": batch.id, "stopped": stopped},
        )
        return _load_view(conn, principal.org_id, batch.id)

    return await svc.db.run(tx)


async def result_lines(svc: Service, principal: Principal, batch_id: str) -> AsyncIterator[bytes]:
    """The batch's NDJSON result lines; 404 for another organisation's, 410 once purged.

    The rows are loaded (and the errors raised) before the first line is
    yielded, so a caller can turn a failure into a response of its own.
    """
    sealer = market_of(svc).sealer()

    def load(conn: Connection) -> list[tuple[store.ItemRow, bytes | None]]:
        batch = store.get_batch(conn, principal.org_id, batch_id)
        if batch is None:
            raise NotFound(f"batch {batch_id} not found", param="batch_id")
        if batch.purged_at is not None:
            raise NotFound(
                f"the results of batch {batch_id} were deleted 24 hours after it completed; "
                "its status and request counts remain",
                param="batch_id",
                code="results_expired",
                status=410,
            )
        return store.results_of(conn, batch.id)

    rows = await svc.db.run(load, readonly=True)

    async def lines() -> AsyncIterator[bytes]:
        for item, blob in rows:
            result = json.loads(sealer.open(blob, result_aad(item.id))) if blob else None
            line = {
                "custom_id": item.custom_id,
                "status": item.status,
                "result": result,
                "reservation_id": item.reservation_id,
            }
            yield (json.dumps(line) + "\n").encode()

    return lines()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.INFERENCE)
    return json_response(await cancel(service_of(request), principal, batch_id))


@router.get("/v1/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    lines = await result_lines(service_of(request), principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")
