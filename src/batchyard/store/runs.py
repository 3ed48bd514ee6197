"""Batch inference runs and their rows (work items), on SQLite and PostgreSQL.

A run is claimed by one worker at a time through a lease: PostgreSQL picks a
claimable run with ``SELECT … FOR UPDATE SKIP LOCKED`` so two workers never
take the same one; SQLite serialises writers with ``BEGIN IMMEDIATE`` (see
``store.database``), so the same query is safe there. Every write a worker
makes is guarded by ``lease_owner``: a worker that lost its lease (it stalled
past expiry and another took over) changes nothing.

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
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    update,
)

from batchyard.core.runs import ItemState, RunStatus
from batchyard.errors import NotFound
from batchyard.store.projects import dataset_rows as dr
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "ItemResult",
    "Run",
    "WorkItem",
    "add_items",
    "blocked_runs",
    "cancel_pending",
    "claim_items",
    "claim_run",
    "clear_items",
    "create_run",
    "get_run",
    "heartbeat",
    "list_failures",
    "list_runs",
    "load_run",
    "mark_uncertain",
    "mark_written",
    "record_results",
    "recount",
    "release_lease",
    "renew_lease",
    "run_items",
    "runs",
    "succeeded_unwritten",
    "update_run",
    "work_waiting",
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
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
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
    Column("charge", BigInteger, nullable=True),
    Column("error", Text, nullable=True),
    Column("written", Boolean, nullable=False, default=False),
    Column("updated_at", UtcDateTime(), nullable=True),
    Index("ix_bir_items_state", "run_id", "state", "row_id"),
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


@dataclass(frozen=True, slots=True)
class WorkItem:
    row_id: int
    version: int
    input_tokens: int


@dataclass(frozen=True, slots=True)
class ItemResult:
    """What one row's call came to; ``state`` is succeeded or failed."""

    row_id: int
    state: str
    outputs: list[str] | None = None
    usage_input: int = 0
    usage_output: int = 0
    charge: int = 0
    error: dict[str, Any] | None = None


def _run(row: Any) -> Run:
    m = row._mapping
    values = {k: m[k] for k in Run.__slots__}
    values["spec"] = json.loads(m["spec"])
    values["error"] = json.loads(m["error"]) if m["error"] else None
    return Run(**values)


def create_run(conn: Connection, **values: Any) -> str:
    values["spec"] = json.dumps(values["spec"], separators=(",", ":"))
    conn.execute(insert(runs).values(**values))
    return str(values["id"])


def load_run(conn: Connection, run_id: str, *, lock: bool = False) -> Run:
    q = select(runs).where(runs.c.id == run_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    if row is None:
        raise NotFound(f"batch inference run {run_id} not found", param="runId")
    return _run(row)


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
    return [_run(r) for r in conn.execute(q.order_by(runs.c.id.desc()).limit(limit))]


def update_run(
    conn: Connection,
    run_id: str,
    now: datetime,
    *,
    expect: Sequence[str] | None = None,
    owner: str | None = None,
    **values: Any,
) -> bool:
    """Change a run if it is still in one of ``expect`` (and held by ``owner``)."""
    q = update(runs).where(runs.c.id == run_id)
    if expect is not None:
        q = q.where(runs.c.status.in_(list(expect)))
    if owner is not None:
        q = q.where(runs.c.lease_owner == owner)
    if "error" in values and values["error"] is not None:
        values["error"] = json.dumps(values["error"])
    return conn.execute(q.values(updated_at=now, **values)).rowcount == 1


def claim_run(
    conn: Connection,
    owner: str,
    now: datetime,
    lease_until: datetime,
    *,
    statuses: Sequence[str],
    exclude: Sequence[str] = (),
    blocked_reason: str | None = None,
) -> Run | None:
    """Take the oldest run in ``statuses`` whose lease is free or expired."""
    q = (
        select(runs.c.id)
        .where(
            runs.c.status.in_(list(statuses)),
            or_(runs.c.lease_expires_at.is_(None), runs.c.lease_expires_at < now),
        )
        .order_by(runs.c.updated_at, runs.c.id)
        .limit(1)
    )
    if exclude:
        q = q.where(runs.c.id.not_in(list(exclude)))
    if blocked_reason is not None:
        q = q.where(runs.c.blocked_reason == blocked_reason)
    if conn.dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    run_id = conn.execute(q).scalar()
    if run_id is None:
        return None
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id)
        .values(lease_owner=owner, lease_expires_at=lease_until)
    )
    return load_run(conn, run_id)


