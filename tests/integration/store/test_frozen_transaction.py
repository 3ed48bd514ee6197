"""A process frozen inside a transaction does not keep its row locks (PostgreSQL).

Claims lock what they take with ``FOR UPDATE SKIP LOCKED``, so a worker stopped
(SIGSTOP, a paused VM) between two statements of a transaction would keep the
rows it touched, and its leased work, from every other worker until it woke.
The server ends a session idle in a transaction past ``idle_transaction_s``: the
rows become claimable, and the frozen side's next statement fails as a store
outage (503, retryable), not a hang. The timeout is the server's, in real time,
so it is short here and every wait is a bounded poll.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from batchyard.core.clock import SystemClock
from batchyard.errors import StorageUnavailable
from batchyard.store.accounts import ensure_org
from batchyard.store.database import Database, storage_failure
from batchyard.store.tables import organisations
from tests.support.waits import until

pytestmark = pytest.mark.postgres


async def test_a_frozen_transactions_row_locks_are_let_go_and_its_next_statement_is_an_outage(
    pg_url: str,
) -> None:
    frozen = Database(pg_url, pool_size=1, idle_transaction_s=0.5)
    other = Database(pg_url, pool_size=1)
    try:
        now = SystemClock().now()
        org_id = other.transact_sync(lambda c: ensure_org(c, "frozen", now).id)
        locking = select(organisations.c.id).where(organisations.c.id == org_id)
        skipping = locking.with_for_update(skip_locked=True)
        conn = frozen.engine.connect()
        conn.begin()
        assert conn.execute(locking.with_for_update()).scalar_one() == org_id
        # The row is locked: a claim skips it ...
        assert other.read_sync(lambda c: c.execute(skipping).first()) is None
        # ... until the server ends the idle transaction, with no one touching it.
        await until(
            lambda: other.read_sync(lambda c: c.execute(skipping).first()) is not None,
            "the frozen session's lock is let go",
            interval=0.1,
        )
        with pytest.raises(Exception) as raised:
            conn.execute(select(1))
        assert isinstance(storage_failure(raised.value), StorageUnavailable)
        conn.close()
        # The handle itself recovers: the next read takes a new connection.
        assert frozen.read_sync(lambda c: c.execute(locking).scalar_one()) == org_id
    finally:
        frozen.close()
        other.close()
