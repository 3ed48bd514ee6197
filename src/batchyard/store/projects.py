"""Projects, datasets and their versioned rows: the tables, and reading rows.

Rows are never edited in place: an edit (or a run writing its completions into
a field) adds a new version and marks it current (``store.row_versions``
writes those). A run records the ``(row id, version)`` pairs it quoted, so it
answers exactly the text it priced, whatever happens to the dataset after the
quote.

Every lookup takes the caller's organisation: an ID of another organisation is
"not found", so the API never confirms that someone else's object exists.

A row's data is customer text: it is sealed at rest (``store.at_rest``),
bound to its dataset, row and version, and opened only here, so every reader
below gets plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    ForeignKey,
    Index,
    Integer,
    Select,
    String,
    Table,
    Text,
    delete,
    insert,
    select,
    true,
    tuple_,
    update,
)

from batchyard.core.ids import new_id
from batchyard.errors import NotFound
from batchyard.store.at_rest import PREFIX, open_text, opener, seal_text
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "MAX_FIELDS",
    "Dataset",
    "Project",
    "Row",
    "append_rows",
    "create_dataset",
    "create_project",
    "current_rows",
    "dataset_rows",
    "datasets",
    "delete_dataset",
    "get_dataset",
    "get_project",
    "get_row",
    "list_rows",
    "mark_ready",
    "projects",
    "purge_unready",
    "rows_at",
    "set_fields",
    "unready_before",
]

MAX_FIELDS = 500

projects = Table(
    "projects",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False, index=True),
    Column("name", String(200), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
)

datasets = Table(
    "datasets",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("project_id", String(64), ForeignKey("projects.id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("kind", String(16), nullable=False),  # text | chat-sft
    Column("row_count", Integer, nullable=False, default=0),
    # JSON list of the top-level field names seen in the rows (for validation).
    Column("fields", Text, nullable=False, default="[]"),
    Column("source_run_id", String(64), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    # False while an upload is being inserted: the dataset appears whole or not at all.
    Column("ready", Boolean, nullable=False, default=True, server_default=true()),
    Index("ix_datasets_project", "project_id", "id"),
)

dataset_rows = Table(
    "dataset_rows",
    metadata,
    Column("dataset_id", String(64), ForeignKey("datasets.id"), primary_key=True),
    Column("row_id", Integer, primary_key=True, autoincrement=False),
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("current", Boolean, nullable=False),
    Column("data", Text, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Index("ix_dataset_rows_current", "dataset_id", "current", "row_id"),
)


@dataclass(frozen=True, slots=True)
class Project:
    id: str
    org_id: str
    name: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Dataset:
    id: str
    org_id: str
    project_id: str
    name: str
    kind: str
    row_count: int
    fields: tuple[str, ...]
    source_run_id: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    version: int
    data: dict[str, Any]
    updated_at: datetime


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def row_aad(dataset_id: str, row_id: int, version: int) -> str:
    """What a row version's sealed data is bound to."""
    return f"row:{dataset_id}:{row_id}:{version}"


def seal_row(conn: Connection, dataset_id: str, row_id: int, version: int, data: Any) -> str:
    """A row version's data as stored: JSON, sealed."""
    return seal_text(conn, _dumps(data), row_aad(dataset_id, row_id, version))


def row_text(conn: Connection, dataset_id: str, row_id: int, version: int, stored: str) -> str:
    """A row version's data as JSON text, opened."""
    return open_text(conn, stored, row_aad(dataset_id, row_id, version))


def create_project(conn: Connection, org_id: str, name: str, now: datetime) -> Project:
    pid = new_id("pp", now)
    conn.execute(
        insert(projects).values(id=pid, org_id=org_id, name=name, created_at=now, updated_at=now)
    )
    return Project(pid, org_id, name, now, now)


def get_project(conn: Connection, org_id: str, project_id: str) -> Project:
    row = conn.execute(
        select(projects).where(projects.c.id == project_id, projects.c.org_id == org_id)
    ).first()
    if row is None:
        raise NotFound(f"project {project_id} not found", param="projectId")
    return Project(row.id, row.org_id, row.name, row.created_at, row.updated_at)


