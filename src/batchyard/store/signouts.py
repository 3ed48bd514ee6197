"""Workspace sign-outs: the sessions that ended before their cookie expired.

A workspace session is a sealed cookie (``web.sessions``) that any process
sharing the batch key can open, so signing out must be known to all of them:
the session's ID is kept here until the cookie would have expired anyway,
and a page refuses a cookie whose session is listed. Rows past that time are
deleted as new sign-outs arrive.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, Connection, String, Table, delete, insert, select

from batchyard.store.tables import UtcDateTime, metadata

__all__ = ["is_signed_out", "record_sign_out", "workspace_signouts"]

workspace_signouts = Table(
    "workspace_signouts",
    metadata,
    Column("session_id", String(64), primary_key=True),
    Column("expires_at", UtcDateTime(), nullable=False),
)


def record_sign_out(conn: Connection, session_id: str, expires_at: datetime, now: datetime) -> None:
    conn.execute(delete(workspace_signouts).where(workspace_signouts.c.expires_at < now))
    exists = conn.execute(
        select(workspace_signouts.c.session_id).where(workspace_signouts.c.session_id == session_id)
    ).first()
    if exists is None:
        conn.execute(
            insert(workspace_signouts).values(session_id=session_id, expires_at=expires_at)
        )


def is_signed_out(conn: Connection, session_id: str) -> bool:
    row = conn.execute(
        select(workspace_signouts.c.session_id).where(workspace_signouts.c.session_id == session_id)
    ).first()
    return row is not None