def work_waiting(
    conn: Connection, now: datetime, statuses: Sequence[str], exclude: Sequence[str] = ()
) -> tuple[bool, bool]:
    """Cheap read first: is any run claimable, is any run waiting on funds?

    Lets an idle worker poll with one read instead of write transactions,
    which on SQLite would queue behind every other writer.
    """
    free = or_(runs.c.lease_expires_at.is_(None), runs.c.lease_expires_at < now)
    claimable = select(runs.c.id).where(
        free,
        or_(
            runs.c.status.in_(list(statuses)),
            and_(
                runs.c.status == RunStatus.BLOCKED,
                runs.c.blocked_reason == "payment",
            ),
        ),
    )
    if exclude:
        claimable = claimable.where(runs.c.id.not_in(list(exclude)))
    funds = select(runs.c.id).where(
        runs.c.status == RunStatus.BLOCKED, runs.c.blocked_reason == "funds"
    )
    return (
        conn.execute(claimable.limit(1)).first() is not None,
        conn.execute(funds.limit(1)).first() is not None,
    )


def blocked_runs(conn: Connection, reason: str, *, limit: int = 20) -> list[Run]:
    """Blocked runs waiting on ``reason``, longest-waiting first."""
    q = (
        select(runs)
        .where(runs.c.status == RunStatus.BLOCKED, runs.c.blocked_reason == reason)
        .order_by(runs.c.updated_at)
        .limit(limit)
    )
    if conn.dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    return [_run(r) for r in conn.execute(q)]


def renew_lease(conn: Connection, run_id: str, owner: str, lease_until: datetime) -> Run | None:
    """Extend the lease; ``None`` if another worker holds the run now."""
    done = conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.lease_owner == owner)
        .values(lease_expires_at=lease_until)
    ).rowcount
    return load_run(conn, run_id) if done else None


def heartbeat(conn: Connection, run_id: str, owner: str, lease_until: datetime) -> str | None:
    """Extend the lease and read the status; ``None`` if the run is no longer ours."""
    done = conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.lease_owner == owner)
        .values(lease_expires_at=lease_until)
    ).rowcount
    if not done:
        return None
    return str(conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar_one())


def release_lease(conn: Connection, run_id: str, owner: str) -> None:
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None)
    )


def clear_items(conn: Connection, run_id: str) -> None:
    """Forget a half-prepared quote's rows, so a new preparation starts clean."""
    conn.execute(delete(run_items).where(run_items.c.run_id == run_id))


def add_items(
    conn: Connection, run_id: str, items: Sequence[tuple[int, int, int, str, str | None]]
) -> None:
    """Freeze rows into a run: ``(row id, version, input tokens, state, error JSON)``."""
    if items:
        conn.execute(
            insert(run_items),
            [
                {
                    "run_id": run_id,
                    "row_id": r,
                    "version": v,
                    "input_tokens": t,
                    "state": s,
                    "error": e,
                    "written": False,
                }
                for r, v, t, s, e in items
            ],
        )


def claim_items(
    conn: Connection, run_id: str, dataset_id: str, n: int, now: datetime
) -> list[tuple[WorkItem, dict[str, Any] | None]]:
    """Mark up to ``n`` pending rows dispatched, with their frozen data; lowest IDs first."""
    if n <= 0:
        return []
    rows = conn.execute(
        select(run_items.c.row_id, run_items.c.version, run_items.c.input_tokens, dr.c.data)
        .select_from(
            run_items.outerjoin(
                dr,
                and_(
                    dr.c.dataset_id == dataset_id,
                    dr.c.row_id == run_items.c.row_id,
                    dr.c.version == run_items.c.version,
                ),
            )
        )
        .where(run_items.c.run_id == run_id, run_items.c.state == ItemState.PENDING)
        .order_by(run_items.c.row_id)
        .limit(n)
    ).all()
    if rows:
        conn.execute(
            update(run_items)
            .where(
                run_items.c.run_id == run_id,
                run_items.c.state == ItemState.PENDING,
                run_items.c.row_id.in_([r[0] for r in rows]),
            )
            .values(state=ItemState.DISPATCHED, updated_at=now)
        )
    return [
        (WorkItem(r[0], r[1], r[2]), json.loads(r[3]) if r[3] is not None else None) for r in rows
    ]


def record_results(
    conn: Connection, run_id: str, results: Sequence[ItemResult], now: datetime
) -> None:
    """Write finished rows and their usage, and add them to the run's counters.

    Only rows still ``dispatched`` are written, so a row is recorded (and its
    usage counted) once, even if a result arrives after a takeover.
    """
    if not results:
        return
    params = [
        {
            "rid": r.row_id,
            "st": r.state,
            "out": json.dumps(r.outputs, ensure_ascii=False) if r.outputs is not None else None,
            "ui": r.usage_input,
            "uo": r.usage_output,
            "ch": r.charge,
            "err": json.dumps(r.error) if r.error else None,
            "now": now,
        }
        for r in results
    ]
    conn.execute(
        update(run_items)
        .where(
            and_(
                run_items.c.run_id == run_id,
                run_items.c.row_id == bindparam("rid"),
                run_items.c.state == ItemState.DISPATCHED,
            )
        )
        .values(
            state=bindparam("st"),
            outputs=bindparam("out"),
            usage_input=bindparam("ui"),
            usage_output=bindparam("uo"),
            charge=bindparam("ch"),
            error=bindparam("err"),
            updated_at=bindparam("now"),
        ),
        params,
    )
    ok = [r for r in results if r.state == ItemState.SUCCEEDED]
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id)
        .values(
            rows_done=runs.c.rows_done + len(ok),
            rows_failed=runs.c.rows_failed + (len(results) - len(ok)),
            input_tokens=runs.c.input_tokens + sum(r.usage_input for r in ok),
            output_tokens=runs.c.output_tokens + sum(r.usage_output for r in ok),
            charge_accum=runs.c.charge_accum + sum(r.charge for r in ok),
            updated_at=now,
        )
    )


