"""Files (OpenAI's ``/v1/files``): the uploaded batch inputs and the outputs batchyard writes.

An input file (``purpose=batch``) is kept as its request lines, each sealed
(``core.sealing``) under the batch key and bound to its file and line number,
with the metadata a quote needs (model, prompt tokens, the most output
tokens) beside it in the clear. A file is written as ``uploading`` and only
becomes visible (``processed``) in the transaction that writes its last
line, so a failed or interrupted upload is never seen and is swept later.

Output and error files (``purpose=batch_output``) hold no lines here: their
content is the batch's rendered result lines (``store.file_batches``), and
the row only names the batch, which half it is, and its size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    delete,
    func,
    insert,
    select,
    update,
)

from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "INVALID_LINE",
    "FileRow",
    "LineRow",
    "create_file",
    "delete_lines",
    "expired_files",
    "file_lines",
    "files",
    "forget",
    "get_file",
    "invalid_lines",
    "line_aad",
    "line_totals",
    "list_files",
    "mark_deleted",
    "mark_processed",
    "read_lines",
    "stale_uploads",
    "write_lines",
]

#: The ``model`` of a line that is JSON but not a valid request: it is kept (OpenAI's order:
#: the upload takes any JSONL file) and its sealed body is the error and the line as sent,
#: so that creating a batch from the file fails it with every such line in ``errors``.
INVALID_LINE = ""

files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    # batch | batch_output
    Column("purpose", String(16), nullable=False),
    Column("filename", String(255), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("line_count", Integer, nullable=False),
    # uploading (invisible) | processed
    Column("status", String(16), nullable=False),
    # The one endpoint every line of an input file names.
    Column("endpoint", String(64), nullable=True),
    # Output files: the batch they belong to, and which half (output | error).
    Column("batch_id", String(64), nullable=True),
    Column("kind", String(8), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=True),
    Column("deleted_at", UtcDateTime(), nullable=True),
    # The key that uploaded it, or whose batch wrote it: an inference key sees its own.
    Column("key_id", String(64), nullable=True),
    Index("ix_files_org", "org_id", "id"),
    Index("ix_files_status", "status", "created_at"),
)

file_lines = Table(
    "file_lines",
    metadata,
    Column("file_id", String(64), ForeignKey("files.id"), primary_key=True),
    # The line's number in the uploaded file (1-based; blank lines keep their numbers).
    Column("line", Integer, primary_key=True, autoincrement=False),
    Column("custom_id", Text, nullable=False),
    Column("model", String(200), nullable=False),
    Column("input_tokens", Integer, nullable=False),
    # The most output tokens the line may produce (max_tokens × n; 0 for embeddings).
    Column("max_tokens", Integer, nullable=False),
    # The line as stored (after privacy), sealed with (file id, line) as associated data.
    Column("body", LargeBinary, nullable=False),
)


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    org_id: str
    purpose: str
    filename: str
    bytes: int
    line_count: int
    status: str
    endpoint: str | None
    batch_id: str | None
    kind: str | None
    created_at: datetime
    expires_at: datetime | None
    deleted_at: datetime | None
    key_id: str | None = None


@dataclass(frozen=True, slots=True)
class LineRow:
    """One stored request line, as written at upload (the body still sealed)."""

    line: int
    custom_id: str
    model: str
    input_tokens: int
    max_tokens: int
    body: bytes


def line_aad(file_id: str, line: int) -> bytes:
    """Associated data of a stored line: a sealed line opens only as itself."""
    return f"{file_id}:{line}".encode()


def _file(row: Any) -> FileRow:
    return FileRow(**{f.name: row._mapping[f.name] for f in fields(FileRow)})


def create_file(
    conn: Connection,
    *,
    file_id: str,
    org_id: str,
    purpose: str,
    filename: str,
    now: datetime,
    status: str = "uploading",
    size: int = 0,
    line_count: int = 0,
    endpoint: str | None = None,
    batch_id: str | None = None,
    kind: str | None = None,
    expires_at: datetime | None = None,
    key_id: str | None = None,
) -> None:
    conn.execute(
        insert(files).values(
            key_id=key_id,
            id=file_id,
            org_id=org_id,
            purpose=purpose,
            filename=filename,
            bytes=size,
            line_count=line_count,
            status=status,
            endpoint=endpoint,
            batch_id=batch_id,
            kind=kind,
            created_at=now,
            expires_at=expires_at,
        )
    )


def write_lines(conn: Connection, file_id: str, lines: Sequence[LineRow]) -> None:
    if lines:
        conn.execute(
            insert(file_lines),
            [
                {
                    "file_id": file_id,
                    "line": ln.line,
                    "custom_id": ln.custom_id,
                    "model": ln.model,
                    "input_tokens": ln.input_tokens,
                    "max_tokens": ln.max_tokens,
                    "body": ln.body,
                }
                for ln in lines
            ],
        )


def mark_processed(
    conn: Connection, file_id: str, *, size: int, line_count: int, endpoint: str | None
) -> None:
    """The upload's last step: the file becomes visible with its size and endpoint."""
    conn.execute(
        update(files)
        .where(files.c.id == file_id, files.c.status == "uploading")
        .values(status="processed", bytes=size, line_count=line_count, endpoint=endpoint)
    )


