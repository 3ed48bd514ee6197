"""A run's rows as the runner sees them: the lease queue of batch inference runs.

A run is claimed by one worker under one lease (``store.run_leases``); its
rows have no lease of their own. So every row this queue claims carries the
run's lease, every write is fenced by it, and renewing the run's lease is
renewing every row's. Letting go after a stopped holder (``let_go(None)``,
when another worker claimed the run back) makes its sent rows ``uncertain``
and its unsent ones ``pending``; a drain's hand-over does the same to its own
and releases the run, so another worker continues it at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from batchyard.core.leases import Lease
from batchyard.core.runs import RunStatus
from batchyard.store import activity, run_leases, work_items
from batchyard.store.runs import Run
from batchyard.store.work_items import ItemResult, WorkItem
from batchyard.work.runner import Claim, Recovered, Renewal, uncertain_detail

__all__ = ["Row", "RowQueue"]

#: A claimed row: its frozen counts, and its frozen data (None when the row is gone).
Row = tuple[WorkItem, dict[str, Any] | None]


class RowQueue:
    """The rows of one run, held under the run's lease (``LeaseQueue[int, Row, ItemResult]``)."""

    kind = "runs"

    def __init__(self, run: Run) -> None:
        self.run = run
        self.lease = run.lease

    def claim(
        self, conn: Connection, want: int, now: datetime, until: datetime
    ) -> list[Claim[int, Row]]:
        rows = work_items.claim_items(conn, self.run.id, self.run.dataset_id, want, now)
        return [Claim(item.row_id, self.lease, (item, data)) for item, data in rows]

    def renew(
        self, conn: Connection, held: Mapping[int, Lease], now: datetime, until: datetime
    ) -> Renewal:
        status = run_leases.renew(conn, self.run.id, self.lease, until)
        if status is None:
            return Renewal.LOST
        return Renewal.STOPPING if status == RunStatus.STOPPING else Renewal.GOING

    def record(
        self,
        conn: Connection,
        held: Mapping[int, Lease],
        results: Sequence[ItemResult],
        now: datetime,
    ) -> int:
        work_items.record_results(conn, self.run.id, results, now)
        return len(results)

    def mark_sent(self, conn: Connection, held: Mapping[int, Lease], now: datetime) -> set[int]:
        return work_items.mark_sent(conn, self.run.id, list(held), self.lease, now)

    def requeue(self, conn: Connection, held: Mapping[int, Lease], now: datetime) -> int:
        return work_items.requeue_unsent(conn, self.run.id, list(held), now)

    def let_go(
        self, conn: Connection, held: Mapping[int, Lease] | None, now: datetime
    ) -> Recovered:
        run = self.run
        uncertain, returned = work_items.recover_dispatched(conn, run.id, now)
        if uncertain:
            activity.record(
                conn,
                run.org_id,
                "uncertain",
                now,
                ref=run.id,
                reservation_id=run.reservation_id,
                detail=uncertain_detail("rows", uncertain, cut_off=held is not None),
            )
        work_items.recount(conn, run.id, now)
        if held is not None:
            run_leases.release(conn, run.id, self.lease)
        return Recovered(leases=1, uncertain=len(uncertain), returned=returned)

    def lapsed(self, conn: Connection, now: datetime) -> bool:
        # A run's rows are recovered when the run is claimed back, not swept for.
        return True
