"""Spend caps on API keys and projects: a total and a calendar month (UTC), at every hold.

An organisation's credit bounds what all of it may spend; a cap bounds one
key (the batch job a contractor runs) or one project (a team's runs). A cap
is enforced where money is held (``store.ledger.reserve``, which every door
and worker reaches through ``store.billing``), so a batch, a run and a single
call are refused alike, before anything is held, when their quote would cross
it: what is held and what was charged under the cap, plus the new hold, may
never exceed it.

Each capped holder has one row, locked by the hold that reads it, so
concurrent holds on one key queue behind each other and cannot both pass
the last cent. The row keeps running sums (held and settled, in total and
in the current month); a hold counts against the month it was made in, and
its settlement moves that month's sums only while the row still counts that
month. A holder with no cap has no row, and a hold and its settlement learn so
from a column of statements they make anyway (``any_cap``): they read nothing more.
Setting a cap later counts what the holder's reservations already hold and
were charged (they name their key and project), so a cap set today includes
today's spend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    Connection,
    ForeignKey,
    Label,
    Select,
    String,
    Table,
    bindparam,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)

from batchyard.core.money import format_money
from batchyard.errors import SpendCapExceeded
from batchyard.store.tables import UtcDateTime, metadata, reservations

__all__ = [
    "CapRow",
    "any_cap",
    "caps_of_org",
    "hold",
    "holders_of",
    "month_of",
    "resolve",
    "set_cap",
    "spend_caps",
]

spend_caps = Table(
    "spend_caps",
    metadata,
    # "key:<key id>" or "project:<project id>".
    Column("holder", String(80), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False, index=True),
    Column("total_cap", BigInteger, nullable=True),
    Column("monthly_cap", BigInteger, nullable=True),
    Column("total_held", BigInteger, nullable=False, default=0),
    Column("total_settled", BigInteger, nullable=False, default=0),
    # The calendar month (UTC, "2026-12") the month sums count.
    Column("month", String(7), nullable=False),
    Column("month_held", BigInteger, nullable=False, default=0),
    Column("month_settled", BigInteger, nullable=False, default=0),
    Column("updated_at", UtcDateTime(), nullable=False),
)


@dataclass(frozen=True, slots=True)
class CapRow:
    holder: str
    org_id: str
    total_cap: int | None
    monthly_cap: int | None
    total_held: int
    total_settled: int
    month: str
    month_held: int
    month_settled: int

    def rolled(self, month: str) -> CapRow:
        """The row as it counts ``month`` (a new month starts from nothing)."""
        if month == self.month:
            return self
        return CapRow(
            self.holder,
            self.org_id,
            self.total_cap,
            self.monthly_cap,
            self.total_held,
            self.total_settled,
            month,
            0,
            0,
        )

    def view(self) -> dict[str, object]:
        """The holder's spend against each cap, as ``/v1/account`` shows it."""
        kind, _, ident = self.holder.partition(":")

        def one(cap: int | None, held: int, settled: int) -> dict[str, str | None]:
            left = None if cap is None else format_money(max(cap - held - settled, 0))
            return {
                "cap": None if cap is None else format_money(cap),
                "charged": format_money(settled),
                "held": format_money(held),
                "left": left,
            }

        return {
            "holder": kind,
            "id": ident,
            "total": one(self.total_cap, self.total_held, self.total_settled),
            "monthly": {
                "month": self.month,
                **one(self.monthly_cap, self.month_held, self.month_settled),
            },
        }


def month_of(when: datetime) -> str:
    return f"{when.year:04d}-{when.month:02d}"


def holders_of(key_id: str | None, project_id: str | None) -> list[str]:
    """The holders a hold of this key (and project) counts against."""
    found = []
    if key_id is not None:
        found.append(f"key:{key_id}")
    if project_id is not None:
        found.append(f"project:{project_id}")
    return found


def any_cap(key_id: ColumnElement[str], project_id: ColumnElement[str]) -> Label[bool]:
    """Whether a hold's key or project has a cap, as a column of another statement.

    The ledger reads it with the statements a hold and its settlement make anyway
    (the balance read of ``store.ledger.reserve``, the reservation's update of its
    ``settle`` and ``release``), so a hold whose holders have no cap, the most
    common, costs no statement of its own here; one that has reads its rows.
    """
    holder = spend_caps.c.holder
    found = exists().where(or_(holder == "key:" + key_id, holder == "project:" + project_id))
    return found.label("capped")


def _row(r: object) -> CapRow:
    m = r._mapping  # type: ignore[attr-defined]
    return CapRow(**{name: m[name] for name in CapRow.__slots__})


def _holders_query(n: int, for_update: bool) -> Select[tuple[object, ...]]:
    """The rows of ``n`` holders (binds ``h0``…), in holder order: concurrent holds lock alike."""
    named = or_(*(spend_caps.c.holder == bindparam(f"h{i}") for i in range(n)))
    q = select(spend_caps).where(named).order_by(spend_caps.c.holder)
    return q.with_for_update() if for_update else q


# Built once, as the ledger's statements are (``store.ledger``): every hold and every
# settlement reads its holders' rows, and a statement built per call (an expanding ``IN``
# at that) cost several times the read itself. A hold names at most a key and a project.
_LOCKED = {(n, pg): _holders_query(n, pg) for n in (1, 2) for pg in (False, True)}
_WRITE = (
    update(spend_caps)
    .where(spend_caps.c.holder == bindparam("w_holder"))
    .values(
        total_held=bindparam("w_total_held"),
        total_settled=bindparam("w_total_settled"),
        month=bindparam("w_month"),
        month_held=bindparam("w_month_held"),
        month_settled=bindparam("w_month_settled"),
        updated_at=bindparam("w_at"),
    )
)