def _set_state(
    conn: Connection, run_id: str, old: str, new: str, now: datetime, error: str | None = None
) -> list[int]:
    ids = [
        r[0]
        for r in conn.execute(
            select(run_items.c.row_id).where(run_items.c.run_id == run_id, run_items.c.state == old)
        )
    ]
    if ids:
        conn.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.state == old)
            .values(state=new, updated_at=now, error=error)
        )
    return ids


def mark_uncertain(conn: Connection, run_id: str, now: datetime) -> list[int]:
    """Rows whose call was in flight when their worker died: never sent again."""
    error = json.dumps(
        {
            "code": "uncertain",
            "message": "the worker stopped while this row's call was in flight; it may have "
            "been answered upstream, so it was not sent again",
        }
    )
    return _set_state(conn, run_id, ItemState.DISPATCHED, ItemState.UNCERTAIN, now, error)


def cancel_pending(conn: Connection, run_id: str, now: datetime) -> list[int]:
    return _set_state(conn, run_id, ItemState.PENDING, ItemState.CANCELED, now)


def recount(conn: Connection, run_id: str, now: datetime) -> None:
    """Re-derive the run's counters from its rows (after a takeover or a stop)."""
    counts: dict[str, int] = {}
    tokens_in = tokens_out = charge = 0
    for state, n, ui, uo, ch in conn.execute(
        select(
            run_items.c.state,
            func.count(),
            func.sum(run_items.c.usage_input),
            func.sum(run_items.c.usage_output),
            func.sum(run_items.c.charge),
        )
        .where(run_items.c.run_id == run_id)
        .group_by(run_items.c.state)
    ):
        counts[state] = int(n)
        if state == ItemState.SUCCEEDED:
            tokens_in, tokens_out, charge = int(ui or 0), int(uo or 0), int(ch or 0)
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id)
        .values(
            rows_total=sum(counts.values()),
            rows_done=counts.get(ItemState.SUCCEEDED, 0),
            rows_failed=counts.get(ItemState.FAILED, 0) + counts.get(ItemState.UNCERTAIN, 0),
            rows_uncertain=counts.get(ItemState.UNCERTAIN, 0),
            rows_canceled=counts.get(ItemState.CANCELED, 0),
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            charge_accum=charge,
            updated_at=now,
        )
    )


def succeeded_unwritten(
    conn: Connection, run_id: str, limit: int
) -> list[tuple[int, int, list[str]]]:
    """Answered rows whose completions are not written yet: ``(row, version, outputs)``."""
    rows = conn.execute(
        select(run_items.c.row_id, run_items.c.version, run_items.c.outputs)
        .where(
            run_items.c.run_id == run_id,
            run_items.c.state == ItemState.SUCCEEDED,
            run_items.c.written.is_(False),
        )
        .order_by(run_items.c.row_id)
        .limit(limit)
    ).all()
    return [(r[0], r[1], json.loads(r[2]) if r[2] else []) for r in rows]


def mark_written(conn: Connection, run_id: str, row_ids: Sequence[int], now: datetime) -> None:
    if row_ids:
        conn.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.row_id.in_(list(row_ids)))
            .values(written=True)
        )
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(outputs_written=runs.c.outputs_written + len(row_ids), updated_at=now)
        )


def list_failures(
    conn: Connection, run_id: str, *, after: int | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Rows that failed or are uncertain, by row ID."""
    q = select(
        run_items.c.row_id,
        run_items.c.version,
        run_items.c.state,
        run_items.c.error,
        run_items.c.updated_at,
    ).where(
        run_items.c.run_id == run_id,
        run_items.c.state.in_([ItemState.FAILED, ItemState.UNCERTAIN]),
    )
    if after is not None:
        q = q.where(run_items.c.row_id > after)
    return [
        {
            "rowId": r.row_id,
            "version": r.version,
            "state": r.state,
            "error": json.loads(r.error) if r.error else None,
            "updatedAt": r.updated_at,
        }
        for r in conn.execute(q.order_by(run_items.c.row_id).limit(limit))
    ]


# Statuses in which a worker holds the run under a lease.
HELD = (RunStatus.RUNNING, RunStatus.STOPPING, RunStatus.WRITING_OUTPUTS)
