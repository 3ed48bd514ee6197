"""Leases in the store: one way to claim, renew, fence and mark leased work, for every queue.

Every kind of leased work (a run, a file batch's line, a deferred item, and
whatever comes next) keeps its lease in the same three columns:

- ``lease_owner``: the worker that holds it;
- ``lease_expires_at``: when the lease lapses unless renewed;
- ``lease_token``: the fencing token, one more at every claim (``core.leases``).

A claim locks what it can take (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so
two workers never take the same row; SQLite's ``BEGIN IMMEDIATE`` already
makes the writer alone), then takes it: owner, expiry and token + 1 in one
statement. The new token is the one read under the lock plus one, so no
read-back is needed. Every later write of the holder (renewal, sent mark,
result, release) carries ``held_by``: a holder whose claim was superseded
changes nothing.

The per-table modules (``store.run_leases``, ``store.file_batches``,
``store.deferred_batches``) say *which* rows (their states, their order); this module
says *how*, once.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    Table,
    and_,
    false,
    or_,
    select,
    tuple_,
    update,
)

from batchyard.core.leases import Lease

__all__ = [
    "LET_GO",
    "claim",
    "free",
    "held_by",
    "held_by_each",
    "lapsed",
    "lock_skipping",
    "mark_sent",
    "pick",
    "renew",
    "take",
]

K = TypeVar("K", bound=Hashable)

#: The values that end a lease (its row is no one's until claimed again).
LET_GO: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None}


def lock_skipping(conn: Connection, q: Select[Any]) -> Select[Any]:
    """``q`` locking the rows it reads and skipping those another transaction holds (PostgreSQL).

    SQLite has one writer at a time (``BEGIN IMMEDIATE``), so the plain query
    is already safe there.
    """
    return q.with_for_update(skip_locked=True) if conn.dialect.name == "postgresql" else q


def held_by(table: Table, lease: Lease) -> ColumnElement[bool]:
    """The condition every write of a lease holder carries: the row is still under this claim."""
    return and_(table.c.lease_owner == lease.owner, table.c.lease_token == lease.token)


def held_by_each(table: Table, key: Any, held: Mapping[Any, Lease]) -> ColumnElement[bool]:
    """Rows still under these claims: each ``key``'s row with its claim's owner and token."""
    if not held:
        return false()
    return tuple_(key, table.c.lease_owner, table.c.lease_token).in_(
        [(k, lease.owner, lease.token) for k, lease in held.items()]
    )


def free(table: Table, now: datetime) -> ColumnElement[bool]:
    """No one holds the row: never leased, released, or its lease lapsed."""
    return or_(table.c.lease_expires_at.is_(None), table.c.lease_expires_at < now)


def lapsed(table: Table, now: datetime) -> ColumnElement[bool]:
    """The row's holder stopped renewing it."""
    return table.c.lease_expires_at < now


def pick(
    conn: Connection,
    table: Table,
    key: Any,
    *,
    where: Sequence[ColumnElement[bool]],
    order_by: Sequence[Any] = (),
    limit: int | None = None,
    columns: Sequence[Any] = (),
) -> list[Any]:
    """Lock the rows a claim can take: ``(key, lease_token, *columns)`` of each, in order."""
    q = select(key, table.c.lease_token, *columns).where(*where).order_by(*order_by)
    if limit is not None:
        q = q.limit(limit)
    return list(conn.execute(lock_skipping(conn, q)).all())


def take(
    conn: Connection,
    table: Table,
    key: Any,
    picked: Mapping[K, int],
    owner: str,
    until: datetime,
    *,
    where: Sequence[ColumnElement[bool]] = (),
    values: Mapping[str, Any] | None = None,
) -> dict[K, Lease]:
    """Lease the ``picked`` rows (key → the token read when they were locked) to ``owner``.

    One statement sets the owner, the expiry and the next token (and
    ``values``); each row's lease is its locked token plus one.
    """
    if not picked:
        return {}
    conn.execute(
        update(table)
        .where(*where, key.in_(list(picked)))
        .values(
            lease_owner=owner,
            lease_expires_at=until,
            lease_token=table.c.lease_token + 1,
            **dict(values or {}),
        )
    )
    return {k: Lease(owner, token + 1) for k, token in picked.items()}


def claim(
    conn: Connection,
    table: Table,
    key: Any,
    owner: str,
    until: datetime,
    *,
    where: Sequence[ColumnElement[bool]],
    order_by: Sequence[Any] = (),
    limit: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> dict[Any, Lease]:
    """``pick`` then ``take``: up to ``limit`` claimable rows, leased; key → lease, in order."""
    rows = pick(conn, table, key, where=where, order_by=order_by, limit=limit)
    return take(
        conn, table, key, {r[0]: int(r[1]) for r in rows}, owner, until, where=where, values=values
    )


def renew(
    conn: Connection, table: Table, until: datetime, *, where: Sequence[ColumnElement[bool]]
) -> int:
    """Extend the leases of the rows ``where`` names (always fenced by ``held_by``); how many."""
    return int(conn.execute(update(table).where(*where).values(lease_expires_at=until)).rowcount)


def mark_sent(
    conn: Connection,
    table: Table,
    key: Any,
    keys: Sequence[K],
    now: datetime,
    *,
    where: Sequence[ColumnElement[bool]],
) -> set[K]:
    """Record, durably, that these rows' calls are about to start; the keys that are still ours.

    ``where`` fences the write (the holder's claim, the dispatched state).
    Only a call that really started can become ``uncertain`` after a crash.
    """
    mine = and_(key.in_(list(keys)), *where)
    done = conn.execute(update(table).where(mine).values(sent_at=now)).rowcount
    if done == len(keys):
        return set(keys)
    return set(conn.execute(select(key).where(mine)).scalars())
