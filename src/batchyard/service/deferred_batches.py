"""Deferred batches as both front doors use them: submit, show, cancel, read results.

The API and the workspace call these same functions, so the workspace cannot queue,
cancel or show anything the API would not: one submission rate, one pending limit, one
way of sealing bodies and one view of a batch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.ids import new_id
from batchyard.core.limits import Limit
from batchyard.core.sealing import Sealer
from batchyard.errors import InvalidState, NotFound, PendingLimitExceeded, RateLimited
from batchyard.service import following
from batchyard.service.batch_requests import WINDOWS, Submission
from batchyard.service.batch_views import deferred_batch, load_deferred_view
from batchyard.service.deployment import Service
from batchyard.store import deferred_batches as store
from batchyard.work.batch_key import result_aad

__all__ = [
    "MAX_PENDING",
    "SUBMISSIONS_PER_MINUTE",
    "cancel",
    "finished",
    "result_lines",
    "submit",
]

log = logging.getLogger("batchyard.deferred_batches")

MAX_PENDING = 200
SUBMISSIONS_PER_MINUTE = 10


async def _check_rate(svc: Service, principal: Principal) -> None:
    limit = Limit("batch_submissions", SUBMISSIONS_PER_MINUTE, burst=SUBMISSIONS_PER_MINUTE)
    admission = await svc.limiter.try_acquire(f"org:{principal.org_id}", [(limit, 1.0)])
    if not admission.allowed:
        raise RateLimited(
            f"at most {SUBMISSIONS_PER_MINUTE} batch submissions a minute per organisation; "
            "retry after the delay",
            retry_after=admission.retry_after,
        )


async def submit(svc: Service, principal: Principal, sub: Submission) -> dict[str, Any]:
    """Seal and keep a parsed submission in one transaction; the new batch's view.

    Shared by the API and the workspace so both queue through the same
    submission rate, pending limit, sealing and persistence.
    """
    sealer = svc.batch_key.require()
    await _check_rate(svc, principal)
    now = svc.clock.now()
    batch_id = new_id("bat", now)
    items = []
    for pos, r in enumerate(sub.requests):
        item_id = new_id("bti", now)
        blob = sealer.seal(json.dumps(r.stored).encode(), item_id.encode())
        asked = (r.custom_id, r.model, r.min_discount, r.input_tokens, r.max_tokens)
        items.append(store.NewItem(item_id, pos, *asked, blob))

    def tx(conn: Connection) -> dict[str, Any]:
        store.lock_org(conn, principal.org_id)
        pending = store.pending_count(conn, principal.org_id)
        if pending + len(items) > MAX_PENDING:
            raise PendingLimitExceeded(
                f"{pending} items are pending and this batch adds {len(items)}; at most "
                f"{MAX_PENDING} may be pending per organisation; retry as items finish",
                # Items finish on the market's passes: one pass is the soonest a place frees.
                retry_after=svc.settings.market_interval_s,
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
        return load_deferred_view(conn, principal, batch_id)

    view = await svc.db.transact(tx)
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


async def cancel(svc: Service, principal: Principal, batch_id: str) -> dict[str, Any]:
    """Stop the waiting items of the caller's batch; its view after."""
    now = svc.clock.now()

    def tx(conn: Connection) -> dict[str, Any]:
        batch = deferred_batch(conn, principal, batch_id)
        if batch.status in ("completed", "expired"):
            raise InvalidState(f"batch {batch_id} is already {batch.status}; nothing to cancel")
        stopped = store.cancel_batch(conn, batch.id, now)
        log.info(
            "batch canceled",
            extra={"event": "batch_canceled", "batch_id": batch.id, "stopped": stopped},
        )
        return load_deferred_view(conn, principal, batch.id)

    return await svc.db.transact(tx)


def _readable(conn: Connection, principal: Principal, batch_id: str) -> store.DeferredBatchRow:
    """The caller's batch whose results are still kept; 404, or 410 once purged."""
    batch = deferred_batch(conn, principal, batch_id)
    if batch.purged_at is not None:
        raise NotFound(
            f"the results of batch {batch_id} were deleted 24 hours after it completed; "
            "its status and request counts remain",
            param="batch_id",
            code="results_expired",
            status=410,
        )
    return batch


async def result_lines(svc: Service, principal: Principal, batch_id: str) -> AsyncIterator[bytes]:
    """The batch's NDJSON result lines; 404 for another organisation's, 410 once purged.

    The rows are loaded (and the errors raised) before the first line is
    yielded, so a caller can turn a failure into a response of its own.
    """
    sealer = svc.batch_key.require()

    def load(conn: Connection) -> list[tuple[store.ItemRow, bytes | None]]:
        return store.results_of(conn, _readable(conn, principal, batch_id).id)

    rows = await svc.db.read(load)

    async def lines() -> AsyncIterator[bytes]:
        for item, blob in rows:
            yield (json.dumps(_result_line(sealer, item, blob)) + "\n").encode()

    return lines()


def _result_line(sealer: Sealer, item: store.ItemRow, blob: bytes | None) -> dict[str, Any]:
    """One item as a line of the batch's results."""
    result = json.loads(sealer.open(blob, result_aad(item.id))) if blob else None
    return {
        "custom_id": item.custom_id,
        "status": item.status,
        "result": result,
        "reservation_id": item.reservation_id,
    }


async def finished(
    svc: Service, principal: Principal, batch_id: str, *, after: int, limit: int
) -> dict[str, Any]:
    """The items that ended after ``after``, as the results show them (``service.following``)."""
    sealer = svc.batch_key.require()

    def read(conn: Connection) -> dict[str, Any]:
        batch = _readable(conn, principal, batch_id)
        rows = store.ended_results(conn, batch.id, after=after, limit=limit + 1)
        items = [(seq, _result_line(sealer, item, blob)) for seq, item, blob in rows]
        ended = batch.status in ("completed", "expired", "canceled")
        return following.page(items, after=after, limit=limit, ended=ended)

    return await svc.db.read(read)
