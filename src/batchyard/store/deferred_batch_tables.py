"""Deferred batches and their items: the two tables and the states an item moves through.

An item's request body is stored sealed (``core.sealing``) and dropped as soon
as the item can no longer be dispatched; its result is sealed too and kept
until the batch's results are purged. Everything else (custom IDs, statuses,
token counts, reservation IDs) is metadata and stays, so a purged batch still
answers "what happened and what did it cost".

The queries over these tables are ``store.deferred_batches``; importing that module
registers these tables on the shared metadata too.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    UniqueConstraint,
)

from batchyard.store.tables import UtcDateTime, metadata

__all__ = ["ACTIVE", "ITEM_STATES", "TERMINAL", "batch_items", "batches"]

ITEM_STATES = (
    "waiting",
    "dispatched",
    "succeeded",
    "failed",
    "expired",
    "canceled",
    "uncertain",
)
#: States that count against the pending limit and keep a batch in progress.
ACTIVE = ("waiting", "dispatched")
TERMINAL = ("succeeded", "failed", "expired", "canceled", "uncertain")

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    # The submitting key: revoking it cancels the batch's undispatched items.
    Column("key_id", String(64), nullable=False),
    # in_progress | canceling | completed | expired | canceled
    Column("status", String(16), nullable=False),
    Column("min_discount", String(16), nullable=False),
    Column("completion_window", String(8), nullable=False),
    Column("request_count", Integer, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("deadline", UtcDateTime(), nullable=False),
    Column("cancel_requested_at", UtcDateTime(), nullable=True),
    Column("completed_at", UtcDateTime(), nullable=True),
    Column("purged_at", UtcDateTime(), nullable=True),
    # How many end numbers its items have taken (``store.end_order``).
    Column("ended_seq", BigInteger, nullable=False, default=0, server_default="0"),
    Index("ix_batches_org", "org_id", "id"),
    Index("ix_batches_completed", "completed_at"),
)

batch_items = Table(
    "batch_items",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("batch_id", String(64), ForeignKey("batches.id"), nullable=False),
    Column("org_id", String(64), nullable=False),
    Column("key_id", String(64), nullable=False),
    Column("position", Integer, nullable=False),
    Column("custom_id", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    # Why an item ended as it did, as a wire code (key_revoked, insufficient_credit, ...).
    Column("reason", String(64), nullable=True),
    Column("model", String(200), nullable=False),
    Column("min_discount", String(16), nullable=False),
    Column("input_tokens", Integer, nullable=False),
    Column("max_tokens", Integer, nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("deadline", UtcDateTime(), nullable=False),
    Column("body", LargeBinary, nullable=True),
    Column("route", String(200), nullable=True),
    Column("reservation_id", String(64), nullable=True),
    # The lease of a dispatched item, as every leased row keeps it (``store.leases``).
    Column("lease_owner", String(64), nullable=True),
    Column("lease_expires_at", UtcDateTime(), nullable=True),
    # The fencing token: one more at each claim.
    Column("lease_token", BigInteger, nullable=False, default=0, server_default="0"),
    Column("dispatched_at", UtcDateTime(), nullable=True),
    # Written durably just before the engine call: a dispatched item without it
    # was never sent, so a crash returns it to waiting instead of uncertain.
    Column("sent_at", UtcDateTime(), nullable=True),
    Column("finished_at", UtcDateTime(), nullable=True),
    Column("result_status", Integer, nullable=True),
    Column("result", LargeBinary, nullable=True),
    # The item's place in the order items ended (``store.end_order``).
    Column("ended_seq", BigInteger, nullable=True),
    UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_custom_id"),
    Index("ix_batch_items_batch", "batch_id", "position"),
    Index("ix_batch_items_status", "status", "deadline"),
    Index("ix_batch_items_org", "org_id", "status"),
    Index("ix_batch_items_ended", "batch_id", "ended_seq"),
)