def _dataset(row: Any) -> Dataset:
    return Dataset(
        row.id,
        row.org_id,
        row.project_id,
        row.name,
        row.kind,
        row.row_count,
        tuple(json.loads(row.fields)),
        row.source_run_id,
        row.created_at,
        row.updated_at,
    )


def create_dataset(
    conn: Connection,
    org_id: str,
    project_id: str,
    name: str,
    kind: str,
    now: datetime,
    *,
    source_run_id: str | None = None,
    fields: Sequence[str] = (),
    ready: bool = True,
) -> Dataset:
    """A new empty dataset; ``ready=False`` keeps it invisible until ``mark_ready`` (uploads)."""
    get_project(conn, org_id, project_id)
    did = new_id("ds", now)
    conn.execute(
        insert(datasets).values(
            id=did,
            org_id=org_id,
            project_id=project_id,
            name=name,
            kind=kind,
            row_count=0,
            fields=_dumps(list(fields)),
            source_run_id=source_run_id,
            created_at=now,
            updated_at=now,
            ready=ready,
        )
    )
    return Dataset(did, org_id, project_id, name, kind, 0, tuple(fields), source_run_id, now, now)


def get_dataset(
    conn: Connection, org_id: str, dataset_id: str, project_id: str | None = None
) -> Dataset:
    q = select(datasets).where(
        datasets.c.id == dataset_id, datasets.c.org_id == org_id, datasets.c.ready.is_(True)
    )
    if project_id is not None:
        q = q.where(datasets.c.project_id == project_id)
    row = conn.execute(q).first()
    if row is None:
        raise NotFound(f"dataset {dataset_id} not found", param="datasetId")
    return _dataset(row)


def set_fields(conn: Connection, dataset_id: str, fields: Iterable[str], now: datetime) -> None:
    """Add field names to a dataset's known fields (kept in first-seen order)."""
    known = json.loads(
        conn.execute(select(datasets.c.fields).where(datasets.c.id == dataset_id)).scalar_one()
    )
    added: list[str] = []
    for name in fields:
        if name not in known and name not in added:
            added.append(name)
    if added and len(known) < MAX_FIELDS:
        known = (known + added)[:MAX_FIELDS]
        conn.execute(
            update(datasets)
            .where(datasets.c.id == dataset_id)
            .values(fields=_dumps(known), updated_at=now)
        )


def append_rows(
    conn: Connection, dataset_id: str, rows: Sequence[dict[str, Any]], now: datetime
) -> int:
    """Append rows as version 1, numbered after the dataset's last row."""
    if not rows:
        return 0
    count = conn.execute(
        select(datasets.c.row_count).where(datasets.c.id == dataset_id)
    ).scalar_one()
    conn.execute(
        insert(dataset_rows),
        [
            {
                "dataset_id": dataset_id,
                "row_id": count + i + 1,
                "version": 1,
                "current": True,
                "data": seal_row(conn, dataset_id, count + i + 1, 1, r),
                "created_at": now,
            }
            for i, r in enumerate(rows)
        ],
    )
    conn.execute(
        update(datasets)
        .where(datasets.c.id == dataset_id)
        .values(row_count=count + len(rows), updated_at=now)
    )
    names: dict[str, None] = {}
    for r in rows:
        names.update(dict.fromkeys(r))
    set_fields(conn, dataset_id, names, now)
    return len(rows)


def delete_dataset(conn: Connection, dataset_id: str) -> None:
    conn.execute(delete(dataset_rows).where(dataset_rows.c.dataset_id == dataset_id))
    conn.execute(delete(datasets).where(datasets.c.id == dataset_id))


def mark_ready(conn: Connection, dataset_id: str, now: datetime) -> None:
    """An upload's last row is in: the dataset appears, whole."""
    conn.execute(
        update(datasets).where(datasets.c.id == dataset_id).values(ready=True, updated_at=now)
    )


