"""The credit ledger: append-only entries, and reservations that resolve once.

A reservation is a pending transfer (TigerBeetle's model): ``reserve`` holds
the most a call can cost, ``settle`` posts the real charge and releases the
rest, ``release`` voids it. A reservation resolves at most once, a charge can
never exceed what was held, and the balance is derived from the entries
(``balances`` is a cache of the sums, written in the same transaction and
re-derived by ``audit``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, case, func, insert, select, update

from batchyard.core.ids import new_id
from batchyard.core.money import format_money, from_ticks
from batchyard.core.tiers import Tier, tier_for_purchases
from batchyard.errors import InsufficientCredit, InvalidRequest, InvalidState, NotFound
from batchyard.store import spend_caps
from batchyard.store.tables import balances, ledger_entries, organisations, reservations

__all__ = [
    "Balance",
    "Reservation",
    "audit",
    "balance",
    "get_reservation",
    "release",
    "reserve",
    "settle",
    "top_up",
]


@dataclass(frozen=True, slots=True)
class Balance:
    topups: int
    settled: int
    held: int

    @property
    def available(self) -> int:
        return self.topups - self.settled - self.held


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    org_id: str
    amount: int
    state: str
    charged: int | None
    purpose: str
    ref: str | None
    key_id: str | None = None
    project_id: str | None = None
    created_at: datetime | None = None


# The hot path (reserve, settle, release run twice per model call) executes
# statements built once here: SQLAlchemy then skips building and hashing a new
# statement on every call, which was most of the ledger's CPU time.
_INSERT_ENTRY = insert(ledger_entries)
_INSERT_RESERVATION = insert(reservations)
_BALANCE = select(balances.c.topups, balances.c.settled, balances.c.held).where(
    balances.c.org_id == bindparam("b_org")
)
_BALANCE_FOR_UPDATE = _BALANCE.with_for_update()
_BALANCE_AND_RULE = (
    select(
        balances.c.topups,
        balances.c.settled,
        balances.c.held,
        organisations.c.auto_topup_threshold,
        organisations.c.auto_topup_amount,
        spend_caps.any_cap(bindparam("c_key_id"), bindparam("c_project_id")),
    )
    .join(organisations, organisations.c.id == balances.c.org_id)
    .where(balances.c.org_id == bindparam("b_org"))
)
_BALANCE_AND_RULE_FOR_UPDATE = _BALANCE_AND_RULE.with_for_update(of=balances)
_MOVE_BALANCE = (
    update(balances)
    .where(balances.c.org_id == bindparam("b_org"))
    .values(
        topups=balances.c.topups + bindparam("d_topups"),
        settled=balances.c.settled + bindparam("d_settled"),
        held=balances.c.held + bindparam("d_held"),
    )
)
_RESERVATION = select(reservations).where(reservations.c.id == bindparam("r_id"))
_RESERVATION_FOR_UPDATE = _RESERVATION.with_for_update()
_CHARGE = bindparam("r_charge", type_=reservations.c.amount.type)
# A held reservation resolved, what it holds read back from the same statement (and whether
# its key or project has a spend cap): the charge is what was asked, at most the hold
# (``settle``), 0 for a release.
_RESOLVE = (
    update(reservations)
    .where(reservations.c.id == bindparam("r_id"), reservations.c.state == "held")
    .values(
        state=bindparam("r_state"),
        charged=case((reservations.c.amount < _CHARGE, reservations.c.amount), else_=_CHARGE),
        resolved_at=bindparam("r_at"),
    )
    .returning(
        *(reservations.c[f.name] for f in dataclasses.fields(Reservation)),
        spend_caps.any_cap(reservations.c.key_id, reservations.c.project_id),
    )
)


def _entries(conn: Connection, rows: list[dict[str, object]]) -> None:
    if rows:
        conn.execute(_INSERT_ENTRY, rows)


def _entry_row(
    org_id: str,
    kind: str,
    amount: int,
    now: datetime,
    reservation_id: str | None = None,
    memo: str | None = None,
) -> dict[str, object]:
    return {
        "org_id": org_id,
        "kind": kind,
        "amount": amount,
        "reservation_id": reservation_id,
        "memo": memo,
        "created_at": now,
    }


def _move(
    conn: Connection, org_id: str, *, topups: int = 0, settled: int = 0, held: int = 0
) -> None:
    conn.execute(
        _MOVE_BALANCE, {"b_org": org_id, "d_topups": topups, "d_settled": settled, "d_held": held}
    )


def _locked_balance(conn: Connection, org_id: str) -> Balance:
    q = _BALANCE_FOR_UPDATE if conn.dialect.name == "postgresql" else _BALANCE
    row = conn.execute(q, {"b_org": org_id}).first()
    if row is None:
        raise NotFound(f"organisation {org_id} not found")
    return Balance(row.topups, row.settled, row.held)


def balance(conn: Connection, org_id: str) -> Balance:
    row = conn.execute(select(balances).where(balances.c.org_id == org_id)).first()
    if row is None:
        raise NotFound(f"organisation {org_id} not found")
    return Balance(row.topups, row.settled, row.held)


def top_up(
    conn: Connection,
    org_id: str,
    amount: int,
    now: datetime,
    *,
    tiers: Sequence[Tier] | None = None,
    memo: str = "operator",
) -> Balance:
    """Add credit, and move the organisation up a tier if its purchases now reach one."""
    if amount <= 0:
        raise InvalidRequest("a top-up must be a positive amount", param="amount")
    bal = _locked_balance(conn, org_id)
    _entries(conn, [_entry_row(org_id, "topup", amount, now, memo=memo)])
    _move(conn, org_id, topups=amount)
    if tiers:
        current = conn.execute(
            select(organisations.c.tier).where(organisations.c.id == org_id)
        ).scalar_one()
        earned = tier_for_purchases(tiers, from_ticks(bal.topups + amount)).level
        if earned > current:
            conn.execute(
                update(organisations).where(organisations.c.id == org_id).values(tier=earned)
            )
    return Balance(bal.topups + amount, bal.settled, bal.held)


def reserve(
    conn: Connection,
    org_id: str,
    amount: int,
    now: datetime,
    *,
    purpose: str,
    ref: str | None = None,
    tiers: Sequence[Tier] | None = None,
    key_id: str | None = None,
    project_id: str | None = None,
) -> Reservation:
    """Hold ``amount`` ticks, topping up first where an automatic rule says so.

    Raises ``InsufficientCredit`` (402) and writes nothing when the credit,
    after any automatic top-up, cannot cover the hold, and ``SpendCapExceeded``
    (402) when it would cross a spend cap of ``key_id`` or ``project_id``
    (``store.spend_caps``).
    """
    if amount < 0:
        raise InvalidRequest("a reservation cannot be negative")
    q = _BALANCE_AND_RULE_FOR_UPDATE if conn.dialect.name == "postgresql" else _BALANCE_AND_RULE
    row = conn.execute(q, {"b_org": org_id, "c_key_id": key_id, "c_project_id": project_id}).first()
    if row is None:
        raise NotFound(f"organisation {org_id} not found")
    bal = Balance(row.topups, row.settled, row.held)
    if (
        row.auto_topup_amount
        and row.auto_topup_threshold is not None
        and bal.available - amount < row.auto_topup_threshold
    ):
        bal = top_up(conn, org_id, row.auto_topup_amount, now, tiers=tiers, memo="auto top-up")
    if bal.available < amount:
        raise InsufficientCredit(
            f"this call can cost up to ${format_money(amount)} and the credit available is "
            f"${format_money(max(bal.available, 0))}; nothing was charged",
            details={
                "required": format_money(amount),
                "available": format_money(max(bal.available, 0)),
            },
        )
    if row.capped:
        spend_caps.hold(conn, spend_caps.holders_of(key_id, project_id), amount, now)
    res_id = new_id("res", now)
    conn.execute(
        _INSERT_RESERVATION,
        {
            "id": res_id,
            "org_id": org_id,
            "amount": amount,
            "state": "held",
            "purpose": purpose,
            "ref": ref,
            "created_at": now,
            "key_id": key_id,
            "project_id": project_id,
        },
    )
    # A free call (a zero-priced route) holds nothing: entries are always positive.
    if amount:
        _entries(conn, [_entry_row(org_id, "reserve", amount, now, reservation_id=res_id)])
        _move(conn, org_id, held=amount)
    return Reservation(res_id, org_id, amount, "held", None, purpose, ref, key_id, project_id, now)


def get_reservation(conn: Connection, reservation_id: str, *, lock: bool = False) -> Reservation:
    q = _RESERVATION_FOR_UPDATE if lock and conn.dialect.name == "postgresql" else _RESERVATION
    row = conn.execute(q, {"r_id": reservation_id}).first()
    if row is None:
        raise NotFound(f"reservation {reservation_id} not found")
    return _reservation(row)


def _reservation(row: Any) -> Reservation:
    return Reservation(
        row.id,
        row.org_id,
        row.amount,
        row.state,
        row.charged,
        row.purpose,
        row.ref,
        row.key_id,
        row.project_id,
        row.created_at,
    )


def _resolve(
    conn: Connection, reservation_id: str, state: str, charge: int, now: datetime
) -> tuple[Reservation, bool]:
    """Mark a held reservation ``state``, charged ``charge`` (at most its hold): it as it now
    stands, and whether its key or project has a spend cap.

    One statement checks, writes and reads back (``_RESOLVE``); a reservation
    that is not held is read only to say why (``NotFound``, ``InvalidState``).
    """
    params = {"r_id": reservation_id, "r_state": state, "r_charge": max(0, charge), "r_at": now}
    row = conn.execute(_RESOLVE, params).first()
    if row is None:
        res = get_reservation(conn, reservation_id)
        raise InvalidState(f"reservation {reservation_id} is already {res.state}")
    return _reservation(row), bool(row.capped)


def settle(conn: Connection, reservation_id: str, charge: int, now: datetime) -> Reservation:
    """Post the real charge against a held reservation and release the rest.

    A charge above the hold posts the hold: the caller was promised that the
    quote is the most a call can cost. It is a defect all the same, and
    ``store.billing.settle`` records it (``over_hold``); ``audit`` lists it.
    """
    res, capped = _resolve(conn, reservation_id, "settled", charge, now)
    charged = res.charged or 0
    rest = res.amount - charged
    rows = []
    if charged:
        rows.append(_entry_row(res.org_id, "settle", charged, now, reservation_id=res.id))
    if rest:
        rows.append(_entry_row(res.org_id, "release", rest, now, reservation_id=res.id))
    _entries(conn, rows)
    _move(conn, res.org_id, settled=charged, held=-res.amount)
    if capped:
        _resolve_caps(conn, res, now)
    return res


def release(conn: Connection, reservation_id: str, now: datetime) -> Reservation:
    """Void a held reservation: nothing is charged."""
    res, capped = _resolve(conn, reservation_id, "released", 0, now)
    if res.amount:
        _entries(conn, [_entry_row(res.org_id, "release", res.amount, now, reservation_id=res.id)])
    _move(conn, res.org_id, held=-res.amount)
    if capped:
        _resolve_caps(conn, res, now)
    return res


def _resolve_caps(conn: Connection, res: Reservation, now: datetime) -> None:
    """The resolved hold under its key's and project's caps: after the balance, as a hold
    takes the balance's row before the caps' (two rows locked in one order)."""
    holders = spend_caps.holders_of(res.key_id, res.project_id)
    if res.created_at is not None:
        spend_caps.resolve(conn, holders, res.amount, res.charged or 0, res.created_at, now)


def audit(conn: Connection) -> list[str]:
    """Every ledger invariant that does not hold, in words; empty means sound.

    - balance = top-ups − settled charges − held reservations, per organisation,
      both from the entries and in the cached balance row;
    - no organisation's available credit is negative;
    - every reserve, settle and release names an existing reservation of the
      same organisation; a held reservation has only its reserve entry; a
      resolved one has settle + release equal to its hold, each at most once;
    - no entry has a non-positive amount or an unknown kind.
    """
    problems: list[str] = []
    bad = conn.execute(
        select(ledger_entries.c.id, ledger_entries.c.kind, ledger_entries.c.amount).where(
            (ledger_entries.c.amount <= 0)
            | ledger_entries.c.kind.not_in(["topup", "reserve", "settle", "release"])
        )
    ).all()
    problems += [f"entry {r.id}: kind {r.kind!r} amount {r.amount}" for r in bad]
    orphans = conn.execute(
        select(ledger_entries.c.id).where(
            ledger_entries.c.kind.in_(["reserve", "settle", "release"]),
            ledger_entries.c.reservation_id.is_(None),
        )
    ).all()
    problems += [f"entry {r.id}: names no reservation" for r in orphans]

    sums: dict[tuple[str, str], int] = {}
    for r in conn.execute(
        select(
            ledger_entries.c.org_id, ledger_entries.c.kind, func.sum(ledger_entries.c.amount)
        ).group_by(ledger_entries.c.org_id, ledger_entries.c.kind)
    ):
        sums[(r[0], r[1])] = int(r[2] or 0)
    for b in conn.execute(select(balances)):
        topups = sums.get((b.org_id, "topup"), 0)
        reserved = sums.get((b.org_id, "reserve"), 0)
        settled = sums.get((b.org_id, "settle"), 0)
        released = sums.get((b.org_id, "release"), 0)
        held = reserved - settled - released
        if (b.topups, b.settled, b.held) != (topups, settled, held):
            problems.append(
                f"{b.org_id}: cached balance (topups {b.topups}, settled {b.settled}, "
                f"held {b.held}) != entries (topups {topups}, settled {settled}, held {held})"
            )
        if topups - settled - held < 0:
            problems.append(f"{b.org_id}: available credit is negative")

    per_res: dict[str, dict[str, list[int]]] = {}
    for e in conn.execute(
        select(
            ledger_entries.c.reservation_id,
            ledger_entries.c.kind,
            ledger_entries.c.amount,
            ledger_entries.c.org_id,
        ).where(ledger_entries.c.reservation_id.is_not(None))
    ):
        per_res.setdefault(e.reservation_id, {}).setdefault(e.kind, []).append(e.amount)
        per_res[e.reservation_id].setdefault("_org", []).append(hash(e.org_id))
    seen: set[str] = set()
    for res in conn.execute(select(reservations)):
        seen.add(res.id)
        ents = per_res.get(res.id, {})
        rs, st, rl = ents.get("reserve", []), ents.get("settle", []), ents.get("release", [])
        if rs != [res.amount] and not (res.amount == 0 and rs == []):
            problems.append(f"{res.id}: reserve entries {rs} != hold {res.amount}")
        if len(set(ents.get("_org", []))) > 1:
            problems.append(f"{res.id}: entries from more than one organisation")
        if len(st) > 1 or len(rl) > 1:
            problems.append(f"{res.id}: resolved more than once")
        if res.state == "held" and (st or rl):
            problems.append(f"{res.id}: held but has settle/release entries")
        if res.state in ("settled", "released"):
            charged = sum(st)
            if charged + sum(rl) != res.amount:
                problems.append(
                    f"{res.id}: settle {charged} + release {sum(rl)} != hold {res.amount}"
                )
            if charged != (res.charged or 0):
                problems.append(f"{res.id}: charged {res.charged} != settle entries {charged}")
        if res.state not in ("held", "settled", "released"):
            problems.append(f"{res.id}: unknown state {res.state!r}")
    for rid in per_res:
        if rid not in seen:
            problems.append(f"entries name unknown reservation {rid}")
    return problems
