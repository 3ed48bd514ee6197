"""The webhook outbox: one row per event per subscribed endpoint, delivered at least once.

A batch that ends writes its deliveries in the same transaction that gives it
its final status (``batch_ended``, called wherever a file batch or a Message
Batch ends), so an event is never lost to a crash between the two, and a
delivery exists only for a batch that really ended. The row's id is the
delivery's ``webhook-id``: every attempt sends the same one, and receivers
dedupe on it.

Delivery states::

    pending → delivered (a 2xx)
    pending → pending (a failed attempt, ``next_attempt_at`` later) → ... → failed
    pending, its endpoint deleted → failed

A pending row is leased work like any other (``store.leases``: ``lease_owner``,
``lease_expires_at``, ``lease_token``, ``sent_at``), claimed by the webhook
sender (``work.webhook_sender``). Unlike a model call, a delivery is safe to
send twice, so a claim whose worker died, even mid-POST, is *retried*, never
``uncertain``: the contract is at least once, with a stable id.

The payload holds ids, statuses and counts only: no request text, no
personal data. Every attempt leaves a ``webhook_delivery`` record in the
organisation's ``/v1/activity``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    exists,
    select,
    update,
)

from batchyard.core.anthropic_bodies import batch_counts
from batchyard.core.ids import new_id
from batchyard.core.leases import Lease
from batchyard.core.webhook_rules import event_for
from batchyard.store import activity, leases
from batchyard.store import file_batches as fstore
from batchyard.store.tables import UtcDateTime, metadata
from batchyard.store.webhook_endpoints import open_secret, subscribed, webhook_endpoints

__all__ = [
    "ACTIVITY_KIND",
    "MESSAGES",
    "Attempted",
    "Delivery",
    "batch_ended",
    "claim",
    "due",
    "enqueue",
    "give_up_endpoint",
    "lapsed",
    "let_go",
    "mark_sent",
    "record",
    "renew",
    "requeue",
    "webhook_deliveries",
]

#: The kind of each attempt's record in ``/v1/activity``.
ACTIVITY_KIND = "webhook_delivery"
#: A file batch of this endpoint is a Message Batch (``service.message_batches``).
MESSAGES = "/v1/messages"

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    # ``msg.<uuid7>``: the ``webhook-id`` of every attempt.
    Column("id", String(64), primary_key=True),
    Column("endpoint_id", String(64), ForeignKey("webhook_endpoints.id"), nullable=False),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    # The event (``evt.…``), shared by its deliveries to several endpoints.
    Column("event_id", String(64), nullable=False),
    Column("event_type", String(64), nullable=False),
    # What the event is about (a batch's id).
    Column("ref", String(64), nullable=True),
    # The body sent, byte for byte at every attempt (ids and counts only).
    Column("payload", Text, nullable=False),
    # pending | delivered | failed
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, default=0, server_default="0"),
    Column("next_attempt_at", UtcDateTime(), nullable=False),
    Column("last_status_code", Integer, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    Column("delivered_at", UtcDateTime(), nullable=True),
    Column("lease_owner", String(64), nullable=True),
    Column("lease_expires_at", UtcDateTime(), nullable=True),
    Column("lease_token", BigInteger, nullable=False, default=0, server_default="0"),
    # Written durably just before the POST (an attempt a dead worker cut off is retried).
    Column("sent_at", UtcDateTime(), nullable=True),
    Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    Index("ix_webhook_deliveries_lease", "status", "lease_expires_at"),
    Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
)

_wd = webhook_deliveries


@dataclass(frozen=True, slots=True)
class Delivery:
    """A claimed delivery: where it goes, how it is signed, what it sends."""

    id: str
    lease: Lease
    org_id: str
    endpoint_id: str
    url: str
    secret: str
    event_type: str
    payload: bytes
    #: Attempts made before this one.
    attempts: int


@dataclass(frozen=True, slots=True)
class Attempted:
    """One attempt's outcome, as ``record`` writes it.

    ``delivered``: the receiver answered 2xx. Otherwise ``retry_at`` is when
    the next attempt is due, or None when the delivery is given up (``failed``).
    """

    id: str
    org_id: str
    endpoint_id: str
    event_type: str
    attempt: int
    delivered: bool
    status_code: int | None = None
    error: str | None = None
    retry_at: datetime | None = None

    @property
    def outcome(self) -> str:
        if self.delivered:
            return "delivered"
        return "retrying" if self.retry_at is not None else "failed"


# --- writing events -------------------------------------------------------------------


def enqueue(
    conn: Connection,
    org_id: str,
    event_type: str,
    data: Mapping[str, Any],
    now: datetime,
    *,
    ref: str | None = None,
) -> list[str]:
    """One delivery of the event per endpoint of ``org_id`` that subscribes to it; their ids."""
    targets = subscribed(conn, org_id, event_type)
    if not targets:
        return []
    event_id = new_id("evt", now)
    body = {
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created_at": int(now.timestamp()),
        "data": dict(data),
    }
    payload = json.dumps(body, separators=(",", ":"), sort_keys=True)
    ids = [new_id("msg", now) for _ in targets]
    conn.execute(
        _wd.insert(),
        [
            {
                "id": msg_id,
                "endpoint_id": endpoint_id,
                "org_id": org_id,
                "event_id": event_id,
                "event_type": event_type,
                "ref": ref,
                "payload": payload,
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
                "updated_at": now,
            }
            for msg_id, endpoint_id in zip(ids, targets, strict=True)
        ],
    )
    return ids


def batch_ended(conn: Connection, batch_id: str, now: datetime) -> list[str]:
    """The deliveries of a file batch's (or a Message Batch's) end, in the caller's transaction.

    Called by whatever gives the batch its final status, right after it does:
    the event is ``batch.completed|failed|expired|cancelled`` for a file batch
    and ``message_batch.ended`` for a Message Batch; the data is the batch's
    id, status and request counts.
    """
    batch = fstore.load_batch(conn, batch_id)
    if batch is None:
        return []
    message_batch = batch.endpoint == MESSAGES
    event = event_for(batch.status, message_batch=message_batch)
    if event is None or (message_batch and batch.status == "failed"):
        # A Message Batch fails only at its creation, which answered the error itself
        # (402) and gave out no batch id: there is nothing to tell.
        return []
    per = fstore.totals(conn, [batch_id])[batch_id].per_state
    data: dict[str, Any]
    if message_batch:
        data = {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": "ended",
            "request_counts": batch_counts(per),
        }
    else:
        data = {
            "id": batch.id,
            "object": "batch",
            "status": "cancelled" if batch.status == "canceled" else batch.status,
            "request_counts": {
                "total": batch.request_count,
                "completed": per.get("succeeded", 0),
                "failed": per.get("failed", 0),
            },
        }
    return enqueue(conn, batch.org_id, event, data, now, ref=batch.id)


def give_up_endpoint(conn: Connection, endpoint_id: str, now: datetime) -> int:
    """A deleted endpoint's waiting deliveries are ``failed`` (any in flight land as they do)."""
    return int(
        conn.execute(
            update(_wd)
            .where(_wd.c.endpoint_id == endpoint_id, _wd.c.status == "pending")
            .values(
                status="failed",
                last_error="the endpoint was deleted",
                updated_at=now,
                **leases.LET_GO,
            )
        ).rowcount
    )


