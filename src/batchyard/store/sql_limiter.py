"""GCRA limits shared through the database, for deployments without Redis.

One row per limit key holds its TAT. A check locks its rows (``SELECT ... FOR
UPDATE`` on PostgreSQL, in key order so two checks never deadlock), computes
with the same pure functions as the in-process limiter, and writes back only if
every limit admits. Missing rows are inserted first with ``ON CONFLICT DO
NOTHING`` so there is always a row to lock; TAT 0 means idle. On SQLite the
insert takes the database's write lock, which serialises checks just as well.
A check with nothing to count (a route with no limits of its own is still
asked about its penalty before every call) writes nothing, so it only reads:
no insert, no lock, and the calls of one route never queue on its row.

The database driver blocks, so each operation runs in a worker thread and the
event loop keeps serving. It is slower than Redis (a transaction per check) but
needs nothing a batchyard deployment doesn't already run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from batchyard.core.clock import Clock
from batchyard.core.limits import (
    PENALTY,
    Admission,
    Cell,
    Limit,
    LimiterBase,
    SlotGrant,
    gcra_adjust,
    gcra_penalize,
    line_signature,
    log_penalty,
    new_slot_token,
    request_cells,
    settle,
    settle_in_line,
    storage_keys,
)
from batchyard.store.tables import rate_limits

__all__ = ["SqlLimiter"]


class SqlLimiter(LimiterBase):
    """Limits shared across replicas through PostgreSQL (or one SQLite file)."""

    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        super().__init__(clock)
        if engine.dialect.name not in ("postgresql", "sqlite"):
            raise ValueError(
                f"SqlLimiter supports postgresql and sqlite, not {engine.dialect.name}"
            )
        self._engine = engine

    async def try_acquire(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        *,
        max_delay: float = 0.0,
        hold_s: float = 0.0,
    ) -> Admission:
        keys = storage_keys(key, limits)
        cells = request_cells(limits)
        now = self._clock.time()
        if hold_s > 0 and limits:
            return await asyncio.to_thread(
                self._in_line, key, limits, keys, cells, now, max_delay, hold_s
            )

        def run() -> Admission:
            with self._engine.begin() as conn:
                if all(cell.increment <= 0 for cell in cells):
                    # Nothing to count (a route with no limits of its own, asked only
                    # about its penalty): nothing will be written, so read without
                    # inserting or locking, and calls of one route never queue here.
                    return settle(limits, cells, self._read_rows(conn, keys), now, max_delay)[0]
                locked = self._lock_rows(conn, keys)
                tats = [locked[k] for k in keys]
                admission, written = settle(limits, cells, tats, now, max_delay)
                if written is not None:
                    writes = [
                        {"k": k, "t": t}
                        for k, cell, t in zip(keys, cells, written, strict=True)
                        if cell.increment > 0
                    ]
                    self._write(conn, writes)
            return admission

        return await asyncio.to_thread(run)

    # Places in line are rows of the same table: ``<key>:!line:<signature>:<token>``
    # whose ``tat`` is the place's time. They are read and written under the
    # locks of the request's own limit rows, so two checks of one line never
    # both take (or both give) the same place.

    def _in_line(
        self,
        key: str,
        limits: Sequence[tuple[Limit, float]],
        keys: Sequence[str],
        cells: Sequence[Cell],
        now: float,
        max_delay: float,
        hold_s: float,
    ) -> Admission:
        prefix = f"{key}:!line:{line_signature(limits)}:"
        mine = sa.func.substr(rate_limits.c.key, 1, len(prefix)) == prefix
        with self._engine.begin() as conn:
            locked = self._lock_rows(conn, keys)
            tats = [locked[k] for k in keys]
            conn.execute(sa.delete(rate_limits).where(mine, rate_limits.c.tat < now - hold_s))
            rows = conn.execute(
                sa.select(rate_limits.c.key, rate_limits.c.tat)
                .where(mine)
                .order_by(rate_limits.c.tat, rate_limits.c.key)
                .limit(1)
            ).all()
            places = [float(t) for _, t in rows]
            admission, written, taken, given = settle_in_line(
                limits, cells, tats, places, now, max_delay, hold_s
            )
            if taken is not None:
                conn.execute(sa.delete(rate_limits).where(rate_limits.c.key == rows[0][0]))
            if given is not None:
                token = new_slot_token()[:16]
                conn.execute(sa.insert(rate_limits).values(key=prefix + token, tat=given))
            if written is not None:
                writes = [
                    {"k": k, "t": t}
                    for k, cell, t in zip(keys, cells, written, strict=True)
                    if cell.increment > 0
                ]
                self._write(conn, writes)
        return admission

    # Concurrency slots are rows of the same table: ``<key>:!slots`` is the row a
    # check locks (so two checks never both see a free slot), and each lease is a
    # row ``<key>:!slot:<token>`` whose ``tat`` is when the lease runs out. An
    # expired lease is deleted by the next check of its key (or by ``prune``).

    async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
        anchor, prefix = f"{key}:!slots", f"{key}:!slot:"
        now = self._clock.time()

        def run() -> SlotGrant:
            with self._engine.begin() as conn:
                self._lock_rows(conn, [anchor])
                mine = sa.func.substr(rate_limits.c.key, 1, len(prefix)) == prefix
                conn.execute(sa.delete(rate_limits).where(mine, rate_limits.c.tat <= now))
                in_use = conn.execute(
                    sa.select(sa.func.count()).select_from(rate_limits).where(mine)
                ).scalar_one()
                if in_use >= capacity:
                    return SlotGrant(None, int(in_use))
                token = new_slot_token()
                conn.execute(sa.insert(rate_limits).values(key=prefix + token, tat=now + lease_s))
                return SlotGrant(token, int(in_use) + 1)

        return await asyncio.to_thread(run)

    async def renew_slot(self, key: str, token: str, lease_s: float) -> None:
        until = self._clock.time() + lease_s

        def run() -> None:
            with self._engine.begin() as conn:
                conn.execute(
                    sa.update(rate_limits)
                    .where(rate_limits.c.key == f"{key}:!slot:{token}")
                    .values(tat=until)
                )

        await asyncio.to_thread(run)

    async def _free_slot(self, key: str, token: str) -> None:
        def run() -> None:
            with self._engine.begin() as conn:
                lease = rate_limits.c.key == f"{key}:!slot:{token}"
                conn.execute(sa.delete(rate_limits).where(lease))

        await asyncio.to_thread(run)

    async def adjust(self, key: str, limit: Limit, delta: float) -> None:
        k = f"{key}:{limit.name}"
        now = self._clock.time()

        def run() -> None:
            with self._engine.begin() as conn:
                tat = self._lock_rows(conn, [k])[k]
                self._write(conn, [{"k": k, "t": gcra_adjust(tat, now, delta * limit.interval)}])

        await asyncio.to_thread(run)

    async def penalize(self, key: str, until: float) -> None:
        k = f"{key}:{PENALTY}"

        def run() -> None:
            with self._engine.begin() as conn:
                tat = self._lock_rows(conn, [k])[k]
                self._write(conn, [{"k": k, "t": gcra_penalize(tat, until)}])

        await asyncio.to_thread(run)
        log_penalty(key, until, self._clock.time())

    async def prune(self, idle_for: float = 3600.0) -> int:
        """Delete rows idle for ``idle_for`` seconds; the rows a check needs come back.

        Safe alongside checks: a check that finds its row deleted between the
        insert and the lock inserts it again before computing.
        """
        cutoff = self._clock.time() - idle_for

        def run() -> int:
            with self._engine.begin() as conn:
                result = conn.execute(sa.delete(rate_limits).where(rate_limits.c.tat < cutoff))
                return result.rowcount

        return await asyncio.to_thread(run)

    @staticmethod
    def _read_rows(conn: sa.Connection, keys: Sequence[str]) -> list[float]:
        """The TATs of ``keys`` in order, unlocked; a missing row is idle (0)."""
        read = sa.select(rate_limits.c.key, rate_limits.c.tat).where(rate_limits.c.key.in_(keys))
        found = {k: float(t) for k, t in conn.execute(read)}
        return [found.get(k, 0.0) for k in keys]

    def _lock_rows(self, conn: sa.Connection, keys: Sequence[str]) -> dict[str, float]:
        ordered = sorted(set(keys))
        insert = postgresql.insert if self._engine.dialect.name == "postgresql" else sqlite.insert
        ensure = insert(rate_limits).on_conflict_do_nothing(index_elements=["key"])
        lock = (
            sa.select(rate_limits.c.key, rate_limits.c.tat)
            .where(rate_limits.c.key.in_(ordered))
            .order_by(rate_limits.c.key)
            .with_for_update()
        )
        # A prune can delete a row between our insert and our lock; go round
        # again until every row is both present and ours.
        for _ in range(5):
            conn.execute(ensure, [{"key": k, "tat": 0.0} for k in ordered])
            rows = {k: float(t) for k, t in conn.execute(lock)}
            if len(rows) == len(ordered):
                return rows
        raise RuntimeError("rate limit rows kept vanishing while being locked")

    @staticmethod
    def _write(conn: sa.Connection, writes: list[dict[str, object]]) -> None:
        if not writes:
            return
        stmt = (
            sa.update(rate_limits)
            .where(rate_limits.c.key == sa.bindparam("k"))
            .values(tat=sa.bindparam("t"))
        )
        conn.execute(stmt, writes)
