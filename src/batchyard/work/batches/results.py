"""The end of a dispatched batch item: money settled or released, and the result sealed.

Each outcome is one transaction: the reservation is settled to real usage at
the route's offered price (or released on failure), the activity record is
written, and the item ends with its sealed result. A failure's result has a
success's shape (``status_code`` and ``body``) with the error body, so the
results file reads the same either way. A success's body is the
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
from batchyard.core.clock import Clock, isoformat
from batchyard.core.ids import new_id
from batchyard.core.money import charge_ticks, format_money
from batchyard.core.prices import Price
from batchyard.core.sealing import Sealer
from batchyard.engines.base import Completion, CompletionRequest
from batchyard.errors import BatchyardError
from batchyard.store import activity, ledger
from batchyard.store import batches as store
from batchyard.store.database import Database
from batchyard.work.batches.sealing import result_aad
from batchyard.work.openai_wire import Reply

__all__ = ["Claimed", "finish_failed", "record_failure", "record_success"]

log = logging.getLogger("batchyard.market")


@dataclass(frozen=True, slots=True)
class Claimed:
    """An item the worker dispatched: what to call, where, at what price, under which hold."""

    item: store.ItemRow
    request: CompletionRequest
    route: RouteSpec
    price: Price
    reservation_id: str
    #: The fencing token of this dispatch's lease (``store.batches.mark_dispatched``).
    token: int


def finish_failed(
    conn: Connection,
    sealer: Sealer,
    item: store.ItemRow,
    exc: BatchyardError,
    now: datetime,
    from_states: Sequence[str] = ("waiting",),
    reservation_id: str | None = None,
    token: int | None = None,
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
        reservation_id=reservation_id,
        token=token,
    )


def _still_ours(conn: Connection, job: Claimed) -> bool:
    """Whether the item is still under this dispatch (its hold and its claim's fencing token).

    Checked (and the row locked) before any money moves: a worker whose claim was
    superseded settles, releases and records nothing. A dispatch made ``uncertain``
    by recovery is still this one: its late answer may land.
    """
    return (
        store.dispatched_item(
            conn, job.item.id, job.reservation_id, job.token, ("dispatched", "uncertain")
        )
        is not None
    )


async def record_success(
    db: Database, clock: Clock, sealer: Sealer, job: Claimed, completion: Completion
) -> int:
    """Settle the hold to real usage and keep the sealed completion; the ticks this posted."""
    item = job.item
    now = clock.now()
    usage = completion.usage
    charge = charge_ticks(job.price.cost(usage.input_tokens, usage.output_tokens))

    def tx(conn: Connection) -> int:
        if not _still_ours(conn, job):
            return 0
        held = ledger.get_reservation(conn, job.reservation_id, lock=True)
        charged = charge
        if held.state == "held":
            charged = ledger.settle(conn, job.reservation_id, charge, now).charged or 0
            activity.record(
                conn,
                item.org_id,
                "charge",
                now,
                ref=item.id,
                reservation_id=job.reservation_id,
                amount=charged,
                detail={
                    "purpose": "batch",
                    "batch_id": item.batch_id,
                    "custom_id": item.custom_id,
                    "model": item.model,
                    "route": job.route.id,
                    "input_tokens": usage.input_tokens,
                    "output_tokens": usage.output_tokens,
                },
            )
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
            reservation_id=job.reservation_id,
            token=job.token,
        )
        return charged if held.state == "held" else 0

    # The call happened: its outcome must land, even across a short storage outage.
    posted: int = await db.transact_through(tx)
    log.info(
        "batch item succeeded",
        extra={"event": "batch_item_succeeded", "item_id": item.id, "route": job.route.id},
    )
    return posted


async def record_failure(
    db: Database, clock: Clock, sealer: Sealer, job: Claimed, exc: BatchyardError
) -> None:
    """Release the hold and keep the sealed error as the item's result; never retried."""
    item = job.item
    now = clock.now()

    def tx(conn: Connection) -> None:
        if not _still_ours(conn, job):
            return
        held = ledger.get_reservation(conn, job.reservation_id, lock=True)
        if held.state == "held":
            ledger.release(conn, job.reservation_id, now)
            activity.record(
                conn,
                item.org_id,
                "release",
                now,
                ref=item.id,
                reservation_id=job.reservation_id,
                amount=held.amount,
                detail={"purpose": "batch", "reason": exc.code, "route": job.route.id},
            )
        finish_failed(
            conn,
            sealer,
            item,
            exc,
            now,
            from_states=("dispatched", "uncertain"),
            reservation_id=job.reservation_id,
            token=job.token,
        )

    await db.transact_through(tx)
    log.info(
        "batch item failed",
        extra={"event": "batch_item_failed", "item_id": item.id, "code": exc.code},
    )


def _completion_body(
    job: Claimed, completion: Completion, charged: int, now: datetime
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
