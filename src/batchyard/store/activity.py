"""The activity log: what was dispatched and charged, with reservation IDs.

An ``uncertain`` call's error tells its owner to inspect Activity before sending it
again; this is where a held reservation of an ``uncertain`` call
shows up, beside every charge and release.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert, select

from batchyard.core.ids import new_id
from batchyard.store.tables import activity

__all__ = ["list_activity", "record"]

# Built once: recording runs on every charge (see store.ledger's note).
_INSERT = insert(activity)


def record(
    conn: Connection,
    org_id: str,
    kind: str,
    now: datetime,
    *,
    ref: str | None = None,
    reservation_id: str | None = None,
    amount: int | None = None,
    detail: dict[str, Any] | None = None,
) -> str:
    act_id = new_id("act", now)
    conn.execute(
        _INSERT,
        {
            "id": act_id,
            "org_id": org_id,
            "kind": kind,
            "ref": ref,
            "reservation_id": reservation_id,
            "amount": amount,
            "detail": json.dumps(detail) if detail else None,
            "created_at": now,
        },
    )
    return act_id


def list_activity(
    conn: Connection, org_id: str, *, after: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    q = select(activity).where(activity.c.org_id == org_id)
    if after:
        q = q.where(activity.c.id > after)
    rows = conn.execute(q.order_by(activity.c.id).limit(limit)).all()
    return [
        {
            "id": r.id,
            "kind": r.kind,
            "ref": r.ref,
            "reservation_id": r.reservation_id,
            "amount": r.amount,
            "detail": json.loads(r.detail) if r.detail else None,
            "created_at": r.created_at,
        }
        for r in rows
    ]
