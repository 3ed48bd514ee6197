"""Deferred batches and their items: the queries the door and the worker need.

The tables and item states are ``store.deferred_batch_tables``. Item states:
``waiting → dispatched → succeeded | failed``; ``waiting → expired |
canceled``; ``dispatched`` whose lease lapsed ``→ uncertain`` if its call was
sent (``sent_at``, written just before the engine call), or back ``→ waiting``
(its hold released) if it never was. The worker claims a waiting item by
locking its row and leasing it (``store.leases``: the one way every queue
claims) in the transaction that reserves its credit; every later write of
the dispatch is fenced by that lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update

from batchyard.core.leases import Lease
from batchyard.store import end_order, leases
from batchyard.store.deferred_batch_tables import (
    ACTIVE,
    ITEM_STATES,
    TERMINAL,
    batch_items,
    batches,
)
from batchyard.store.tables import api_keys, organisations

__all__ = [
    "DeferredBatchRow",
    "ItemRow",
    "NewItem",
    "cancel_batch",
    "cancel_for_revoked_keys",
    "claim",
    "counts",
    "create_batch",
    "dispatched_item",
    "ended_results",
    "expire_due",
    "finish_item",
    "get_batch",
    "items_of",
    "lapsed_leases",
    "list_batches",
    "lock_org",
    "mark_dispatched",
    "mark_sent",
    "mark_uncertain",
    "pending_count",
    "purge_due",
    "refresh_batch",
    "renew",
    "results_of",
    "return_to_waiting",
    "waiting_candidates",
]


@dataclass(frozen=True, slots=True)
class DeferredBatchRow:
    id: str
    org_id: str
    key_id: str
    status: str
    min_discount: Decimal
    completion_window: str
    request_count: int
    created_at: datetime
    deadline: datetime
    cancel_requested_at: datetime | None
    completed_at: datetime | None
    purged_at: datetime | None


@dataclass(frozen=True, slots=True)
class NewItem:
    id: str
    position: int
    custom_id: str
    model: str
    min_discount: Decimal
    input_tokens: int
    max_tokens: int
    body: bytes


@dataclass(frozen=True, slots=True)
class ItemRow:
    id: str
    batch_id: str
    org_id: str
    key_id: str
    position: int
    custom_id: str
    status: str
    reason: str | None
    model: str
    min_discount: Decimal
    input_tokens: int
    max_tokens: int
    created_at: datetime
    deadline: datetime
    route: str | None
    reservation_id: str | None
    lease_expires_at: datetime | None
    result_status: int | None
    sent_at: datetime | None = None
    lease_owner: str | None = None
    lease_token: int = 0

    @property
    def lease(self) -> Lease:
        """The lease this item was read under (its holder and the fencing token of that claim)."""
        return Lease(self.lease_owner or "", self.lease_token)


_ITEM_COLUMNS = [batch_items.c[f.name] for f in fields(ItemRow)]


def _batch(row: Any) -> DeferredBatchRow:
    values = {f.name: row._mapping[f.name] for f in fields(DeferredBatchRow)}
    return DeferredBatchRow(**{**values, "min_discount": Decimal(values["min_discount"])})


def _item(row: Any) -> ItemRow:
    values = {f.name: row._mapping[f.name] for f in fields(ItemRow)}
    return ItemRow(**{**values, "min_discount": Decimal(values["min_discount"])})


# --- submission ---------------------------------------------------------------


def lock_org(conn: Connection, org_id: str) -> None:
    """Serialise an organisation's submissions so the pending limit cannot be raced.

    SQLite's ``BEGIN IMMEDIATE`` already admits one writer at a time.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(
            select(organisations.c.id).where(organisations.c.id == org_id).with_for_update()
        )


def pending_count(conn: Connection, org_id: str) -> int:
    return int(
        conn.execute(
            select(func.count())
            .select_from(batch_items)
            .where(batch_items.c.org_id == org_id, batch_items.c.status.in_(ACTIVE))
        ).scalar_one()
    )


