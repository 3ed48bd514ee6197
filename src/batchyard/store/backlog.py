"""What is waiting, counted at scrape time for ``/metrics``: queues and open holds.

One cheap read of a few ``COUNT`` / ``SUM`` queries, each over an indexed
state column: run rows waiting in runs that are queued or running, deferred
items waiting, file-batch lines waiting, and the reservations still held (how
many, and how many ticks). Computed from the store rather than counted in
each process, so every API process reports the same fleet-wide figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, func, select

from batchyard.store.deferred_batch_tables import batch_items
from batchyard.store.file_batches import file_batch_lines
from batchyard.store.runs import run_items, runs
from batchyard.store.tables import reservations

__all__ = ["Backlog", "backlog"]

#: Runs whose pending rows a worker will take (not those awaiting approval or blocked).
_TAKING = ("queued", "running")

_RUN_ROWS = (
    select(func.count())
    .select_from(run_items.join(runs, runs.c.id == run_items.c.run_id))
    .where(run_items.c.state == "pending", runs.c.status.in_(_TAKING))
)
_DEFERRED = select(func.count()).where(batch_items.c.status == "waiting")
_LINES = select(func.count()).where(file_batch_lines.c.state == "pending")
_HOLDS = select(func.count(), func.coalesce(func.sum(reservations.c.amount), 0)).where(
    reservations.c.state == "held"
)


@dataclass(frozen=True, slots=True)
class Backlog:
    run_rows: int
    deferred_items: int
    file_batch_lines: int
    holds: int
    held_ticks: int


def backlog(conn: Connection) -> Backlog:
    holds, held = conn.execute(_HOLDS).one()
    return Backlog(
        run_rows=int(conn.execute(_RUN_ROWS).scalar_one()),
        deferred_items=int(conn.execute(_DEFERRED).scalar_one()),
        file_batch_lines=int(conn.execute(_LINES).scalar_one()),
        holds=int(holds),
        held_ticks=int(held),
    )