# --- the outbox as leased work --------------------------------------------------------


def _live_endpoint() -> Any:
    we = webhook_endpoints
    return _wd.c.endpoint_id.in_(select(we.c.id).where(we.c.deleted_at.is_(None)))


def _due(now: datetime) -> list[Any]:
    # Unclaimed only: a claim that lapsed is taken back by recovery (``let_go``), which
    # records an attempt cut off mid-POST; claiming it directly would erase its sent mark
    # and that record with it.
    return [_wd.c.status == "pending", _wd.c.next_attempt_at <= now, _wd.c.lease_owner.is_(None)]


def due(conn: Connection, now: datetime) -> bool:
    """A cheap read: is any delivery due and free to claim?"""
    return bool(conn.execute(select(exists().where(*_due(now)))).scalar())


def claim(
    conn: Connection, owner: str, want: int, now: datetime, until: datetime
) -> list[Delivery]:
    """Take up to ``want`` due deliveries, oldest due first, each under a lease of its own."""
    if want <= 0:
        return []
    where = [*_due(now), _live_endpoint()]
    taken = leases.claim(
        conn,
        _wd,
        _wd.c.id,
        owner,
        until,
        where=where,
        order_by=[_wd.c.next_attempt_at, _wd.c.id],
        limit=want,
        values={"sent_at": None, "updated_at": now},
    )
    if not taken:
        return []
    we = webhook_endpoints
    rows = conn.execute(
        select(
            _wd.c.id,
            _wd.c.org_id,
            _wd.c.endpoint_id,
            _wd.c.event_type,
            _wd.c.payload,
            _wd.c.attempts,
            we.c.url,
            we.c.secret,
        )
        .select_from(_wd.join(we, we.c.id == _wd.c.endpoint_id))
        .where(_wd.c.id.in_(list(taken)))
        .order_by(_wd.c.next_attempt_at, _wd.c.id)
    ).all()
    return [
        Delivery(
            id=r.id,
            lease=taken[r.id],
            org_id=r.org_id,
            endpoint_id=r.endpoint_id,
            url=r.url,
            secret=open_secret(conn, r.endpoint_id, r.secret),
            event_type=r.event_type,
            payload=r.payload.encode("utf-8"),
            attempts=int(r.attempts),
        )
        for r in rows
    ]


