"""How workers take runs: claims and leases, on SQLite and PostgreSQL.

A run is claimed by one worker at a time through a lease (``store.leases``,
the one way every queue claims): the oldest claimable run is locked and
leased in one transaction, so two workers never take the same one. Every
write a worker makes is guarded by its ``Lease``: the owner and the fencing
token the claim handed out. A worker that lost its lease (it stalled past
expiry and another took over, or it claimed the run again itself) changes
nothing with the old token. A run's rows have no lease of their own: they are
the run holder's (``store.work_items``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, and_, or_, select, update

from batchyard.core.leases import Lease
from batchyard.core.runs import TERMINAL, RunStatus
from batchyard.store import leases
from batchyard.store.runs import Run, load_run, run_of, runs
from batchyard.store.tables import api_keys

__all__ = [
    "HELD",
    "blocked_runs",
    "claim_run",
    "release",
    "renew",
    "revoked_run_exists",
    "runs_of_revoked_keys",
    "work_waiting",
]

# Statuses in which a worker holds the run under a lease.
HELD = (RunStatus.RUNNING, RunStatus.STOPPING, RunStatus.WRITING_OUTPUTS)


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
    """Take the oldest run in ``statuses`` whose lease is free or expired.

    The claim adds one to the run's fencing token; the returned run carries it
    (``run.lease``), and every later write names it.
    """
    where = [runs.c.status.in_(list(statuses)), leases.free(runs, now)]
    if exclude:
        where.append(runs.c.id.not_in(list(exclude)))
    if blocked_reason is not None:
        where.append(runs.c.blocked_reason == blocked_reason)
    taken = leases.claim(
        conn,
        runs,
        runs.c.id,
        owner,
        lease_until,
        where=where,
        order_by=[runs.c.updated_at, runs.c.id],
        limit=1,
    )
    return load_run(conn, next(iter(taken))) if taken else None


def work_waiting(
    conn: Connection, now: datetime, statuses: Sequence[str], exclude: Sequence[str] = ()
) -> tuple[bool, bool]:
    """Cheap read first: is any run claimable, is any run waiting on funds?

    Lets an idle worker poll with one read instead of write transactions,
    which on SQLite would queue behind every other writer.
    """
    claimable = select(runs.c.id).where(
        leases.free(runs, now),
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
    """Blocked runs waiting on ``reason``, longest-waiting first (locked, skipping taken ones)."""
    q = (
        select(runs)
        .where(runs.c.status == RunStatus.BLOCKED, runs.c.blocked_reason == reason)
        .order_by(runs.c.updated_at)
        .limit(limit)
    )
    return [run_of(r) for r in conn.execute(leases.lock_skipping(conn, q))]


def renew(conn: Connection, run_id: str, lease: Lease, lease_until: datetime) -> str | None:
    """Extend the lease and read the run's status; ``None`` if another claim holds it now."""
    where = [runs.c.id == run_id, leases.held_by(runs, lease)]
    if not leases.renew(conn, runs, lease_until, where=where):
        return None
    return str(conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar_one())


def release(conn: Connection, run_id: str, lease: Lease) -> None:
    """Let the run go (another worker may claim it at once), if ``lease`` still holds it."""
    conn.execute(
        update(runs).where(runs.c.id == run_id, leases.held_by(runs, lease)).values(**leases.LET_GO)
    )


def _revoked() -> tuple[ColumnElement[bool], ...]:
    """Live runs (not finished, not already stopping) whose starting key was revoked or deleted."""
    active = select(api_keys.c.id).where(api_keys.c.revoked_at.is_(None))
    return (
        runs.c.status.not_in([*TERMINAL, RunStatus.STOPPING]),
        runs.c.key_id.is_not(None),
        runs.c.key_id.not_in(active),
    )


def revoked_run_exists(conn: Connection) -> bool:
    """Whether any live run's key was revoked: a read, before any write is asked for."""
    return conn.execute(select(runs.c.id).where(*_revoked()).limit(1)).first() is not None


def runs_of_revoked_keys(conn: Connection, *, limit: int = 100) -> list[Run]:
    """Live runs whose key was revoked, locked (skipping those another transaction holds)."""
    q = select(runs).where(*_revoked()).limit(limit)
    return [run_of(r) for r in conn.execute(leases.lock_skipping(conn, q)).all()]
