"""The end of a dispatched batch item: money settled or released, and the result sealed.

Each outcome is written in one transaction (the runner's, see
``work.deferred_batches.item_queue``): the reservation is settled to real usage at
the route's offered price (or released on failure) with its activity record
(``store.billing``), and the item ends with its sealed result. A failure's
result has a success's shape (``status_code`` and ``body``) with the error
body, so the results file reads the same either way. A success's body is the
``chat.completion`` of ``work.openai_wire``, the object the chat door answers,
with what it cost and on which route.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import RouteSpec
from batchyard.core.clock import isoformat
from batchyard.core.ids import new_id
from batchyard.core.leases import Lease
from batchyard.core.money import format_money
from batchyard.core.prices import Price
from batchyard.core.quotes import charge
from batchyard.core.sealing import Sealer
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.errors import BatchyardError
from batchyard.store import billing
from batchyard.store import deferred_batches as store
from batchyard.work.batch_key import result_aad
from batchyard.work.openai_wire import Reply

__all__ = ["ClaimedItem", "fail", "finish_failed", "item_detail", "succeed"]

log = logging.getLogger("batchyard.deferred_batches")


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item the worker dispatched: what to call, where, at what price, under which hold."""

    item: store.ItemRow
    request: CompletionRequest
    route: RouteSpec
    price: Price
    reservation_id: str
    #: This dispatch's lease (``store.deferred_batches.mark_dispatched``): every write names it.
    lease: Lease


def item_detail(item: store.ItemRow, **more: Any) -> dict[str, Any]:
    """What an item's activity records say of it (its batch and custom ID), and ``more``."""
    return {"purpose": "batch", "batch_id": item.batch_id, "custom_id": item.custom_id, **more}


def finish_failed(
    conn: Connection,
    sealer: Sealer,
    item: store.ItemRow,
    exc: BatchyardError,
    now: datetime,
    from_states: Sequence[str] = ("waiting",),
    lease: Lease | None = None,
) -> None:
    """End an item as failed; its result has a success's shape with the error body."""
    body = {"status_code": exc.status, "body": exc.to_body()}
    store.finish_item(
        conn,
        item,
        status="failed",
        reason=exc.code,
        now=now,
        result_status=exc.status,
        result=sealer.seal(json.dumps(body).encode(), result_aad(item.id)),
        from_states=from_states,
        lease=lease,
    )


def _still_ours(conn: Connection, job: ClaimedItem) -> bool:
    """Whether the item is still under this dispatch (its hold and its claim's fencing token).

    Checked (and the row locked) before any money moves: a worker whose claim was
    superseded settles, releases and records nothing. A dispatch made ``uncertain``
    by recovery is still this one: its late answer may land.
    """
    found = store.dispatched_item(conn, job.item.id, job.lease, ("dispatched", "uncertain"))
    return found is not None and found.reservation_id == job.reservation_id


def succeed(
    conn: Connection, sealer: Sealer, job: ClaimedItem, completion: Completion, now: datetime
) -> billing.Resolved | None:
    """Settle the hold to real usage and keep the sealed completion; the settlement this
    made (``None`` where another path had resolved the hold, or the item is no longer ours)."""
    item = job.item
    priced = charge(job.price, job.route, completion.usage)
    if not _still_ours(conn, job):
        return None
    settled = billing.settle(
        conn,
        job.reservation_id,
        priced.ticks,
        now,
        ref=item.id,
        detail=item_detail(item, model=item.model, route=job.route.id, **priced.detail()),
        if_held=True,
    )
    charged = settled.charged if settled.now else priced.ticks
    body = {
        "status_code": 200,
        "body": _completion_body(job, completion, charged, now),
    }
    store.finish_item(
        conn,
        item,
        status="succeeded",
        now=now,
        result_status=200,
        result=sealer.seal(json.dumps(body).encode(), result_aad(item.id)),
        from_states=("dispatched", "uncertain"),
        lease=job.lease,
    )
    log.info(
        "batch item succeeded",
        extra={"event": "batch_item_succeeded", "item_id": item.id, "route": job.route.id},
    )
    return settled if settled.now else None


def fail(
    conn: Connection, sealer: Sealer, job: ClaimedItem, exc: BatchyardError, now: datetime
) -> None:
    """Release the hold and keep the sealed error as the item's result; never retried."""
    item = job.item
    if not _still_ours(conn, job):
        return
    billing.release(
        conn,
        job.reservation_id,
        now,
        ref=item.id,
        detail={"purpose": "batch", "reason": exc.code, "route": job.route.id},
        if_held=True,
    )
    finish_failed(
        conn,
        sealer,
        item,
        exc,
        now,
        from_states=("dispatched", "uncertain"),
        lease=job.lease,
    )
    log.info(
        "batch item failed",
        extra={"event": "batch_item_failed", "item_id": item.id, "code": exc.code},
    )


def _completion_body(
    job: ClaimedItem, completion: Completion, charged: int, now: datetime
) -> dict[str, Any]:
    """The chat completion a batch result carries, with what it cost and on which route."""
    reply = Reply(new_id("chatcmpl", now), int(now.timestamp()), job.item.model)
    return {
        **reply.chat(completion, logprobs=job.request.logprobs),
        "route": job.route.id,
        "charge": format_money(charged),
        "reservation_id": job.reservation_id,
        "created_at": isoformat(now),
    }