def _held(held: Mapping[str, Lease]) -> list[Any]:
    return [_wd.c.status == "pending", leases.held_by_each(_wd, _wd.c.id, held)]


def renew(conn: Connection, held: Mapping[str, Lease], until: datetime) -> int:
    """Extend the leases of the held deliveries; how many are still this holder's."""
    if not held:
        return 0
    return leases.renew(conn, _wd, until, where=_held(held))


def mark_sent(conn: Connection, held: Mapping[str, Lease], now: datetime) -> set[str]:
    """These deliveries are about to be POSTed; the ids still this holder's."""
    if not held:
        return set()
    return leases.mark_sent(conn, _wd, _wd.c.id, list(held), now, where=_held(held))


def requeue(conn: Connection, held: Mapping[str, Lease], now: datetime) -> int:
    """Claimed but never sent: due again at once, the claims ended."""
    if not held:
        return 0
    return int(
        conn.execute(
            update(_wd).where(*_held(held)).values(sent_at=None, updated_at=now, **leases.LET_GO)
        ).rowcount
    )


def record(
    conn: Connection, held: Mapping[str, Lease], results: Sequence[Attempted], now: datetime
) -> int:
    """Write each attempt under its claim, with its activity record; how many were written."""
    written = 0
    for r in results:
        lease = held.get(r.id)
        if lease is None:
            continue
        values: dict[str, Any] = {
            "attempts": r.attempt,
            "last_status_code": r.status_code,
            "last_error": r.error,
            "updated_at": now,
            "sent_at": None,
            **leases.LET_GO,
        }
        if r.delivered:
            values.update(status="delivered", delivered_at=now)
        elif r.retry_at is not None:
            values.update(next_attempt_at=r.retry_at)
        else:
            values.update(status="failed")
        done = conn.execute(update(_wd).where(*_held({r.id: lease})).values(**values)).rowcount
        if not done:
            continue  # its claim lapsed and another holder has it now
        written += 1
        detail: dict[str, Any] = {
            "endpoint_id": r.endpoint_id,
            "event": r.event_type,
            "attempt": r.attempt,
            "outcome": r.outcome,
            "status_code": r.status_code,
        }
        if r.error is not None:
            detail["error"] = r.error
        if r.retry_at is not None:
            detail["next_attempt_at"] = r.retry_at.isoformat()
        activity.record(conn, r.org_id, ACTIVITY_KIND, now, ref=r.id, detail=detail)
    return written


def let_go(conn: Connection, held: Mapping[str, Lease] | None, now: datetime) -> tuple[int, int]:
    """End claims: every delivery is due again at once; (claims ended, attempts cut off).

    ``held`` None: every claim whose holder stopped renewing it (recovery).
    A delivery whose POST had started (``sent_at``) may or may not have
    arrived: it is sent again with the same ``webhook-id`` (the receiver
    dedupes), and its activity record says the attempt was cut off.
    """
    if held is not None and not held:
        return 0, 0
    where = [_wd.c.status == "pending"]
    if held is None:
        where += [_wd.c.lease_owner.is_not(None), leases.lapsed(_wd, now)]
    else:
        where.append(leases.held_by_each(_wd, _wd.c.id, held))
    rows = conn.execute(
        leases.lock_skipping(
            conn,
            select(_wd.c.id, _wd.c.org_id, _wd.c.endpoint_id, _wd.c.event_type, _wd.c.sent_at)
            .where(*where)
            .order_by(_wd.c.id),
        )
    ).all()
    if not rows:
        return 0, 0
    conn.execute(
        update(_wd)
        .where(_wd.c.id.in_([r.id for r in rows]), *where)
        .values(next_attempt_at=now, sent_at=None, updated_at=now, **leases.LET_GO)
    )
    cut = [r for r in rows if r.sent_at is not None]
    for r in cut:
        activity.record(
            conn,
            r.org_id,
            ACTIVITY_KIND,
            now,
            ref=r.id,
            detail={
                "endpoint_id": r.endpoint_id,
                "event": r.event_type,
                "outcome": "interrupted",
                "reason": "the worker stopped during the attempt; it is sent again, same id",
            },
        )
    return len(rows), len(cut)


def lapsed(conn: Connection, now: datetime) -> bool:
    """A cheap read: is any delivery's claim lapsed?"""
    q = select(
        exists().where(
            _wd.c.status == "pending", _wd.c.lease_owner.is_not(None), leases.lapsed(_wd, now)
        )
    )
    return bool(conn.execute(q).scalar())
