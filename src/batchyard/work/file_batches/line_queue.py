"""A file batch's lines as the runner sees them: the lease queue of OpenAI file batches.

Each line is leased on its own (several workers share one batch), so every
write names the line's own claim. A step stops claiming once the batch is no
longer ``in_progress`` (cancelled, or finalizing) or its window closed. Lines
are claimed with the route their model goes to now (``lines.plan_for``): a
batch that waits for a discount reads the prices afresh at each claim, and a
line whose route stopped qualifying is handed back unsent.

Letting go of lines ends them the way the worker's own stop would: a sent
line becomes ``uncertain``, with its error-file line and an activity record,
never sent again and never charged; an unsent one waits again. Recovery
(``let_go(None)``) does this for every line whose worker stopped renewing,
whatever its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection

from batchyard.core.leases import Lease
from batchyard.core.sealing import Sealer
from batchyard.store import activity
from batchyard.store import file_batches as store
from batchyard.work.file_batches.lines import LinePlan, never_answered
from batchyard.work.runner import Claim, Recovered, Renewal, uncertain_detail

__all__ = ["Line", "LineQueue"]


@dataclass(frozen=True, slots=True)
class Line:
    """A claimed line and where it goes: its route and price now (None: none qualifies)."""

    claimed: store.Claimed
    plan: LinePlan | None


class LineQueue:
    """The lines of a file batch (``LeaseQueue[int, Line, store.LineEnd]``).

    ``batch`` None: the queue of every batch's lines, for recovery alone.
    """

    kind = "file_batches"

    def __init__(
        self,
        sealer: Sealer,
        *,
        owner: str = "",
        batch: store.BatchRow | None = None,
        plan: Callable[[str], LinePlan | None] | None = None,
        chunk: int = 1000,
    ) -> None:
        self.sealer = sealer
        self.owner = owner
        self.batch = batch
        self._plan = plan
        self.chunk = chunk

    def _the_batch(self) -> store.BatchRow:
        assert self.batch is not None, "a batch's own queue"
        return self.batch

    def claim(
        self, conn: Connection, want: int, now: datetime, until: datetime
    ) -> list[Claim[int, Line]]:
        batch = self._the_batch()
        plans: dict[str, LinePlan | None] = {}  # prices are read afresh at each claim

        def plan(model: str) -> LinePlan | None:
            if model not in plans:
                plans[model] = self._plan(model) if self._plan is not None else None
            return plans[model]

        claimed = store.claim_lines(conn, batch, self.owner, want, now, until)
        return [Claim(c.line, c.lease, Line(c, plan(c.model))) for c in claimed]

    def renew(
        self, conn: Connection, held: Mapping[int, Lease], now: datetime, until: datetime
    ) -> Renewal:
        batch = self._the_batch()
        status = store.renew(conn, batch.id, held, until)
        going = status == "in_progress" and now < batch.expires_at
        return Renewal.GOING if going else Renewal.STOPPING

    def record(
        self,
        conn: Connection,
        held: Mapping[int, Lease],
        results: Sequence[store.LineEnd],
        now: datetime,
    ) -> int:
        return store.record_results(conn, self._the_batch().id, held, results, now)

    def mark_sent(self, conn: Connection, held: Mapping[int, Lease], now: datetime) -> set[int]:
        return store.mark_sent(conn, self._the_batch().id, held, now)

    def requeue(self, conn: Connection, held: Mapping[int, Lease], now: datetime) -> int:
        return store.requeue_unsent(
            conn, now, batch_id=self._the_batch().id, held=held, unmark=True
        )

    def let_go(
        self, conn: Connection, held: Mapping[int, Lease] | None, now: datetime
    ) -> Recovered:
        batch_id = None if held is None else self._the_batch().id
        lapsed = store.lapsed_lines(conn, now, self.chunk, batch_id=batch_id, held=held)
        by_batch: dict[str, list[store.LineEnd]] = {}
        for line_batch, line, custom_id in lapsed:
            ended = never_answered(self.sealer, line_batch, line, custom_id, "uncertain", now)
            by_batch.setdefault(line_batch, []).append(ended)
        # Lapsed (or given up) but never sent: they wait again.
        returned = store.requeue_unsent(conn, now, batch_id=batch_id, held=held)
        for line_batch, ends in by_batch.items():
            store.end_lines(conn, line_batch, "dispatched", ends, now)
            batch = store.load_batch(conn, line_batch)
            if batch is None:
                continue
            activity.record(
                conn,
                batch.org_id,
                "uncertain",
                now,
                ref=line_batch,
                reservation_id=batch.reservation_id,
                detail=uncertain_detail("lines", [e.line for e in ends], cut_off=held is not None),
            )
        return Recovered(leases=len(lapsed) + returned, uncertain=len(lapsed), returned=returned)

    def lapsed(self, conn: Connection, now: datetime) -> bool:
        return bool(store.lapsed_lines(conn, now, 1, lock=False)) or store.has_unsent_lapsed(
            conn, now
        )
