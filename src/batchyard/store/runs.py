"""Batch inference runs: their tables and the run records themselves.

A run's rows (work items) live in ``run_items``, declared here beside the run
table so that importing this module registers both on the shared metadata
(``store.migrations.env`` relies on that). The queries on the rows are in
``store.work_items``; the worker's claims and leases in ``store.run_leases``.

Progress counters live on the run row, updated in the same transaction that
changes the rows they count, so a progress read is one row, not a scan.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Connection,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    insert,
    select,
    text,
    update,
)

# The run tables' foreign keys name the project tables: importing this module
# (as ``store.migrations.env`` does) must put those on the metadata as well.
import batchyard.store.projects  # noqa: F401
from batchyard.core.leases import Lease
from batchyard.errors import NotFound
from batchyard.store import leases
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "Run",
    "create_run",
    "get_run",
    "link_retry",
    "list_runs",
    "load_run",
    "run_items",
    "run_of",
    "runs",
    "update_run",
]

runs = Table(
    "batch_inference_runs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    Column("project_id", String(64), ForeignKey("projects.id"), nullable=False),
    Column("dataset_id", String(64), ForeignKey("datasets.id"), nullable=False),
    Column("status", String(32), nullable=False),
    Column("blocked_reason", String(32), nullable=True),
    # The request as given (JSON): model, mode, output, sampling, filter, input.
    Column("spec", Text, nullable=False),
    Column("quote_rows", Integer, nullable=True),
    Column("quote_input_tokens", BigInteger, nullable=True),
    Column("quote_max_output_tokens", BigInteger, nullable=True),
    Column("quote_max_cost", BigInteger, nullable=True),
    Column("quote_expires_at", UtcDateTime(), nullable=True),
    Column("rows_total", Integer, nullable=False, default=0),
    Column("rows_done", Integer, nullable=False, default=0),
    Column("rows_failed", Integer, nullable=False, default=0),
    Column("rows_uncertain", Integer, nullable=False, default=0),
    Column("rows_canceled", Integer, nullable=False, default=0),
    Column("input_tokens", BigInteger, nullable=False, default=0),
    Column("output_tokens", BigInteger, nullable=False, default=0),
    # Of ``input_tokens``, those the engine read from its prompt cache (a shared system prompt).
    Column("cached_input_tokens", BigInteger, nullable=False, default=0, server_default="0"),
    Column("charge_accum", BigInteger, nullable=False, default=0),
    Column("charge", BigInteger, nullable=True),
    Column("reservation_id", String(64), nullable=True),
    Column("output_dataset_id", String(64), nullable=True),
    Column("outputs_written", Integer, nullable=False, default=0),
    Column("approved", Boolean, nullable=False, default=False),
    # The terminal status a finishing run is heading for (completed | failed).
    Column("outcome", String(16), nullable=True),
    Column("error", Text, nullable=True),
    Column("lease_owner", String(64), nullable=True),
    Column("lease_expires_at", UtcDateTime(), nullable=True),
    # The fencing token: one more at each claim; every write of the holder names it.
    Column("lease_token", BigInteger, nullable=False, default=0, server_default="0"),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    # The key that started the run (created it, then confirmed it): revoking it stops the run.
    Column("key_id", String(64), nullable=True),
    # The end numbers its rows have taken (``store.end_order``): what a follower reads after.
    Column("ended_seq", BigInteger, nullable=False, default=0, server_default="0"),
    # The run this one retries (its failed and canceled rows), and the run that retried it.
    Column("retry_of", String(64), nullable=True),
    Column("retried_by", String(64), nullable=True),
    Index("ix_bir_project", "project_id", "id"),
    Index("ix_bir_status", "status", "lease_expires_at"),
)

run_items = Table(
    "batch_inference_run_items",
    metadata,
    Column("run_id", String(64), ForeignKey("batch_inference_runs.id"), primary_key=True),
    Column("row_id", Integer, primary_key=True, autoincrement=False),
    Column("version", Integer, nullable=False),
    Column("input_tokens", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("outputs", Text, nullable=True),
    Column("usage_input", Integer, nullable=True),
    Column("usage_output", Integer, nullable=True),
    Column("usage_cached", Integer, nullable=True),
    Column("charge", BigInteger, nullable=True),
    Column("error", Text, nullable=True),
    Column("written", Boolean, nullable=False, default=False),
    Column("updated_at", UtcDateTime(), nullable=True),
    # Written durably just before the row's engine call (see ``store.work_items``).
    Column("sent_at", UtcDateTime(), nullable=True),
    # Its place in the order the run's rows ended (``store.end_order``); None until it ends.
    Column("ended_seq", BigInteger, nullable=True),
    Index("ix_bir_items_state", "run_id", "state", "row_id"),
    # Partial: a row enters it when it ends, so freezing a million pending rows pays nothing.
    Index(
        "ix_bir_items_ended",
        "run_id",
        "ended_seq",
        sqlite_where=text("ended_seq IS NOT NULL"),
        postgresql_where=text("ended_seq IS NOT NULL"),
    ),
)


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    org_id: str
    project_id: str
    dataset_id: str
    status: str
    blocked_reason: str | None
    spec: dict[str, Any]
    quote_rows: int | None
    quote_input_tokens: int | None
    quote_max_output_tokens: int | None
    quote_max_cost: int | None
    quote_expires_at: datetime | None
    rows_total: int
    rows_done: int
    rows_failed: int
    rows_uncertain: int
    rows_canceled: int
    input_tokens: int
    output_tokens: int
    charge_accum: int
    charge: int | None
    reservation_id: str | None
    output_dataset_id: str | None
    outputs_written: int
    approved: bool
    outcome: str | None
    error: dict[str, Any] | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    updated_at: datetime
    key_id: str | None = None
    lease_token: int = 0
    cached_input_tokens: int = 0
    ended_seq: int = 0
    retry_of: str | None = None
    retried_by: str | None = None

    @property
    def lease(self) -> Lease:
        """The lease this run was read under (its holder's owner and fencing token)."""
        return Lease(self.lease_owner or "", self.lease_token)


def run_of(row: Any) -> Run:
    """A ``Run`` from a selected row of ``runs`` (the JSON columns decoded)."""
    m = row._mapping
    values = {k: m[k] for k in Run.__slots__}
    values["spec"] = json.loads(m["spec"])
    values["error"] = json.loads(m["error"]) if m["error"] else None
    return Run(**values)


def create_run(
    conn: Connection,
    *,
    run_id: str,
    org_id: str,
    project_id: str,
    dataset_id: str,
    spec: dict[str, Any],
    now: datetime,
    key_id: str | None = None,
) -> str:
    """A new run in ``preparing``, every counter at zero: the quote fills them."""
    conn.execute(
        insert(runs).values(
            id=run_id,
            org_id=org_id,
            project_id=project_id,
            dataset_id=dataset_id,
            status="preparing",
            spec=json.dumps(spec, separators=(",", ":")),
            rows_total=0,
            rows_done=0,
            rows_failed=0,
            rows_uncertain=0,
            rows_canceled=0,
            input_tokens=0,
            output_tokens=0,
            charge_accum=0,
            outputs_written=0,
            approved=False,
            created_at=now,
            updated_at=now,
            key_id=key_id,
        )
    )
    return run_id


def load_run(conn: Connection, run_id: str, *, lock: bool = False) -> Run:
    q = select(runs).where(runs.c.id == run_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    if row is None:
        raise NotFound(f"batch inference run {run_id} not found", param="runId")
    return run_of(row)


def get_run(
    conn: Connection, org_id: str, run_id: str, project_id: str | None = None, *, lock: bool = False
) -> Run:
    """The run if it belongs to ``org_id`` (and ``project_id``); 404 otherwise."""
    run = load_run(conn, run_id, lock=lock) if run_id.startswith("bir.") else None
    if run is None or run.org_id != org_id or (project_id and run.project_id != project_id):
        raise NotFound(f"batch inference run {run_id} not found", param="runId")
    return run


def list_runs(
    conn: Connection,
    org_id: str,
    project_id: str,
    *,
    status: str | None = None,
    before: str | None = None,
    limit: int = 20,
) -> list[Run]:
    """Newest first; ``before`` is the last ID of the previous page."""
    q = select(runs).where(runs.c.org_id == org_id, runs.c.project_id == project_id)
    if status:
        q = q.where(runs.c.status == status)
    if before:
        q = q.where(runs.c.id < before)
    return [run_of(r) for r in conn.execute(q.order_by(runs.c.id.desc()).limit(limit))]


def update_run(
    conn: Connection,
    run_id: str,
    now: datetime,
    *,
    expect: Sequence[str] | None = None,
    lease: Lease | None = None,
    **values: Any,
) -> bool:
    """Change a run if it is still in one of ``expect`` (and held under ``lease``)."""
    q = update(runs).where(runs.c.id == run_id)
    if expect is not None:
        q = q.where(runs.c.status.in_(list(expect)))
    if lease is not None:
        q = q.where(leases.held_by(runs, lease))
    if "error" in values and values["error"] is not None:
        values["error"] = json.dumps(values["error"])
    return conn.execute(q.values(updated_at=now, **values)).rowcount == 1


def link_retry(conn: Connection, run_id: str, retry_id: str, now: datetime) -> bool:
    """Name ``retry_id`` as the run that retries ``run_id``, unless another already does."""
    done = conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.retried_by.is_(None))
        .values(retried_by=retry_id, updated_at=now)
    )
    return done.rowcount == 1
