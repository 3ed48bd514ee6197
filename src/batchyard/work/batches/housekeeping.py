"""Recovery and housekeeping of deferred batch items, run at the top of every market pass.

*Recovery*: a dispatched item whose lease lapsed belonged to a worker that
stopped mid-call. Whether the call ran is unknown, so it becomes
``uncertain`` with its reservation still held and an activity record that
names it. Nothing is retried and nothing is released: that would risk paying
twice or losing a charge the provider made.

*Housekeeping*: waiting items past their deadline expire; waiting items
whose submitting key was revoked are canceled; results of batches completed
more than ``RESULTS_KEPT`` ago are purged (their metadata stays).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import NamedTuple

from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.store import activity, ledger
from batchyard.store import batches as store
from batchyard.store.database import Database

__all__ = ["RESULTS_KEPT", "Swept", "housekeep", "recover_lapsed"]

log = logging.getLogger("batchyard.market")

#: Results are kept this long after their batch completes, then purged.
RESULTS_KEPT = timedelta(hours=24)


class Swept(NamedTuple):
    """How many items housekeeping ended, and how many batches it purged."""

    expired: int
    canceled: int
    purged: int


async def recover_lapsed(db: Database, clock: Clock) -> int:
    """Dispatched items whose lease lapsed become ``uncertain``, reservation held."""
    now = clock.now()

    def tx(conn: Connection) -> int:
        lapsed = store.lapsed_leases(conn, now)
        for item in lapsed:
            store.mark_uncertain(conn, item, now)
            held = (
                ledger.get_reservation(conn, item.reservation_id).amount
                if item.reservation_id
                else None
            )
            activity.record(
                conn,
                item.org_id,
                "uncertain",
                now,
                ref=item.id,
                reservation_id=item.reservation_id,
                amount=held,
                detail={
                    "purpose": "batch",
                    "batch_id": item.batch_id,
                    "custom_id": item.custom_id,
                    "route": item.route,
                    "reason": "the worker stopped during the call; its outcome is unknown",
                },
            )
            log.warning(
                "batch item uncertain",
                extra={
                    "event": "batch_item_uncertain",
                    "item_id": item.id,
                    "reservation_id": item.reservation_id,
                },
            )
        return len(lapsed)

    return await db.transact(tx)


async def housekeep(db: Database, clock: Clock) -> Swept:
    """Expire overdue items, cancel those of revoked keys, purge old results: one transaction."""
    now = clock.now()

    def tx(conn: Connection) -> Swept:
        expired = store.expire_due(conn, now)
        canceled = store.cancel_for_revoked_keys(conn, now)
        purged = store.purge_due(conn, now - RESULTS_KEPT, now)
        return Swept(expired, canceled, len(purged))

    return await db.transact(tx)