def _locked(conn: Connection, holders: Sequence[str]) -> list[CapRow]:
    pg = conn.dialect.name == "postgresql"
    q = _LOCKED.get((len(holders), pg))
    if q is None:
        q = _holders_query(len(holders), pg)
    return [_row(r) for r in conn.execute(q, {f"h{i}": h for i, h in enumerate(holders)})]


def _write(conn: Connection, row: CapRow, now: datetime) -> None:
    conn.execute(
        _WRITE,
        {
            "w_holder": row.holder,
            "w_total_held": row.total_held,
            "w_total_settled": row.total_settled,
            "w_month": row.month,
            "w_month_held": row.month_held,
            "w_month_settled": row.month_settled,
            "w_at": now,
        },
    )


def hold(conn: Connection, holders: Sequence[str], amount: int, now: datetime) -> None:
    """Count a new hold of ``amount`` against each capped holder, or refuse it (402).

    Nothing is written when any cap refuses it; the caller's transaction is
    the ledger's, so a refusal leaves nothing held anywhere.
    """
    if not holders:
        return
    month = month_of(now)
    rows = [r.rolled(month) for r in _locked(conn, holders)]
    for r in rows:
        kind, _, ident = r.holder.partition(":")
        for which, cap, held, settled in (
            ("total", r.total_cap, r.total_held, r.total_settled),
            (f"monthly ({month})", r.monthly_cap, r.month_held, r.month_settled),
        ):
            if cap is None or held + settled + amount <= cap:
                continue
            left = max(cap - held - settled, 0)
            raise SpendCapExceeded(
                f"{kind} {ident}'s {which} spend cap is ${format_money(cap)}: "
                f"${format_money(settled)} charged and ${format_money(held)} held leave "
                f"${format_money(left)}, and this can cost up to ${format_money(amount)}; "
                "nothing was held",
                details={
                    "holder": kind,
                    "id": ident,
                    "cap": which.split(" ")[0],
                    "limit": format_money(cap),
                    "charged": format_money(settled),
                    "held": format_money(held),
                    "left": format_money(left),
                    "available": format_money(left),
                    "required": format_money(amount),
                },
            )
    for r in rows:
        _write(
            conn,
            CapRow(
                r.holder,
                r.org_id,
                r.total_cap,
                r.monthly_cap,
                r.total_held + amount,
                r.total_settled,
                r.month,
                r.month_held + amount,
                r.month_settled,
            ),
            now,
        )


def resolve(
    conn: Connection,
    holders: Sequence[str],
    held: int,
    charged: int,
    made_at: datetime,
    now: datetime,
) -> None:
    """A hold made at ``made_at`` resolved: ``held`` no longer held, ``charged`` charged."""
    if not holders:
        return
    made = month_of(made_at)
    for r in _locked(conn, holders):
        counts = r.month == made
        _write(
            conn,
            CapRow(
                r.holder,
                r.org_id,
                r.total_cap,
                r.monthly_cap,
                r.total_held - held,
                r.total_settled + charged,
                r.month,
                r.month_held - held if counts else r.month_held,
                r.month_settled + charged if counts else r.month_settled,
            ),
            now,
        )


def _spent(
    conn: Connection, column: Column[str], ident: str, since: datetime | None
) -> tuple[int, int]:
    """``(held, charged)`` of the reservations that name this key or project."""
    q = select(
        func.coalesce(func.sum(reservations.c.amount).filter(reservations.c.state == "held"), 0),
        func.coalesce(
            func.sum(reservations.c.charged).filter(reservations.c.state == "settled"), 0
        ),
    ).where(column == ident)
    if since is not None:
        q = q.where(reservations.c.created_at >= since)
    held, charged = conn.execute(q).one()
    return int(held), int(charged)


def set_cap(
    conn: Connection,
    org_id: str,
    holder: str,
    *,
    total: int | None,
    monthly: int | None,
    now: datetime,
) -> CapRow | None:
    """Set (or, with both None, remove) a holder's caps; the row as it stands."""
    if total is None and monthly is None:
        conn.execute(delete(spend_caps).where(spend_caps.c.holder == holder))
        return None
    existing = _locked(conn, [holder])
    if existing:
        conn.execute(
            update(spend_caps)
            .where(spend_caps.c.holder == holder)
            .values(total_cap=total, monthly_cap=monthly, updated_at=now)
        )
    else:
        kind, _, ident = holder.partition(":")
        column = reservations.c.key_id if kind == "key" else reservations.c.project_id
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        total_held, total_settled = _spent(conn, column, ident, None)
        month_held, month_settled = _spent(conn, column, ident, start)
        conn.execute(
            insert(spend_caps).values(
                holder=holder,
                org_id=org_id,
                total_cap=total,
                monthly_cap=monthly,
                total_held=total_held,
                total_settled=total_settled,
                month=month_of(now),
                month_held=month_held,
                month_settled=month_settled,
                updated_at=now,
            )
        )
    return _locked(conn, [holder])[0]


def caps_of_org(conn: Connection, org_id: str, now: datetime) -> list[CapRow]:
    """Every capped key and project of the organisation, each as it counts this month."""
    q = select(spend_caps).where(spend_caps.c.org_id == org_id).order_by(spend_caps.c.holder)
    month = month_of(now)
    return [_row(r).rolled(month) for r in conn.execute(q)]
