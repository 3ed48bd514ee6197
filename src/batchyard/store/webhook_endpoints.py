"""Webhook endpoints: where an organisation wants to hear that its batches ended.

An endpoint is a URL, the events it subscribes to and its signing secret. The
secret must be read back to sign each delivery (it cannot be hashed as an API
key is), so it is sealed at rest with the deployment's key (``store.at_rest``,
bound to the endpoint's id): a copied database file or backup holds no usable
secret. The API shows it once, when it is made or rotated.

A deleted endpoint keeps its row (``deleted_at``) so the deliveries already
made for it still name it in ``/v1/activity``; it gets no new events, and its
waiting deliveries are given up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Column, Connection, ForeignKey, Index, String, Table, Text, select, update

from batchyard.core.ids import new_id
from batchyard.store.at_rest import open_text, seal_text
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "Endpoint",
    "create_endpoint",
    "delete_endpoint",
    "get_endpoint",
    "list_endpoints",
    "open_secret",
    "rotate_secret",
    "subscribed",
    "webhook_endpoints",
]

webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("url", Text, nullable=False),
    Column("description", Text, nullable=True),
    # The subscribed events, a JSON list of names (``core.webhook_rules.EVENTS``).
    Column("events", Text, nullable=False),
    # ``whsec_...``, sealed with the batch key (bound to the endpoint's id).
    Column("secret", Text, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    Column("deleted_at", UtcDateTime(), nullable=True),
    Index("ix_webhook_endpoints_org", "org_id", "id"),
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An endpoint as the API shows it (never its secret)."""

    id: str
    org_id: str
    url: str
    description: str | None
    events: tuple[str, ...]
    created_at: datetime
    updated_at: datetime


def _aad(endpoint_id: str) -> str:
    return f"{endpoint_id}:webhook_secret"


def _endpoint(row: Any) -> Endpoint:
    return Endpoint(
        id=row.id,
        org_id=row.org_id,
        url=row.url,
        description=row.description,
        events=tuple(json.loads(row.events)),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def create_endpoint(
    conn: Connection,
    org_id: str,
    url: str,
    events: Sequence[str],
    description: str | None,
    secret: str,
    now: datetime,
) -> Endpoint:
    endpoint_id = new_id("we", now)
    conn.execute(
        webhook_endpoints.insert().values(
            id=endpoint_id,
            org_id=org_id,
            url=url,
            description=description,
            events=json.dumps(list(events)),
            secret=seal_text(conn, secret, _aad(endpoint_id)),
            created_at=now,
            updated_at=now,
        )
    )
    found = get_endpoint(conn, org_id, endpoint_id)
    assert found is not None
    return found


def get_endpoint(conn: Connection, org_id: str, endpoint_id: str) -> Endpoint | None:
    """The organisation's live endpoint (None: no such one, another's, or deleted)."""
    we = webhook_endpoints
    row = conn.execute(
        select(we).where(we.c.id == endpoint_id, we.c.org_id == org_id, we.c.deleted_at.is_(None))
    ).first()
    return _endpoint(row) if row is not None else None


def list_endpoints(
    conn: Connection, org_id: str, *, after: str | None, limit: int
) -> list[Endpoint]:
    """The organisation's live endpoints, oldest first, after the cursor ``after``."""
    we = webhook_endpoints
    q = select(we).where(we.c.org_id == org_id, we.c.deleted_at.is_(None))
    if after is not None:
        q = q.where(we.c.id > after)
    return [_endpoint(r) for r in conn.execute(q.order_by(we.c.id).limit(limit))]


def delete_endpoint(conn: Connection, org_id: str, endpoint_id: str, now: datetime) -> bool:
    """Mark the endpoint deleted; False when there was no such live endpoint."""
    we = webhook_endpoints
    done = conn.execute(
        update(we)
        .where(we.c.id == endpoint_id, we.c.org_id == org_id, we.c.deleted_at.is_(None))
        .values(deleted_at=now, updated_at=now)
    ).rowcount
    return bool(done)


def rotate_secret(
    conn: Connection, org_id: str, endpoint_id: str, secret: str, now: datetime
) -> Endpoint | None:
    """Replace the endpoint's secret; deliveries from now on are signed with the new one."""
    we = webhook_endpoints
    done = conn.execute(
        update(we)
        .where(we.c.id == endpoint_id, we.c.org_id == org_id, we.c.deleted_at.is_(None))
        .values(secret=seal_text(conn, secret, _aad(endpoint_id)), updated_at=now)
    ).rowcount
    return get_endpoint(conn, org_id, endpoint_id) if done else None


def open_secret(conn: Connection, endpoint_id: str, stored: str) -> str:
    """An endpoint's secret as stored, opened (for signing a delivery)."""
    return open_text(conn, stored, _aad(endpoint_id))


def subscribed(conn: Connection, org_id: str, event: str) -> list[str]:
    """The ids of the organisation's live endpoints that subscribe to ``event``."""
    we = webhook_endpoints
    rows = conn.execute(
        select(we.c.id, we.c.events)
        .where(we.c.org_id == org_id, we.c.deleted_at.is_(None))
        .order_by(we.c.id)
    ).all()
    return [r.id for r in rows if event in json.loads(r.events)]
