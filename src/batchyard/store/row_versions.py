"""Editing dataset rows: every change is a new version, never an in-place edit.

An edit through the API (``patch_row``) and a run writing its completions into
a field (``write_field``) both go through ``_new_versions``: the current
version is marked old and the merged data is inserted as the next one. A run
that froze ``(row id, version)`` pairs at its quote therefore still reads the
text it priced.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, insert, select, update

from batchyard.store.projects import (
    Row,
    dataset_rows,
    datasets,
    get_row,
    row_text,
    seal_row,
    set_fields,
)

__all__ = ["patch_row", "write_field"]


def _new_versions(
    conn: Connection, dataset_id: str, changes: dict[int, dict[str, Any]], now: datetime
) -> dict[int, Row]:
    """Write the current data of rows with ``changes`` merged in, as new versions."""
    if not changes:
        return {}
    current = conn.execute(
        select(dataset_rows.c.row_id, dataset_rows.c.version, dataset_rows.c.data).where(
            dataset_rows.c.dataset_id == dataset_id,
            dataset_rows.c.current.is_(True),
            dataset_rows.c.row_id.in_(list(changes)),
        )
    ).all()
    out: dict[int, Row] = {}
    for row_id, version, text in current:
        data = json.loads(row_text(conn, dataset_id, row_id, version, text))
        for key, value in changes[row_id].items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        out[row_id] = Row(row_id, version + 1, data, now)
    conn.execute(
        update(dataset_rows)
        .where(
            and_(
                dataset_rows.c.dataset_id == dataset_id,
                dataset_rows.c.row_id == bindparam("rid"),
                dataset_rows.c.version == bindparam("ver"),
            )
        )
        .values(current=False),
        [{"rid": r.id, "ver": r.version - 1} for r in out.values()],
    )
    conn.execute(
        insert(dataset_rows),
        [
            {
                "dataset_id": dataset_id,
                "row_id": r.id,
                "version": r.version,
                "current": True,
                "data": seal_row(conn, dataset_id, r.id, r.version, r.data),
                "created_at": now,
            }
            for r in out.values()
        ],
    )
    return out


def patch_row(
    conn: Connection,
    dataset_id: str,
    row_id: int,
    changes: dict[str, Any],
    now: datetime,
) -> Row:
    """Merge ``changes`` into a row as a new version (a ``null`` value removes the field)."""
    get_row(conn, dataset_id, row_id)
    row = _new_versions(conn, dataset_id, {row_id: changes}, now)[row_id]
    set_fields(conn, dataset_id, [k for k, v in changes.items() if v is not None], now)
    conn.execute(update(datasets).where(datasets.c.id == dataset_id).values(updated_at=now))
    return row


def write_field(
    conn: Connection, dataset_id: str, field: str, values: dict[int, Any], now: datetime
) -> int:
    """Set ``field`` on many rows at once (a run's completions), each as a new version."""
    written = _new_versions(conn, dataset_id, {k: {field: v} for k, v in values.items()}, now)
    if written:
        set_fields(conn, dataset_id, [field], now)
    return len(written)
