"""The quote's scan of a dataset (``current_rows``) on SQLite and PostgreSQL, plain and sealed.

The scan reads through the DB-API driver rather than SQLAlchemy's rows (a
quote reads a million rows through it), so it is checked on both real
databases: rows after a cursor, in order, at most ``limit``, sealed data
opened, and the same text the row was appended with.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from batchyard.core.clock import ManualClock
from batchyard.core.sealing import Sealer, generate_key
from batchyard.store import projects as pstore
from batchyard.store.at_rest import PREFIX
from batchyard.store.database import Database
from tests.support.run_store import add_dataset, add_org

ROWS = [{"text": f'ticket {n} – naïve "quoted" text', "n": n} for n in range(1, 8)]


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/scan.db"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(params=[False, True], ids=["plain", "sealed"])
def db(request: pytest.FixtureRequest, url: str) -> Iterator[Database]:
    database = Database(url, sealer=Sealer(generate_key()) if request.param else None)
    database.migrate()
    try:
        yield database
    finally:
        database.close()


def test_scan_pages_through_current_rows_in_order(db: Database) -> None:
    now = ManualClock().now()
    _, dataset = add_dataset(db, now, add_org(db, now), ROWS)

    def scan(after: int, limit: int) -> list[tuple[int, int, str]]:
        return db.read_sync(lambda c: pstore.current_rows(c, dataset, after=after, limit=limit))

    stored = db.read_sync(
        lambda c: (
            c.execute(
                select(pstore.dataset_rows.c.data).where(
                    pstore.dataset_rows.c.dataset_id == dataset
                )
            )
            .scalars()
            .all()
        )
    )
    assert [s.startswith(PREFIX) for s in stored] == [db.sealer is not None] * len(ROWS)
    first = scan(0, 3)
    assert [(r, v) for r, v, _ in first] == [(1, 1), (2, 1), (3, 1)]
    assert [json.loads(text) for _, _, text in first] == ROWS[:3]
    rest = scan(first[-1][0], 100)
    assert [r for r, _, _ in rest] == [4, 5, 6, 7]
    assert [json.loads(text) for _, _, text in rest] == ROWS[3:]
    assert scan(7, 100) == []


def test_scan_stays_inside_its_dataset(db: Database) -> None:
    now = ManualClock().now()
    org = add_org(db, now)
    _, one = add_dataset(db, now, org, ROWS[:2])
    _, other = add_dataset(db, now, org, ROWS[2:5])
    got = db.read_sync(lambda c: pstore.current_rows(c, other, after=0, limit=10))
    assert [json.loads(text)["n"] for _, _, text in got] == [3, 4, 5]
    got = db.read_sync(lambda c: pstore.current_rows(c, one, after=0, limit=10))
    assert [json.loads(text)["n"] for _, _, text in got] == [1, 2]
