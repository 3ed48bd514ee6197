"""The hold sweeper: every stranded hold shows up in its owner's activity log, once.

A hold strands only after a fault (see ``store.holds``), often one that also
kept anything from being written at the time: a process killed mid-call, a
disk that filled between the hold and the settlement. The sweeper runs in
every server and worker process, finds stranded holds that nothing else has
explained to the owner, and records a ``hold_unresolved`` activity entry for
each, with why it is held and what the owner can do, so
``idempotency_interrupted``'s "check GET /v1/activity" always finds an answer.
Holds a running worker will resolve by itself (a lapsed lease) are left to it.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection

from batchyard.core.clock import Clock, isoformat
from batchyard.store import activity, holds
from batchyard.store.database import Database

__all__ = ["HoldSweeper"]

log = logging.getLogger("batchyard.holds")


class HoldSweeper:
    """Flags stranded holds in their owners' activity; the service sweeps every ``interval_s``."""

    def __init__(self, *, db: Database, clock: Clock, interval_s: float = 60.0) -> None:
        self.db = db
        self.clock = clock
        self.interval_s = interval_s

    async def sweep(self) -> int:
        """One look; how many holds were newly flagged."""
        now = self.clock.now()
        found = [
            s for s in await self.db.read(lambda c: holds.stranded(c, now)) if not s.worker_resolves
        ]
        if not found:
            return 0

        def tx(conn: Connection) -> int:
            seen = holds.flagged(conn, [s.reservation_id for s in found])
            fresh = [s for s in found if s.reservation_id not in seen]
            for s in fresh:
                activity.record(
                    conn,
                    s.org_id,
                    "hold_unresolved",
                    now,
                    ref=s.ref,
                    reservation_id=s.reservation_id,
                    amount=s.amount,
                    detail={
                        "purpose": s.purpose,
                        "held_since": isoformat(s.created_at),
                        "reason": s.why,
                        "action": s.action,
                    },
                )
            return len(fresh)

        flagged = await self.db.transact(tx)
        if flagged:
            log.warning(
                "stranded holds flagged", extra={"event": "holds_flagged", "count": flagged}
            )
        return flagged