def create_batch(
    conn: Connection,
    *,
    batch_id: str,
    org_id: str,
    key_id: str,
    min_discount: Decimal,
    completion_window: str,
    created_at: datetime,
    deadline: datetime,
    items: Sequence[NewItem],
) -> None:
    conn.execute(
        insert(batches).values(
            id=batch_id,
            org_id=org_id,
            key_id=key_id,
            status="in_progress",
            min_discount=str(min_discount),
            completion_window=completion_window,
            request_count=len(items),
            created_at=created_at,
            deadline=deadline,
        )
    )
    conn.execute(
        insert(batch_items),
        [
            {
                "id": it.id,
                "batch_id": batch_id,
                "org_id": org_id,
                "key_id": key_id,
                "position": it.position,
                "custom_id": it.custom_id,
                "status": "waiting",
                "model": it.model,
                "min_discount": str(it.min_discount),
                "input_tokens": it.input_tokens,
                "max_tokens": it.max_tokens,
                "created_at": created_at,
                "deadline": deadline,
                "body": it.body,
            }
            for it in items
        ],
    )


# --- reading --------------------------------------------------------------------


def get_batch(
    conn: Connection, org_id: str, batch_id: str, *, key_id: str | None = None
) -> DeferredBatchRow | None:
    """The batch if ``org_id`` owns it (and ``key_id`` submitted it, when given); else None."""
    q = select(batches).where(batches.c.id == batch_id, batches.c.org_id == org_id)
    if key_id is not None:
        q = q.where(batches.c.key_id == key_id)
    row = conn.execute(q).first()
    return _batch(row) if row is not None else None


def list_batches(
    conn: Connection,
    org_id: str,
    *,
    after: str | None = None,
    limit: int = 20,
    key_id: str | None = None,
) -> list[DeferredBatchRow]:
    """Newest first; ``after`` is the last ID of the previous page; ``key_id``: its own only."""
    q = select(batches).where(batches.c.org_id == org_id)
    if key_id is not None:
        q = q.where(batches.c.key_id == key_id)
    if after:
        q = q.where(batches.c.id < after)
    rows = conn.execute(q.order_by(batches.c.id.desc()).limit(limit)).all()
    return [_batch(r) for r in rows]


def items_of(conn: Connection, batch_id: str) -> list[ItemRow]:
    rows = conn.execute(
        select(*_ITEM_COLUMNS)
        .where(batch_items.c.batch_id == batch_id)
        .order_by(batch_items.c.position)
    ).all()
    return [_item(r) for r in rows]


def results_of(conn: Connection, batch_id: str) -> list[tuple[ItemRow, bytes | None]]:
    rows = conn.execute(
        select(*_ITEM_COLUMNS, batch_items.c.result)
        .where(batch_items.c.batch_id == batch_id)
        .order_by(batch_items.c.position)
    ).all()
    return [(_item(r), r.result) for r in rows]


def counts(conn: Connection, batch_ids: Iterable[str]) -> dict[str, dict[str, int]]:
    """Items per status for each batch, every state present (zero when none)."""
    ids = list(batch_ids)
    out = {b: dict.fromkeys(ITEM_STATES, 0) for b in ids}
    if not ids:
        return out
    rows = conn.execute(
        select(batch_items.c.batch_id, batch_items.c.status, func.count())
        .where(batch_items.c.batch_id.in_(ids))
        .group_by(batch_items.c.batch_id, batch_items.c.status)
    ).all()
    for batch_id, status, n in rows:
        out[batch_id][status] = int(n)
    return out


# --- transitions ------------------------------------------------------------------


