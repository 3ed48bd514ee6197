"""Billing: reserve, settle and release a hold, each with its activity record, in one place.

The ledger (``store.ledger``) keeps the money right: a hold resolves once, a
charge never exceeds it. What an owner reads about it is the activity log
(``store.activity``). Every door and every worker moves money through these
three functions, inside the transaction that also changes its own state (the
run funded, the item dispatched, the batch finalized), so the money and the
record of it can never part:

- ``reserve``: hold the most a call (or a run, or a batch) can cost; a 402
  (``InsufficientCredit``) when the credit cannot cover it;
- ``settle``: charge what it really cost, release the rest, record ``charge``;
- ``release``: charge nothing, record ``release`` with why.

``settle`` and ``release`` with ``if_held`` resolve only a hold that is still
held and otherwise report how it was resolved, so a worker that finishes work
another path already resolved (recovery, an operator) changes nothing.
Connection-level: the caller owns the transaction (the dispatcher's group
commit, a worker's claim or finalize).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from batchyard.core.tiers import Tier
from batchyard.store import activity, ledger

__all__ = ["Resolved", "release", "reserve", "settle"]


@dataclass(frozen=True, slots=True)
class Resolved:
    """A hold after ``settle`` or ``release``: as it stands, and whether this call resolved it."""

    reservation: ledger.Reservation
    #: False when ``if_held`` found it already settled or released: nothing was written.
    now: bool

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
    if savepoint:
        with conn.begin_nested():
            res = ledger.reserve(
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
    else:
        res = ledger.reserve(
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
    """Charge ``charge`` (capped at the hold), release the rest, and record the ``charge``."""
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
    if charge is None:
        done, kind, amount = ledger.release(conn, reservation_id, now), "release", None
    else:
        done, kind = ledger.settle(conn, reservation_id, charge, now), "charge"
        amount = done.charged
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
    return Resolved(done, True)
