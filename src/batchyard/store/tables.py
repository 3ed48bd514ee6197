"""The schema, as SQLAlchemy Core tables shared by SQLite and PostgreSQL.

Money columns are integer ticks (see ``core.money``) so sums are exact on
both backends. Times are stored as aware UTC datetimes. The migrations in
``store/migrations`` create exactly these tables; a test compares them.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)
from sqlalchemy.engine import Dialect


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on both backends (SQLite hands back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use clock.now()")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


metadata = MetaData()

organisations = Table(
    "organisations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("tier", Integer, nullable=False, default=0),
    Column("zero_data_retention", Boolean, nullable=False, default=False),
    Column("auto_topup_threshold", BigInteger, nullable=True),
    Column("auto_topup_amount", BigInteger, nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False, index=True),
    Column("scope", String(16), nullable=False),
    Column("key_hash", String(64), nullable=False, unique=True),
    Column("display", String(32), nullable=False),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("revoked_at", UtcDateTime(), nullable=True),
)

# Append-only. kind: topup | reserve | settle | release. amount > 0 always;
# the kind gives the sign. Every settle and release names its reservation.
ledger_entries = Table(
    "ledger_entries",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("amount", BigInteger, nullable=False),
    Column("reservation_id", String(64), nullable=True),
    Column("memo", String(200), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Index("ix_ledger_org", "org_id", "id"),
    Index("ix_ledger_reservation", "reservation_id"),
)

# One row per pending transfer; it resolves at most once (held -> settled | released).
reservations = Table(
    "reservations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False, index=True),
    Column("amount", BigInteger, nullable=False),
    Column("charged", BigInteger, nullable=True),
    Column("state", String(16), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("ref", String(200), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("resolved_at", UtcDateTime(), nullable=True),
    # Who the hold is spent by, for their spend caps (``store.spend_caps``).
    Column("key_id", String(64), nullable=True),
    Column("project_id", String(64), nullable=True),
    Index("ix_reservations_key", "key_id", "created_at"),
    Index("ix_reservations_project", "project_id", "created_at"),
)

# Derived from ledger_entries, kept in the same transaction so that the hot
# path reads one row; `batchyard audit` recomputes it from the entries.
balances = Table(
    "balances",
    metadata,
    Column("org_id", String(64), ForeignKey("organisations.id"), primary_key=True),
    Column("topups", BigInteger, nullable=False, default=0),
    Column("settled", BigInteger, nullable=False, default=0),
    Column("held", BigInteger, nullable=False, default=0),
)

idempotency_keys = Table(
    "idempotency_keys",
    metadata,
    Column("org_id", String(64), primary_key=True),
    Column("key", String(128), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("state", String(16), nullable=False),  # in_progress | done | expired
    Column("status_code", Integer, nullable=True),
    Column("response", Text, nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=False),
    Index("ix_idem_expires", "expires_at"),
)

# What happened to money and calls, for GET /v1/activity: dispatches, charges,
# releases, uncertain calls, each with its reservation.
activity = Table(
    "activity",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("ref", String(200), nullable=True),
    Column("reservation_id", String(64), nullable=True),
    Column("amount", BigInteger, nullable=True),
    Column("detail", Text, nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Index("ix_activity_org", "org_id", "id"),
    Index("ix_activity_reservation", "reservation_id"),
)

# One row per probe: ``/readyz`` rewrites its row to learn whether the store can write.
store_probes = Table(
    "store_probes",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("at", UtcDateTime(), nullable=False),
)

rate_limits = Table(
    "rate_limits",
    metadata,
    Column("key", String(200), primary_key=True),
    Column("tat", Float, nullable=False),
)
