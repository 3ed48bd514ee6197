"""Organisations, datasets and batch inference runs made straight in the store.

The unit tests of the run work (quoting, funding, executing) and of the
leases need a run in a given state without the API that normally makes one;
these helpers write exactly what the API and the worker would, through the
store's own functions, and read the results back.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, select

from batchyard.core.ids import new_id
from batchyard.core.money import to_ticks
from batchyard.core.runs import RunStatus
from batchyard.store import accounts, ledger
from batchyard.store import projects as pstore
from batchyard.store.database import Database
from batchyard.store.runs import Run, create_run, load_run, run_items, update_run

__all__ = [
    "add_dataset",
    "add_org",
    "add_run",
    "balance",
    "items",
    "load",
    "run_spec",
]


def add_org(db: Database, now: datetime, *, name: str = "acme", credit: str = "10") -> str:
    """An organisation with ``credit`` dollars topped up."""

    def tx(c: Connection) -> str:
        org = accounts.ensure_org(c, name, now)
        if Decimal(credit) > 0:
            ledger.top_up(c, org.id, to_ticks(Decimal(credit)), now)
        return org.id

    return db.transact_sync(tx)


def add_dataset(
    db: Database, now: datetime, org_id: str, rows: list[dict[str, Any]], *, kind: str = "text"
) -> tuple[str, str]:
    """A project with one dataset of ``rows`` (row IDs 1..n, version 1): (project, dataset)."""

    def tx(c: Connection) -> tuple[str, str]:
        project = pstore.create_project(c, org_id, "p", now)
        ds = pstore.create_dataset(c, org_id, project.id, "ds", kind, now)
        pstore.append_rows(c, ds.id, rows, now)
        return project.id, ds.id

    return db.transact_sync(tx)


def run_spec(
    *,
    model: str = "m",
    field: str | None = "text",
    output: str = "answer",
    max_out: int = 8,
    samples: int = 1,
    row_filter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A run's spec as ``api.runs`` normalises it; ``field=None`` reads ``messages``."""
    source = {"type": "messages"} if field is None else {"type": "field", "field": field}
    return {
        "model": {"type": "base", "id": model},
        "mode": {"type": "single_turn"},
        "input": source,
        "output": {"type": "field", "field": output},
        "sampling": {
            "maxOutputTokens": max_out,
            "samplesPerRow": samples,
            "temperature": None,
            "topP": None,
        },
        "filter": row_filter,
    }


def add_run(
    db: Database,
    now: datetime,
    *,
    org_id: str,
    project_id: str,
    dataset_id: str,
    spec: dict[str, Any] | None = None,
    status: str = RunStatus.PREPARING,
    **values: Any,
) -> str:
    """A run as ``create_run`` makes it, then moved to ``status`` with ``values`` set."""
    run_id = new_id("bir", now)

    def tx(c: Connection) -> None:
        create_run(
            c,
            run_id=run_id,
            org_id=org_id,
            project_id=project_id,
            dataset_id=dataset_id,
            spec=spec or run_spec(),
            now=now,
        )
        if status != RunStatus.PREPARING or values:
            update_run(c, run_id, now, status=status, **values)

    db.transact_sync(tx)
    return run_id


def load(db: Database, run_id: str) -> Run:
    return db.read_sync(lambda c: load_run(c, run_id))


def items(db: Database, run_id: str) -> list[dict[str, Any]]:
    """The run's frozen rows, by row ID, as plain dicts."""

    def q(c: Connection) -> list[dict[str, Any]]:
        rows = c.execute(
            select(run_items).where(run_items.c.run_id == run_id).order_by(run_items.c.row_id)
        )
        return [dict(r._mapping) for r in rows]

    return db.read_sync(q)


def balance(db: Database, org_id: str) -> ledger.Balance:
    return db.read_sync(lambda c: ledger.balance(c, org_id))
