"""What ``/readyz`` asks the store: can it still take a write?

A read succeeds on a full disk or a read-only file; only a write (and its
commit) finds out. ``probe`` rewrites one small row of ``store_probes``, so a
probe costs one tiny transaction and leaves the table the same size. The
stuck-work watch probes its own row each sweep, so ``probed_at`` also says
when a worker last watched (``batchyard stuck``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, insert, select, update

from batchyard.store.tables import store_probes

__all__ = ["probe", "probed_at"]


def probe(conn: Connection, name: str, now: datetime) -> None:
    """Write ``name``'s row (insert it the first time)."""
    done = conn.execute(
        update(store_probes).where(store_probes.c.name == name).values(at=now)
    ).rowcount
    if not done:
        conn.execute(insert(store_probes).values(name=name, at=now))


def probed_at(conn: Connection, name: str) -> datetime | None:
    """When ``name``'s row was last written; None if it never was."""
    return conn.execute(select(store_probes.c.at).where(store_probes.c.name == name)).scalar()
