"""Stopping a run: by its owner (``POST …/cancel``) or because the key that started it was revoked.

Both go through ``stop_run`` so a run stops the same way whoever asks: a run
with calls in flight goes to ``stopping`` and its worker lets them land,
writes the answered rows and settles; a run nobody is working on is
``canceled`` at once, its reservation released. Nothing not yet sent is sent
afterwards.

Revocation (``stop_runs_of_revoked_keys``) looks for live runs whose key is
no longer active: the API, ``batchyard keys revoke`` and a worker's every
round call it, so a revoked key's runs stop within a round wherever the
revocation was made.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select

from batchyard.core.runs import TERMINAL, BlockedReason, RunStatus, check_transition
from batchyard.store import activity, ledger, work_items
from batchyard.store.runs import Run, load_run, run_of, runs, update_run
from batchyard.store.tables import api_keys

__all__ = [
    "KEY_REVOKED",
    "canceled_by_owner",
    "revoked_runs_exist",
    "stop_run",
    "stop_runs_of_revoked_keys",
]

S = RunStatus

#: The error a run stopped by revocation carries.
KEY_REVOKED = {
    "code": "key_revoked",
    "message": "the API key that started this run was revoked; rows not yet sent were "
    "canceled and nothing more is charged",
}


def canceled_by_owner(key_id: str | None, now: datetime) -> dict[str, Any]:
    """The error a run canceled by its owner carries: seed 002's "cancellation details"."""
    return {
        "code": "canceled",
        "message": "the run was canceled by its owner (POST …/cancel); answered rows are "
        "kept and charged, rows not yet sent were canceled and nothing more is charged",
        "canceledAt": now.isoformat().replace("+00:00", "Z"),
        "canceledByKeyId": key_id,
    }


def stop_run(c: Connection, run: Run, now: datetime, *, error: dict[str, Any] | None = None) -> Run:
    """Stop ``run`` (locked by the caller): ``stopping`` with calls in flight, else ``canceled``."""
    if run.status == S.STOPPING:
        return run
    if run.status in TERMINAL:
        check_transition(run.status, S.CANCELED, run_id=run.id)
    held = run.status in (S.RUNNING, S.WRITING_OUTPUTS)
    extra: dict[str, Any] = {"error": error} if error is not None else {}
    if held or (run.status == S.BLOCKED and run.blocked_reason == BlockedReason.PAYMENT):
        # A worker finishes it: in-flight calls land, outputs are written, usage settled.
        lease = {} if held else {"lease_owner": None, "lease_expires_at": None}
        update_run(c, run.id, now, status=S.STOPPING, **lease, **extra)
    else:
        if run.reservation_id is not None:
            res = ledger.release(c, run.reservation_id, now)
            activity.record(
                c,
                run.org_id,
                "release",
                now,
                ref=run.id,
                reservation_id=res.id,
                amount=res.amount,
                detail={"reason": "canceled" if error is None else error["code"]},
            )
        work_items.cancel_pending(c, run.id, now)
        update_run(
            c,
            run.id,
            now,
            status=S.CANCELED,
            blocked_reason=None,
            charge=0 if run.reservation_id else None,
            lease_owner=None,
            lease_expires_at=None,
            **extra,
        )
    return load_run(c, run.id)


def _revoked() -> Any:
    active = select(api_keys.c.id).where(api_keys.c.revoked_at.is_(None))
    return (
        runs.c.status.not_in([*TERMINAL, S.STOPPING]),
        runs.c.key_id.is_not(None),
        runs.c.key_id.not_in(active),
    )


def revoked_runs_exist(c: Connection) -> bool:
    """Whether any live run's key was revoked: a read, before any write is asked for."""
    return c.execute(select(runs.c.id).where(*_revoked()).limit(1)).first() is not None


def stop_runs_of_revoked_keys(c: Connection, now: datetime, *, limit: int = 100) -> list[str]:
    """Stop every live run whose key was revoked (or deleted); their IDs."""
    q = select(runs).where(*_revoked()).limit(limit)
    if c.dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    stopped = []
    for row in c.execute(q).all():
        stop_run(c, run_of(row), now, error=KEY_REVOKED)
        stopped.append(str(row.id))
    return stopped