def _number_ended(conn: Connection, batch_id: str) -> None:
    """Give the items that just ended their end numbers (``store.end_order``), by position.

    Every path that ends an item refreshes its batch after it, so this is the
    one place they are numbered; an uncertain item whose late answer lands
    is numbered again (its result changed), and a reader following the batch
    sees it once more.
    """
    bi = batch_items
    ended = (
        conn.execute(
            select(bi.c.id)
            .where(bi.c.batch_id == batch_id, bi.c.ended_seq.is_(None), bi.c.status.in_(TERMINAL))
            .order_by(bi.c.position)
        )
        .scalars()
        .all()
    )
    if not ended:
        return
    first = end_order.take(conn, batches, batches.c.id, batch_id, len(ended))
    conn.execute(
        update(bi).where(bi.c.id == bindparam("b_id")).values(ended_seq=bindparam("b_seq")),
        [{"b_id": item_id, "b_seq": first + i} for i, item_id in enumerate(ended)],
    )


def ended_results(
    conn: Connection, batch_id: str, *, after: int, limit: int
) -> list[tuple[int, ItemRow, bytes | None]]:
    """``(end number, item, sealed result)`` of items that ended after ``after``, in end order."""
    bi = batch_items
    rows = conn.execute(
        select(bi.c.ended_seq, *_ITEM_COLUMNS, bi.c.result)
        .where(bi.c.batch_id == batch_id, bi.c.ended_seq > after)
        .order_by(bi.c.ended_seq)
        .limit(limit)
    ).all()
    return [(int(r.ended_seq), _item(r), r.result) for r in rows]


def refresh_batch(conn: Connection, batch_id: str, now: datetime) -> str:
    """Number the items that ended and recompute the status; stamps ``completed_at`` once."""
    _number_ended(conn, batch_id)
    row = conn.execute(
        select(batches.c.status, batches.c.cancel_requested_at, batches.c.completed_at).where(
            batches.c.id == batch_id
        )
    ).first()
    if row is None:
        return "missing"
    per = counts(conn, [batch_id])[batch_id]
    active = per["waiting"] + per["dispatched"]
    if active:
        status = "canceling" if row.cancel_requested_at is not None else "in_progress"
        completed_at = None
    else:
        total = sum(per.values())
        if row.cancel_requested_at is not None:
            status = "canceled"
        elif per["expired"] and per["expired"] == total:
            status = "expired"
        elif per["canceled"] and per["canceled"] == total:
            status = "canceled"  # every item canceled (its key revoked): nothing ran
        else:
            status = "completed"
        completed_at = row.completed_at or now
    if status != row.status or completed_at != row.completed_at:
        conn.execute(
            update(batches)
            .where(batches.c.id == batch_id)
            .values(status=status, completed_at=completed_at)
        )
    return status


def _refresh_all(conn: Connection, batch_ids: Iterable[str], now: datetime) -> None:
    for batch_id in sorted(set(batch_ids)):
        refresh_batch(conn, batch_id, now)


def cancel_batch(conn: Connection, batch_id: str, now: datetime) -> int:
    """Stop the batch's waiting items; dispatched ones may finish. Returns how many stopped."""
    conn.execute(
        update(batches)
        .where(batches.c.id == batch_id, batches.c.cancel_requested_at.is_(None))
        .values(cancel_requested_at=now)
    )
    result = conn.execute(
        update(batch_items)
        .where(batch_items.c.batch_id == batch_id, batch_items.c.status == "waiting")
        .values(status="canceled", reason="canceled", finished_at=now, body=None)
    )
    refresh_batch(conn, batch_id, now)
    return int(result.rowcount or 0)


def _transition_waiting(
    conn: Connection, where: Any, status: str, reason: str, now: datetime
) -> int:
    """Move matching waiting items to ``status``; returns how many moved."""
    touched = (
        conn.execute(
            select(batch_items.c.batch_id)
            .where(batch_items.c.status == "waiting", where)
            .distinct()
        )
        .scalars()
        .all()
    )
    if not touched:
        return 0
    result = conn.execute(
        update(batch_items)
        .where(batch_items.c.status == "waiting", where)
        .values(status=status, reason=reason, finished_at=now, body=None)
    )
    _refresh_all(conn, touched, now)
    return int(result.rowcount or 0)