def get_file(
    conn: Connection, org_id: str, file_id: str, *, key_id: str | None = None
) -> FileRow | None:
    """The organisation's visible file (``key_id``'s own, when given), deleted ones included."""
    q = select(files).where(
        files.c.id == file_id, files.c.org_id == org_id, files.c.status == "processed"
    )
    if key_id is not None:
        q = q.where(files.c.key_id == key_id)
    row = conn.execute(q).first()
    return _file(row) if row is not None else None


def list_files(
    conn: Connection,
    org_id: str,
    *,
    after: str | None,
    limit: int,
    purpose: str | None = None,
    newest_first: bool = True,
    key_id: str | None = None,
) -> list[FileRow]:
    q = select(files).where(
        files.c.org_id == org_id, files.c.status == "processed", files.c.deleted_at.is_(None)
    )
    if key_id is not None:
        q = q.where(files.c.key_id == key_id)
    if purpose is not None:
        q = q.where(files.c.purpose == purpose)
    if after:
        q = q.where(files.c.id < after if newest_first else files.c.id > after)
    order = files.c.id.desc() if newest_first else files.c.id.asc()
    return [_file(r) for r in conn.execute(q.order_by(order).limit(limit))]


def mark_deleted(conn: Connection, file_id: str, now: datetime) -> None:
    conn.execute(update(files).where(files.c.id == file_id).values(deleted_at=now))
    delete_lines(conn, file_id)


def delete_lines(conn: Connection, file_id: str) -> None:
    conn.execute(delete(file_lines).where(file_lines.c.file_id == file_id))


def stale_uploads(conn: Connection, before: datetime) -> list[str]:
    """Uploads that never finished (their process died): to be deleted whole."""
    return list(
        conn.execute(
            select(files.c.id).where(files.c.status == "uploading", files.c.created_at < before)
        ).scalars()
    )


def forget(conn: Connection, file_id: str) -> None:
    """Delete a file that never became visible (a failed or abandoned upload), lines and all."""
    delete_lines(conn, file_id)
    conn.execute(delete(files).where(files.c.id == file_id))


def expired_files(conn: Connection, now: datetime) -> list[str]:
    """Visible files whose ``expires_after`` has come."""
    return list(
        conn.execute(
            select(files.c.id).where(
                files.c.expires_at.is_not(None),
                files.c.expires_at <= now,
                files.c.deleted_at.is_(None),
            )
        ).scalars()
    )


def read_lines(
    conn: Connection, file_id: str, *, after: int = 0, limit: int = 1000
) -> list[LineRow]:
    rows = conn.execute(
        select(file_lines)
        .where(file_lines.c.file_id == file_id, file_lines.c.line > after)
        .order_by(file_lines.c.line)
        .limit(limit)
    ).all()
    return [
        LineRow(r.line, r.custom_id, r.model, r.input_tokens, r.max_tokens, bytes(r.body))
        for r in rows
    ]


def invalid_lines(conn: Connection, file_id: str, *, limit: int) -> list[tuple[int, bytes]]:
    """(line number, sealed body) of the first ``limit`` lines that failed their checks."""
    rows = conn.execute(
        select(file_lines.c.line, file_lines.c.body)
        .where(file_lines.c.file_id == file_id, file_lines.c.model == INVALID_LINE)
        .order_by(file_lines.c.line)
        .limit(limit)
    ).all()
    return [(int(r.line), bytes(r.body)) for r in rows]


def line_totals(conn: Connection, file_id: str) -> Iterator[tuple[str, int, int, int, int]]:
    """Per model: (model, lines, prompt tokens, most output tokens, first line number)."""
    rows = conn.execute(
        select(
            file_lines.c.model,
            func.count(),
            func.sum(file_lines.c.input_tokens),
            func.sum(file_lines.c.max_tokens),
            func.min(file_lines.c.line),
        )
        .where(file_lines.c.file_id == file_id)
        .group_by(file_lines.c.model)
    ).all()
    for model, n, tokens_in, tokens_out, first in rows:
        yield str(model), int(n), int(tokens_in or 0), int(tokens_out or 0), int(first)


def dumps(value: Any) -> str:
    """Compact JSON, as stored in text columns."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
