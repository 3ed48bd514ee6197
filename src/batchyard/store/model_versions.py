"""Model versions in a project: a LoRA adapter or full weights a customer uploaded.

The GGUF itself lives on disk under the deployment's home (llama.cpp loads it
from a path); the row holds what the API shows and the SHA-256 the file had
when it was accepted, checked again before an engine loads it, so a file
changed at rest is refused instead of served. A row is written only once the
file has passed its checks and sits at its final path, so a failed upload
leaves no row; a deleted version keeps its row (``deleted_at``) so its ID is
never reused and old runs still name something.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    ForeignKey,
    Index,
    String,
    Table,
    insert,
    select,
    update,
)

from batchyard.store.runs import runs
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "VersionRow",
    "create_version",
    "get_version",
    "list_versions",
    "live_runs_using",
    "mark_deleted",
    "model_versions",
]

model_versions = Table(
    "model_versions",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("project_id", String(64), ForeignKey("projects.id"), nullable=False),
    # lora | weights
    Column("type", String(16), nullable=False),
    # The catalog model it is a version of.
    Column("base", String(128), nullable=False),
    Column("name", String(200), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    # The file's name under the deployment's model-version folder.
    Column("file", String(128), nullable=False),
    Column("architecture", String(64), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("deleted_at", UtcDateTime(), nullable=True),
    Index("ix_model_versions_project", "org_id", "project_id", "created_at"),
)


@dataclass(frozen=True, slots=True)
class VersionRow:
    id: str
    org_id: str
    project_id: str
    type: str
    base: str
    name: str
    bytes: int
    sha256: str
    file: str
    architecture: str
    created_at: datetime
    deleted_at: datetime | None


def _row(r: Any) -> VersionRow:
    return VersionRow(
        r.id,
        r.org_id,
        r.project_id,
        r.type,
        r.base,
        r.name,
        int(r.bytes),
        r.sha256,
        r.file,
        r.architecture,
        r.created_at,
        r.deleted_at,
    )


def create_version(conn: Connection, row: VersionRow) -> VersionRow:
    conn.execute(
        insert(model_versions).values(
            id=row.id,
            org_id=row.org_id,
            project_id=row.project_id,
            type=row.type,
            base=row.base,
            name=row.name,
            bytes=row.bytes,
            sha256=row.sha256,
            file=row.file,
            architecture=row.architecture,
            created_at=row.created_at,
            deleted_at=None,
        )
    )
    return row


def get_version(
    conn: Connection, version_id: str, *, org_id: str | None = None, live: bool = True
) -> VersionRow | None:
    """The version, of ``org_id`` when given; deleted ones only when ``live`` is False."""
    q = select(model_versions).where(model_versions.c.id == version_id)
    if org_id is not None:
        q = q.where(model_versions.c.org_id == org_id)
    if live:
        q = q.where(model_versions.c.deleted_at.is_(None))
    r = conn.execute(q).first()
    return _row(r) if r is not None else None


def list_versions(conn: Connection, org_id: str, project_id: str | None = None) -> list[VersionRow]:
    q = select(model_versions).where(
        model_versions.c.org_id == org_id, model_versions.c.deleted_at.is_(None)
    )
    if project_id is not None:
        q = q.where(model_versions.c.project_id == project_id)
    q = q.order_by(model_versions.c.created_at, model_versions.c.id)
    return [_row(r) for r in conn.execute(q)]


def mark_deleted(conn: Connection, version_id: str, now: datetime) -> None:
    conn.execute(
        update(model_versions).where(model_versions.c.id == version_id).values(deleted_at=now)
    )


def live_runs_using(
    conn: Connection, org_id: str, version_id: str, terminal: tuple[str, ...]
) -> list[str]:
    """The runs of ``org_id`` not yet ended whose spec names the version."""
    q = select(runs.c.id).where(
        runs.c.org_id == org_id,
        runs.c.status.not_in(terminal),
        runs.c.spec.contains(f'"{version_id}"'),
    )
    return [str(r.id) for r in conn.execute(q)]