def expire_due(conn: Connection, now: datetime) -> int:
    """Waiting items whose deadline has come: never dispatched, so ``expired``."""
    return _transition_waiting(conn, batch_items.c.deadline <= now, "expired", "deadline", now)


def cancel_for_revoked_keys(conn: Connection, now: datetime) -> int:
    """Waiting items whose submitting key is revoked (or gone): ``canceled``."""
    active_keys = select(api_keys.c.id).where(api_keys.c.revoked_at.is_(None))
    return _transition_waiting(
        conn, batch_items.c.key_id.not_in(active_keys), "canceled", "key_revoked", now
    )


def lapsed_leases(conn: Connection, now: datetime, *, lock: bool = True) -> list[ItemRow]:
    """Dispatched items whose worker stopped renewing: their outcome is unknown."""
    q = select(*_ITEM_COLUMNS).where(
        batch_items.c.status == "dispatched", leases.lapsed(batch_items, now)
    )
    return [_item(r) for r in conn.execute(leases.lock_skipping(conn, q) if lock else q).all()]


def mark_uncertain(
    conn: Connection, item: ItemRow, now: datetime, reason: str = "interrupted"
) -> bool:
    """A sent call whose outcome is unknown: ``uncertain``, body dropped (the caller releases)."""
    done = conn.execute(
        update(batch_items)
        .where(
            batch_items.c.id == item.id,
            batch_items.c.status == "dispatched",
            batch_items.c.reservation_id == item.reservation_id,
        )
        # The owner and token stay: a late answer of this very dispatch may still land.
        .values(
            status="uncertain", reason=reason, finished_at=now, lease_expires_at=None, body=None
        )
    ).rowcount
    if done:
        refresh_batch(conn, item.batch_id, now)
    return bool(done)


def return_to_waiting(
    conn: Connection, item: ItemRow, now: datetime, *, unmark: bool = False
) -> bool:
    """A dispatched item whose call never started goes back to waiting (the caller releases).

    ``unmark``: the worker knows the call never left (the route refused the
    connection), so a sent mark does not keep it back; it is taken back.
    """
    q = update(batch_items).where(
        batch_items.c.id == item.id,
        batch_items.c.status == "dispatched",
        batch_items.c.reservation_id == item.reservation_id,
    )
    if not unmark:
        q = q.where(batch_items.c.sent_at.is_(None))
    done = conn.execute(
        q.values(
            status="waiting",
            route=None,
            reservation_id=None,
            dispatched_at=None,
            sent_at=None,
            **leases.LET_GO,
        )
    ).rowcount
    return bool(done)


def dispatched_item(
    conn: Connection,
    item_id: str,
    lease: Lease,
    states: Sequence[str] = ("dispatched",),
) -> ItemRow | None:
    """The item if it is still in ``states`` under this claim (locked on PostgreSQL)."""
    q = select(*_ITEM_COLUMNS).where(
        batch_items.c.id == item_id,
        batch_items.c.status.in_(list(states)),
        leases.held_by(batch_items, lease),
    )
    if conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    return _item(row) if row is not None else None


def mark_sent(conn: Connection, held: Mapping[str, Lease], now: datetime) -> set[str]:
    """Record that these items' calls are about to start; the items that are still ours."""
    return leases.mark_sent(
        conn,
        batch_items,
        batch_items.c.id,
        list(held),
        now,
        where=[
            batch_items.c.status == "dispatched",
            leases.held_by_each(batch_items, batch_items.c.id, held),
        ],
    )


