"""Recovery and housekeeping of deferred batch items, run at the top of every deferred-batch pass.

*Recovery* (the runner's, through ``work.deferred_batches.item_queue``): a dispatched
item whose lease lapsed belonged to a worker that
stopped. If its call was sent (``sent_at``, written just before the engine
call), whether it ran is unknown, so it becomes ``uncertain`` and is never
sent again; like an uncertain file-batch line or run row, it is charged
nothing: its hold is released, with an activity record that names it, the
amount, and what the owner can do (one rule on every door, see
docs/explanation/ledger.md). If it was never sent (it was still waiting for
the route's pace or a concurrency slot), its hold is released and it goes
back to waiting: nothing happened to it.

*Housekeeping*: waiting items past their deadline expire; waiting items
whose submitting key was revoked are canceled; results of batches completed
more than ``RESULTS_KEPT`` ago are purged (their metadata stays), and so are
idempotent answers past their 24 hours (their keys' tombstones stay).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import NamedTuple

from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.store import activity, billing, idempotency
from batchyard.store import deferred_batches as store
from batchyard.store.database import Database
from batchyard.work.deferred_batches.results import item_detail

__all__ = [
    "RESULTS_KEPT",
    "UNCERTAIN_ACTION",
    "Swept",
    "housekeep",
    "settle_as_uncertain",
    "unwind_unsent",
]

log = logging.getLogger("batchyard.deferred_batches")

#: Results are kept this long after their batch completes, then purged.
RESULTS_KEPT = timedelta(hours=24)

#: What the owner of an uncertain item can do, shown with it in the activity log.
UNCERTAIN_ACTION = (
    "the call was sent and its outcome is unknown, so it was not retried; you were not "
    "charged for it (its hold was released, as for every uncertain item); check with the "
    "provider (or your logs) whether it ran before resubmitting it under a new custom_id, "
    "so the work is not paid for twice upstream"
)


def settle_as_uncertain(conn: Connection, item: store.ItemRow, now: datetime, why: str) -> bool:
    """A sent call cut off (crash, shutdown): ``uncertain``, charged nothing, shown in activity.

    Its hold is released in the same transaction: an uncertain item delivered
    no answer, so, as on the other doors, it is not charged, and nothing is
    left for an operator to resolve by hand.
    """
    if not store.mark_uncertain(conn, item, now):
        return False
    held = _release_hold(
        conn,
        item,
        now,
        "uncertain",
        "its call's outcome is unknown; an uncertain item is not charged",
    )
    activity.record(
        conn,
        item.org_id,
        "uncertain",
        now,
        ref=item.id,
        reservation_id=item.reservation_id,
        amount=held,
        detail=item_detail(item, route=item.route, reason=why, action=UNCERTAIN_ACTION),
    )
    log.warning(
        "batch item uncertain",
        extra={
            "event": "batch_item_uncertain",
            "item_id": item.id,
            "reservation_id": item.reservation_id,
        },
    )
    return True


def unwind_unsent(
    conn: Connection, item: store.ItemRow, now: datetime, why: str, *, unmark: bool = False
) -> bool:
    """A claimed item whose call never started: its hold released, back to waiting.

    ``unmark``: its call never left though it was marked sent (``return_to_waiting``).
    """
    if item.reservation_id is None or not store.return_to_waiting(conn, item, now, unmark=unmark):
        return False
    _release_hold(
        conn, item, now, "not_sent", f"{why}; the call never started, so the item waits again"
    )
    return True


def _release_hold(
    conn: Connection, item: store.ItemRow, now: datetime, reason: str, note: str
) -> int | None:
    """Release ``item``'s hold if it still holds, with its activity record; the hold's amount."""
    if item.reservation_id is None:
        return None
    return billing.release(
        conn,
        item.reservation_id,
        now,
        ref=item.id,
        detail=item_detail(item, reason=reason, note=note),
        if_held=True,
    ).reservation.amount


class Swept(NamedTuple):
    """How many items housekeeping ended, and how many batches it purged."""

    expired: int
    canceled: int
    purged: int


async def housekeep(db: Database, clock: Clock) -> Swept:
    """Expire overdue items, cancel those of revoked keys, purge old results and saved
    answers: one transaction."""
    now = clock.now()

    def tx(conn: Connection) -> Swept:
        expired = store.expire_due(conn, now)
        canceled = store.cancel_for_revoked_keys(conn, now)
        purged = store.purge_due(conn, now - RESULTS_KEPT, now)
        # Saved idempotent answers past their 24 hours lose their text; the key's
        # tombstone stays for good, so it never runs again (store.idempotency.purge).
        idempotency.purge(conn, now)
        return Swept(expired, canceled, len(purged))

    return await db.transact(tx)
