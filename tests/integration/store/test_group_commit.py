"""Group commit (``Database.write``), on SQLite and on PostgreSQL: one write's failure is its own.

Writes queued together share one transaction and one commit, each in a savepoint of its
own: a write that fails (after writing, or on a constraint) leaves nothing behind and only
its caller hears of it; the others in the group commit. The group is made certain by
holding the writer thread on a first write until the rest are queued.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime

import pytest
from sqlalchemy import Connection, insert, select

from batchyard.store import accounts
from batchyard.store.database import Database
from batchyard.store.tables import organisations

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


@pytest.fixture
def db(fresh_db: Database) -> Database:
    fresh_db.migrate()
    return fresh_db


class Refused(Exception):
    """A write's own error, raised after it wrote."""


def _names(db: Database) -> set[str]:
    rows = db.read_sync(lambda c: c.execute(select(organisations.c.name)).all())
    return {r.name for r in rows}


async def test_a_failed_write_in_a_group_leaves_nothing_and_the_others_commit(
    db: Database,
) -> None:
    release = threading.Event()

    def first(conn: Connection) -> str:
        release.wait(timeout=30)  # the writer thread waits here while the group queues
        return accounts.ensure_org(conn, "first", NOW).id

    def good(name: str):  # type: ignore[no-untyped-def]
        return lambda conn: accounts.ensure_org(conn, name, NOW).id

    def wrote_then_raised(conn: Connection) -> None:
        accounts.ensure_org(conn, "rolled-back", NOW)
        raise Refused("after writing")

    def duplicate(conn: Connection) -> None:
        # A constraint the database refuses: the same organisation ID twice.
        row = conn.execute(select(organisations).limit(1)).mappings().one()
        conn.execute(insert(organisations).values(**{**row, "name": "twin"}))

    held = asyncio.ensure_future(db.write(first))
    await asyncio.sleep(0)
    while db._queue:  # until the writer thread has taken ``first``
        await asyncio.sleep(0)
    queued = [
        asyncio.ensure_future(db.write(good("a"))),
        asyncio.ensure_future(db.write(wrote_then_raised)),
        asyncio.ensure_future(db.write(duplicate)),
        asyncio.ensure_future(db.write(good("b"))),
    ]
    await asyncio.sleep(0)
    assert len(db._queue) == len(queued)  # one group, behind ``first``
    release.set()
    results = await asyncio.gather(held, *queued, return_exceptions=True)

    assert isinstance(results[0], str) and isinstance(results[1], str)
    assert isinstance(results[2], Refused)
    assert isinstance(results[3], Exception) and not isinstance(results[3], Refused)
    assert isinstance(results[4], str)
    assert _names(db) == {"first", "a", "b"}
    # The connection is usable after the group: the next write commits alone.
    await db.write(good("after"))
    assert "after" in _names(db)