def purge_due(conn: Connection, before: datetime, now: datetime) -> list[str]:
    """Drop bodies and results of batches completed before ``before``; keep metadata."""
    ids = (
        conn.execute(
            select(batches.c.id).where(
                batches.c.completed_at.is_not(None),
                batches.c.completed_at <= before,
                batches.c.purged_at.is_(None),
            )
        )
        .scalars()
        .all()
    )
    if ids:
        conn.execute(
            update(batch_items)
            .where(batch_items.c.batch_id.in_(ids))
            .values(body=None, result=None)
        )
        conn.execute(update(batches).where(batches.c.id.in_(ids)).values(purged_at=now))
    return list(ids)


# --- the worker's claim -------------------------------------------------------------


def waiting_candidates(conn: Connection, now: datetime, limit: int) -> list[ItemRow]:
    """Waiting items that can still be dispatched, most urgent deadline first."""
    rows = conn.execute(
        select(*_ITEM_COLUMNS)
        .where(batch_items.c.status == "waiting", batch_items.c.deadline > now)
        .order_by(batch_items.c.deadline, batch_items.c.batch_id, batch_items.c.position)
        .limit(limit)
    ).all()
    return [_item(r) for r in rows]


def claim(conn: Connection, item_id: str) -> tuple[ItemRow, bytes] | None:
    """Lock a waiting item and read its sealed body; None if another worker has it.

    The item is leased (``mark_dispatched``) only once its price and its hold
    are settled in the same transaction.
    """
    q = select(*_ITEM_COLUMNS, batch_items.c.body).where(
        batch_items.c.id == item_id, batch_items.c.status == "waiting"
    )
    row = conn.execute(leases.lock_skipping(conn, q)).first()
    if row is None or row.body is None:
        return None
    return _item(row), bytes(row.body)


def mark_dispatched(
    conn: Connection,
    item: ItemRow,
    owner: str,
    until: datetime,
    *,
    route: str,
    reservation_id: str,
    now: datetime,
) -> Lease:
    """Dispatch an item ``claim`` locked, leased to ``owner``; its lease (owner and token).

    The token grows by one at each dispatch; every later write of the item
    names the lease.
    """
    return leases.take(
        conn,
        batch_items,
        batch_items.c.id,
        {item.id: item.lease_token},
        owner,
        until,
        where=[batch_items.c.status == "waiting"],
        values={
            "status": "dispatched",
            "route": route,
            "reservation_id": reservation_id,
            "dispatched_at": now,
        },
    )[item.id]


def renew(conn: Connection, held: Mapping[str, Lease], until: datetime) -> set[str]:
    """Renew the leases of dispatched items still under these claims; those renewed."""
    if not held:
        return set()
    fence = [
        batch_items.c.status == "dispatched",
        leases.held_by_each(batch_items, batch_items.c.id, held),
    ]
    if leases.renew(conn, batch_items, until, where=fence) == len(held):
        return set(held)
    return set(conn.execute(select(batch_items.c.id).where(*fence)).scalars())


def finish_item(
    conn: Connection,
    item: ItemRow,
    *,
    status: str,
    now: datetime,
    reason: str | None = None,
    result_status: int | None = None,
    result: bytes | None = None,
    from_states: Sequence[str] = ("waiting", "dispatched", "uncertain"),
    lease: Lease | None = None,
) -> bool:
    """End an item with its result; False when it had already left ``from_states``.

    With ``lease``, only the dispatch under that claim is ended: an item that
    went back to waiting and was claimed again is not finished by the old one.
    """
    if status not in TERMINAL:
        raise ValueError(f"{status!r} is not a final item state")
    q = update(batch_items).where(
        batch_items.c.id == item.id, batch_items.c.status.in_(from_states)
    )
    if lease is not None:
        q = q.where(leases.held_by(batch_items, lease))
    done = conn.execute(
        q.values(
            status=status,
            reason=reason,
            finished_at=now,
            lease_expires_at=None,
            body=None,
            result_status=result_status,
            result=result,
            ended_seq=None,
        )
    )
    if not done.rowcount:
        return False
    refresh_batch(conn, item.batch_id, now)
    return True
