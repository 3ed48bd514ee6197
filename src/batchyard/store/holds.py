"""Holds that cannot resolve by themselves: found, shown, and resolved by an operator.

Every reservation is meant to resolve on its own: a chat or decide call
settles or releases before it answers, a deferred item when its call ends, a
run when it finishes. A hold outlives that only after a fault, and each kind
has a bound past which it is *stranded*:

- a synchronous call (chat, decide): older than ``SYNC_HOLD_LIMIT`` (its
  request died between the hold and the settlement: a crash, a full disk);
- a deferred item: still ``dispatched`` after its lease lapsed (no worker
  has passed since), or ended or gone with the hold still held (an
  ``uncertain`` item releases its hold as it becomes uncertain, the one rule
  of docs/explanation/ledger.md, so one still held was left by an older
  version);
- a run: ended with its hold held, or live with its lease long expired;
- a file batch: ended with its hold held (a live one holds its quote for its
  whole window, and its lines' own faults are settled with the batch).

``stranded`` lists them with why and what to do; ``batchyard audit`` reports
them as findings; the hold sweeper (``work.holds``) writes each once into the
owner's activity log (``hold_unresolved``) with the same advice; and
``resolve`` is what ``batchyard holds release`` and ``holds settle`` run: the
hold released (nothing charged) or settled to an amount the operator names,
in one transaction with an activity record that says who and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, select

from batchyard.core.money import format_money
from batchyard.errors import InvalidState
from batchyard.store import billing, ledger
from batchyard.store.deferred_batch_tables import batch_items
from batchyard.store.file_batches import LIVE as FILE_BATCH_LIVE
from batchyard.store.file_batches import file_batches
from batchyard.store.runs import runs
from batchyard.store.tables import activity as activity_table
from batchyard.store.tables import reservations

__all__ = [
    "SYNC_HOLD_LIMIT",
    "Stranded",
    "flagged",
    "resolve",
    "stranded",
]

#: A synchronous call's hold older than this belongs to a request that died.
SYNC_HOLD_LIMIT = timedelta(minutes=10)
#: How long past a lease a hold may wait for a worker to take it over.
LEASE_SLACK = timedelta(minutes=5)

_SYNC = ("chat", "decide")
_RELEASE = "batchyard holds release {id} --reason '...'"
_SETTLE = "batchyard holds settle {id} --amount <charged> --reason '...'"
_WORKER = "start a worker (batchyard worker): it resolves this on its next pass"


@dataclass(frozen=True, slots=True)
class Stranded:
    """One stranded hold: what it is, why it cannot resolve by itself, what to do."""

    reservation_id: str
    org_id: str
    amount: int
    purpose: str
    ref: str | None
    created_at: datetime
    why: str
    #: What the organisation's owner can do (shown in their activity log).
    action: str
    #: The operator's command that resolves it.
    remedy: str
    #: Whether a running worker would resolve it by itself (a lapsed lease).
    worker_resolves: bool = False

    def describe(self) -> str:
        return (
            f"{self.reservation_id} ({self.purpose}, {self.ref or 'no ref'}, org {self.org_id}, "
            f"${format_money(self.amount)} held since {self.created_at:%Y-%m-%d %H:%M}Z): "
            f"{self.why}; remedy: {self.remedy}"
        )


def _advice(res_id: str, sent: bool) -> tuple[str, str]:
    if sent:
        action = (
            "the call was sent and its outcome is unknown, so it was not retried and its "
            "hold stays; check whether it ran before sending it again, and ask the operator "
            "to release the hold (or settle it to what the provider charged)"
        )
    else:
        action = (
            "the request stopped before its charge was recorded; check whether you got an "
            "answer before sending it again, and ask the operator to release the hold (or "
            "settle it to what it cost)"
        )
    remedy = f"{_RELEASE.format(id=res_id)}, or {_SETTLE.format(id=res_id)}"
    return action, remedy


def stranded(conn: Connection, now: datetime, *, org_id: str | None = None) -> list[Stranded]:
    """Every held reservation that will not resolve by itself, oldest first."""
    q = select(reservations).where(reservations.c.state == "held")
    if org_id is not None:
        q = q.where(reservations.c.org_id == org_id)
    held = conn.execute(q.order_by(reservations.c.created_at)).all()
    if not held:
        return []
    ids = [r.id for r in held]
    items = {
        r.reservation_id: r
        for r in conn.execute(
            select(
                batch_items.c.reservation_id,
                batch_items.c.id,
                batch_items.c.status,
                batch_items.c.lease_expires_at,
                batch_items.c.sent_at,
            ).where(batch_items.c.reservation_id.in_(ids))
        )
    }
    run_rows = {
        r.reservation_id: r
        for r in conn.execute(
            select(runs.c.reservation_id, runs.c.id, runs.c.status, runs.c.lease_expires_at).where(
                runs.c.reservation_id.in_(ids)
            )
        )
    }
    filed = {
        r.reservation_id: r
        for r in conn.execute(
            select(file_batches.c.reservation_id, file_batches.c.id, file_batches.c.status).where(
                file_batches.c.reservation_id.in_(ids)
            )
        )
    }
    out: list[Stranded] = []
    for r in held:
        found = _judge(r, items.get(r.id), run_rows.get(r.id) or filed.get(r.id), now)
        if found is not None:
            out.append(found)
    return out


def _judge(r: Any, item: Any, run: Any, now: datetime) -> Stranded | None:
    res_id = r.id

    def make(why: str, *, sent: bool, worker: bool = False) -> Stranded:
        action, remedy = _advice(res_id, sent)
        if worker:
            action = "a worker resolves it when one runs; nothing to do"
            remedy = f"{_WORKER}; or, with no worker at all, {_RELEASE.format(id=res_id)}"
        return Stranded(
            reservation_id=res_id,
            org_id=r.org_id,
            amount=int(r.amount),
            purpose=r.purpose,
            ref=r.ref,
            created_at=r.created_at,
            why=why,
            action=action,
            remedy=remedy,
            worker_resolves=worker,
        )

    purpose = r.purpose
    if purpose == "batch":
        if item is None:
            return make("no deferred item holds it", sent=False)
        status = item.status
        if status == "uncertain":
            return make("its deferred item is uncertain", sent=True)
        if status == "dispatched":
            lease = item.lease_expires_at
            if lease is not None and lease + LEASE_SLACK < now:
                sent = item.sent_at is not None
                why = "its deferred item's lease lapsed " + (
                    "mid-call" if sent else "before the call"
                )
                return make(why, sent=sent, worker=True)
            return None
        return make(f"its deferred item is {status}", sent=False)
    if purpose == "file_batch":
        if run is None:
            return make("no file batch holds it", sent=False)
        if run.status not in FILE_BATCH_LIVE:
            return make(f"its file batch is {run.status}", sent=False)
        return None
    if purpose == "run":
        if run is None:
            return make("no run holds it", sent=False)
        status = run.status
        if status in ("completed", "failed", "canceled"):
            return make(f"its run is {status}", sent=False)
        lease = run.lease_expires_at
        if status in ("running", "stopping", "writing_outputs") and (
            lease is None or lease + LEASE_SLACK < now
        ):
            return make("its run's lease lapsed", sent=False, worker=True)
        return None
    if r.created_at + SYNC_HOLD_LIMIT < now:
        kind = purpose if purpose in _SYNC else f"a {purpose} call"
        return make(f"the {kind} request outlived its hold", sent=False)
    return None


def flagged(conn: Connection, reservation_ids: list[str]) -> set[str]:
    """Which of these holds the owner's activity already explains (uncertain or unresolved)."""
    if not reservation_ids:
        return set()
    rows = conn.execute(
        select(activity_table.c.reservation_id).where(
            activity_table.c.reservation_id.in_(reservation_ids),
            activity_table.c.kind.in_(["uncertain", "hold_unresolved"]),
        )
    )
    return {r[0] for r in rows}


def resolve(
    conn: Connection,
    reservation_id: str,
    now: datetime,
    *,
    charge: int | None,
    reason: str,
    operator: str,
) -> ledger.Reservation:
    """Release a held reservation (``charge`` None) or settle it to ``charge``, with a record."""
    res = ledger.get_reservation(conn, reservation_id, lock=True)
    if res.state != "held":
        raise InvalidState(f"reservation {reservation_id} is already {res.state}")
    detail = {"purpose": res.purpose, "reason": "operator", "note": reason, "operator": operator}
    if charge is None:
        return billing.release(conn, reservation_id, now, ref=res.ref, detail=detail).reservation
    return billing.settle(conn, reservation_id, charge, now, ref=res.ref, detail=detail).reservation
