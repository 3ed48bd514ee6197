"""How workers take runs: claims and leases, on SQLite and PostgreSQL.

A run is claimed by one worker at a time through a lease: PostgreSQL picks a
claimable run with ``SELECT … FOR UPDATE SKIP LOCKED`` so two workers never
take the same one; SQLite serialises writers with ``BEGIN IMMEDIATE`` (see
``store.database``), so the same query is safe there. Every write a worker
makes is guarded by its ``Lease``: the owner and the fencing token the claim
handed out (``lease_token``, one more at every claim). A worker that lost its
lease (it stalled past expiry and another took over, or it claimed the run
again itself) changes nothing with the old token.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, Connection, and_, or_, select, update

from batchyard.core.leases import Lease
from batchyard.core.runs import RunStatus
from batchyard.store.runs import Run, load_run, run_of, runs

__all__ = [
    "HELD",
    "blocked_runs",
    "claim_run",
    "heartbeat",
    "held_by",
    "release_lease",
    "renew_lease",
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

    The claim adds one to the run's fencing token in the same statement; the
    returned run carries it (``run.lease``), and every later write names it.
    """
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
        .values(
            lease_owner=owner,
            lease_expires_at=lease_until,
            lease_token=runs.c.lease_token + 1,
        )
    )
    return load_run(conn, run_id)


def held_by(lease: Lease) -> ColumnElement[bool]:
    """The condition every write of a lease holder carries: the run is still under this claim."""
    return and_(runs.c.lease_owner == lease.owner, runs.c.lease_token == lease.token)


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
    return [run_of(r) for r in conn.execute(q)]


def renew_lease(conn: Connection, run_id: str, lease: Lease, lease_until: datetime) -> Run | None:
    """Extend the lease; ``None`` if another claim holds the run now."""
    done = conn.execute(
        update(runs).where(runs.c.id == run_id, held_by(lease)).values(lease_expires_at=lease_until)
    ).rowcount
    return load_run(conn, run_id) if done else None


def heartbeat(conn: Connection, run_id: str, lease: Lease, lease_until: datetime) -> str | None:
    """Extend the lease and read the status; ``None`` if the run is no longer ours."""
    done = conn.execute(
        update(runs).where(runs.c.id == run_id, held_by(lease)).values(lease_expires_at=lease_until)
    ).rowcount
    if not done:
        return None
    return str(conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar_one())


def release_lease(conn: Connection, run_id: str, lease: Lease) -> None:
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id, held_by(lease))
        .values(lease_owner=None, lease_expires_at=None)
    )
