"""Billing: reserve, settle and release a hold, each with its activity record, in one place.

The ledger (``store.ledger``) keeps the money right: a hold resolves once, a
charge never exceeds it. What an owner reads about it is the activity log
(``store.activity``). Every door and every worker moves money through these
three functions, inside the transaction that also changes its own state (the
run funded, the item dispatched, the batch finalized), so the money and the
record of it can never part:

- ``reserve``: hold the most a call (or a run, or a batch) can cost; a 402
  (``InsufficientCredit``) when the credit cannot cover it;
- ``settle``: charge what it really cost, release the rest, record ``charge``.
  A charge above its hold is a defect (the quote undercounted what the call
  would read): the ledger still posts no more than the hold, so the caller's
  credit never goes below what it was promised, but the record says so
  (``over_hold``, the ticks not charged), the settler counts it on
  ``/metrics`` (``Resolved.over``), and ``batchyard audit`` lists it;
- ``release``: charge nothing, record ``release`` with why.

``settle`` and ``release`` with ``if_held`` resolve only a hold that is still
held and otherwise report how it was resolved, so a worker that finishes work
another path already resolved (recovery, an operator) changes nothing.
Connection-level: the caller owns the transaction (the dispatcher's group
commit, a worker's claim or finalize).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select

from batchyard.core.quotes import repriced
from batchyard.core.tiers import Tier
from batchyard.store import activity, ledger
from batchyard.store.tables import activity as activity_table

__all__ = ["Resolved", "audit_charges", "release", "reserve", "settle"]

log = logging.getLogger("batchyard.billing")


@dataclass(frozen=True, slots=True)
class Resolved:
    """A hold after ``settle`` or ``release``: as it stands, and whether this call resolved it."""

    reservation: ledger.Reservation
    #: False when ``if_held`` found it already settled or released: nothing was written.
    now: bool
    #: Ticks asked above the hold (a defect: recorded as ``over_hold``), 0 when none.
    over: int = 0

    @property
    def charged(self) -> int:
        """What the hold was charged (by this call or the one that resolved it)."""
        return self.reservation.charged or 0


def reserve(
    conn: Connection,
    org_id: str,
    amount: int,
    now: datetime,
    *,
    purpose: str,
    ref: str | None = None,
    tiers: Sequence[Tier] | None = None,
    record: str | None = None,
    detail: dict[str, Any] | None = None,
    savepoint: bool = False,
    key_id: str | None = None,
    project_id: str | None = None,
) -> ledger.Reservation:
    """Hold ``amount`` ticks for ``purpose``; ``InsufficientCredit`` when it cannot be held.

    ``record`` names an activity kind to show the hold under (a deferred item's
    ``dispatch``); most holds are shown when they resolve. ``savepoint``: for a
    caller that goes on with its transaction after a refusal, so an automatic
    top-up tried on the way is not kept either. ``key_id`` and ``project_id``:
    who spends it, for their spend caps (``store.spend_caps``).
    """

    def hold() -> ledger.Reservation:
        return ledger.reserve(
            conn,
            org_id,
            amount,
            now,
            purpose=purpose,
            ref=ref,
            tiers=tiers,
            key_id=key_id,
            project_id=project_id,
        )

    if savepoint:
        with conn.begin_nested():
            res = hold()
    else:
        res = hold()
    if record is not None:
        activity.record(
            conn,
            org_id,
            record,
            now,
            ref=ref,
            reservation_id=res.id,
            amount=res.amount,
            detail=detail,
        )
    return res


def settle(
    conn: Connection,
    reservation_id: str,
    charge: int,
    now: datetime,
    *,
    ref: str | None,
    detail: dict[str, Any],
    if_held: bool = False,
) -> Resolved:
    """Charge ``charge``, release the rest, and record the ``charge``.

    A charge above the hold posts the hold and records the rest as ``over_hold``
    (``Resolved.over``): never capped silently.
    """
    return _resolve(conn, reservation_id, now, charge, ref, detail, if_held)


def release(
    conn: Connection,
    reservation_id: str,
    now: datetime,
    *,
    ref: str | None,
    detail: dict[str, Any],
    if_held: bool = False,
) -> Resolved:
    """Charge nothing: void the hold and record the ``release`` (``detail`` says why)."""
    return _resolve(conn, reservation_id, now, None, ref, detail, if_held)


def _resolve(
    conn: Connection,
    reservation_id: str,
    now: datetime,
    charge: int | None,
    ref: str | None,
    detail: dict[str, Any],
    if_held: bool,
) -> Resolved:
    """Settle the hold to ``charge`` (None: release it) and record it, its amount what moved."""
    if if_held:
        res = ledger.get_reservation(conn, reservation_id, lock=True)
        if res.state != "held":
            return Resolved(res, False)
    over = 0
    if charge is None:
        done, kind, amount = ledger.release(conn, reservation_id, now), "release", None
    else:
        done, kind = ledger.settle(conn, reservation_id, charge, now), "charge"
        amount = done.charged
        over = max(0, charge - done.amount)
        if over:
            detail = {**detail, "over_hold": over}
            log.error(
                "charge above its hold",
                extra={"reservation_id": reservation_id, "hold": done.amount, "over": over},
            )
    activity.record(
        conn,
        done.org_id,
        kind,
        now,
        ref=ref,
        reservation_id=reservation_id,
        amount=done.amount if amount is None else amount,
        detail=detail,
    )
    return Resolved(done, True, over)


def audit_charges(conn: Connection) -> list[str]:
    """Every settled charge that differs from the usage its activity record names, in words.

    A call's record names its usage and its price (``core.quotes.Charge.detail``):
    its amount must be that usage at that price, to the tick. A batch's or a
    run's record sums its lines, each priced by the same rule when it ended;
    any record that says ``over_hold`` was asked more than its hold. Empty
    means every charge is what its usage came to.
    """
    problems: list[str] = []
    rows = conn.execute(
        select(
            activity_table.c.id,
            activity_table.c.reservation_id,
            activity_table.c.amount,
            activity_table.c.detail,
        ).where(activity_table.c.kind == "charge")
    )
    for row in rows:
        detail = json.loads(row.detail) if row.detail else {}
        over = detail.get("over_hold")
        if over:
            problems.append(
                f"{row.id} (reservation {row.reservation_id}): charged {row.amount} ticks, "
                f"{over} short of its usage: the charge was above its hold"
            )
            continue
        due = repriced(detail)
        if due is not None and due != row.amount:
            problems.append(
                f"{row.id} (reservation {row.reservation_id}): charged {row.amount} ticks "
                f"but its usage at its price comes to {due}"
            )
    return problems
