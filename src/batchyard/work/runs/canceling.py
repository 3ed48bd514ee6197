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

from sqlalchemy import Connection

from batchyard.core.runs import TERMINAL, BlockedReason, RunStatus, check_transition
from batchyard.store import billing, work_items
from batchyard.store.leases import LET_GO
from batchyard.store.run_leases import runs_of_revoked_keys
from batchyard.store.runs import Run, load_run, update_run

__all__ = [
    "KEY_REVOKED",
    "canceled_by_owner",
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
    """What a run canceled by its owner carries: docs/reference/runs.md's cancellation details."""
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
        lease = {} if held else LET_GO
        update_run(c, run.id, now, status=S.STOPPING, **lease, **extra)
    else:
        if run.reservation_id is not None:
            reason = "canceled" if error is None else error["code"]
            billing.release(c, run.reservation_id, now, ref=run.id, detail={"reason": reason})
        work_items.cancel_pending(c, run.id, now)
        update_run(
            c,
            run.id,
            now,
            status=S.CANCELED,
            blocked_reason=None,
            charge=0 if run.reservation_id else None,
            **LET_GO,
            **extra,
        )
    return load_run(c, run.id)


def stop_runs_of_revoked_keys(c: Connection, now: datetime, *, limit: int = 100) -> list[str]:
    """Stop every live run whose key was revoked (or deleted); their IDs."""
    stopped = []
    for run in runs_of_revoked_keys(c, limit=limit):
        stop_run(c, run, now, error=KEY_REVOKED)
        stopped.append(run.id)
    return stopped