def unready_before(conn: Connection, before: datetime) -> bool:
    """Whether an upload stopped part-way before ``before`` (a cheap read first)."""
    q = select(datasets.c.id).where(datasets.c.ready.is_(False), datasets.c.updated_at < before)
    return conn.execute(q.limit(1)).first() is not None


def purge_unready(conn: Connection, before: datetime, *, limit: int = 10) -> int:
    """Drop uploads that stopped part-way (untouched since ``before``): they never appeared."""
    ids = (
        conn.execute(
            select(datasets.c.id)
            .where(datasets.c.ready.is_(False), datasets.c.updated_at < before)
            .limit(limit)
        )
        .scalars()
        .all()
    )
    for dataset_id in ids:
        delete_dataset(conn, dataset_id)
    return len(ids)


def _row(conn: Connection, r: Any) -> Row:
    data = json.loads(row_text(conn, r.dataset_id, r.row_id, r.version, r.data))
    return Row(r.row_id, r.version, data, r.created_at)


def list_rows(
    conn: Connection, dataset_id: str, *, after: int | None = None, limit: int = 100
) -> list[Row]:
    q = select(dataset_rows).where(
        dataset_rows.c.dataset_id == dataset_id, dataset_rows.c.current.is_(True)
    )
    if after is not None:
        q = q.where(dataset_rows.c.row_id > after)
    return [_row(conn, r) for r in conn.execute(q.order_by(dataset_rows.c.row_id).limit(limit))]


def current_rows(
    conn: Connection, dataset_id: str, *, after: int, limit: int
) -> list[tuple[int, int, str]]:
    """``(row id, version, JSON text)`` of current rows after ``after``: the quote's scan."""
    q = (
        select(dataset_rows.c.row_id, dataset_rows.c.version, dataset_rows.c.data)
        .where(
            dataset_rows.c.dataset_id == dataset_id,
            dataset_rows.c.current.is_(True),
            dataset_rows.c.row_id > after,
        )
        .order_by(dataset_rows.c.row_id)
        .limit(limit)
    )
    # A quote scans a million rows through here: they come from the driver as
    # plain tuples (SQLAlchemy's Row objects cost five times the read itself),
    # and only sealed ones have their AAD built and opened.
    rows = _driver_rows(conn, q)
    open_one = opener(conn)
    return [
        (r[0], r[1], open_one(r[2], row_aad(dataset_id, r[0], r[1])))
        if r[2].startswith(PREFIX)
        else (r[0], r[1], r[2])
        for r in rows
    ]


def _driver_rows(conn: Connection, q: Select[Any]) -> list[tuple[Any, ...]]:
    """The rows of ``q`` as the DB-API driver returns them, in ``conn``'s transaction."""
    compiled = q.compile(dialect=conn.dialect)
    params = compiled.params
    order = compiled.positiontup
    args: Any = tuple(params[k] for k in order) if order else params
    cursor = conn.connection.cursor()
    try:
        cursor.execute(str(compiled), args)
        return list(cursor.fetchall())
    finally:
        cursor.close()


def get_row(conn: Connection, dataset_id: str, row_id: int) -> Row:
    r = conn.execute(
        select(dataset_rows).where(
            dataset_rows.c.dataset_id == dataset_id,
            dataset_rows.c.row_id == row_id,
            dataset_rows.c.current.is_(True),
        )
    ).first()
    if r is None:
        raise NotFound(f"row {row_id} not found in dataset {dataset_id}", param="rowId")
    return _row(conn, r)


def rows_at(
    conn: Connection, dataset_id: str, refs: Sequence[tuple[int, int]]
) -> dict[int, dict[str, Any]]:
    """The frozen data of ``(row id, version)`` pairs, by row id."""
    if not refs:
        return {}
    q = select(dataset_rows.c.row_id, dataset_rows.c.version, dataset_rows.c.data).where(
        dataset_rows.c.dataset_id == dataset_id,
        tuple_(dataset_rows.c.row_id, dataset_rows.c.version).in_(list(refs)),
    )
    return {r[0]: json.loads(row_text(conn, dataset_id, r[0], r[1], r[2])) for r in conn.execute(q)}
