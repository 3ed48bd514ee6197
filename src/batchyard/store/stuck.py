"""Work with something left to do whose progress has not moved: what ``batchyard stuck`` lists.

Progress is a unit ending (answered, failed, expired, canceled, uncertain): a
claim, a lease renewal or a call handed back does not count, so a batch whose
lines are claimed and given back over and over, because their route refuses
every connection, stands still here as it does for its owner. Each kind's
last progress is its newest ended unit, or the moment it started waiting
(a file batch's ``in_progress_at``, a deferred batch's creation, a run's last
change of status) where none has ended yet:

- file batches in a live status with lines ``pending`` or ``dispatched``; a
  Message Batch is one (``kind`` ``message_batch``);
- deferred batches ``in_progress`` or ``canceling`` with items ``waiting`` or
  ``dispatched``;
- batch inference runs ``queued`` or ``running`` with rows ``pending`` or
  ``dispatched``.

The stuck-work watch (``work.stuck_watch``) records a ``work_stuck`` activity
entry for each, once per standstill, saying why it waits; ``noticed`` reads
those entries back for the command.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, case, func, select

from batchyard.core.clock import isoformat
from batchyard.core.runs import ItemState, RunStatus
from batchyard.store.deferred_batch_tables import ACTIVE, batch_items, batches
from batchyard.store.file_batches import LIVE, file_batch_lines, file_batches, waits_until
from batchyard.store.runs import run_items, runs
from batchyard.store.tables import activity

__all__ = ["STUCK_KIND", "Idle", "idle_work", "noticed"]

#: The activity kind the watch records, once per standstill.
STUCK_KIND = "work_stuck"
_MESSAGES = "/v1/messages"
_WAITING_LINES = ("pending", "dispatched")
_WAITING_ROWS = (ItemState.PENDING.value, ItemState.DISPATCHED.value)
_RUNS_WORKING = (RunStatus.QUEUED.value, RunStatus.RUNNING.value)


@dataclass(frozen=True, slots=True)
class Idle:
    """One piece of work with units left whose progress last moved at ``since``."""

    #: ``file_batch``, ``message_batch``, ``deferred_batch`` or ``run``.
    kind: str
    id: str
    org_id: str
    since: datetime
    #: Units not yet ended.
    left: int
    #: The models its waiting units name.
    models: tuple[str, ...]
    #: The discount it waits on the price market for, if any.
    min_discount: str | None
    #: Until when its window lets it wait for a price (a file batch's window over 24 h).
    waits_until: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.id,
            "org_id": self.org_id,
            "since": isoformat(self.since),
            "left": self.left,
            "models": list(self.models),
            "min_discount": self.min_discount,
        }


def _models(conn: Connection, table: Any, key: Any, waiting: Any, ids: list[str]) -> dict[str, Any]:
    """The distinct models of each piece's waiting units."""
    found: dict[str, set[str]] = {i: set() for i in ids}
    if ids:
        rows = conn.execute(select(key, table.c.model).where(key.in_(ids), waiting).distinct())
        for owner, model in rows:
            found[owner].add(model)
    return {i: tuple(sorted(m)) for i, m in found.items()}


def _file_batches(conn: Connection, before: datetime) -> list[Idle]:
    fb, fbl = file_batches, file_batch_lines
    waiting = fbl.c.state.in_(_WAITING_LINES)
    started = func.coalesce(fb.c.in_progress_at, fb.c.created_at)
    q = (
        select(
            fb.c.id,
            fb.c.org_id,
            fb.c.endpoint,
            fb.c.min_discount,
            fb.c.created_at,
            fb.c.expires_at,
            started.label("started"),
            func.max(case((~waiting, fbl.c.updated_at))).label("last_end"),
            func.sum(case((waiting, 1), else_=0)).label("left"),
        )
        .select_from(fb.join(fbl, fbl.c.batch_id == fb.c.id))
        .where(fb.c.status.in_(LIVE))
        .group_by(
            fb.c.id,
            fb.c.org_id,
            fb.c.endpoint,
            fb.c.min_discount,
            fb.c.created_at,
            fb.c.expires_at,
            started,
        )
    )
    found = []
    for r in conn.execute(q):
        since = max(t for t in (r.started, r.last_end) if t is not None)
        if r.left and since <= before:
            found.append(r)
    models = _models(conn, fbl, fbl.c.batch_id, waiting, [r.id for r in found])
    return [
        Idle(
            "message_batch" if r.endpoint == _MESSAGES else "file_batch",
            r.id,
            r.org_id,
            max(t for t in (r.started, r.last_end) if t is not None),
            int(r.left),
            models[r.id],
            r.min_discount,
            waits_until(r.created_at, r.expires_at),
        )
        for r in found
    ]


def _deferred_batches(conn: Connection, before: datetime) -> list[Idle]:
    b, bi = batches, batch_items
    waiting = bi.c.status.in_(ACTIVE)
    q = (
        select(
            b.c.id,
            b.c.org_id,
            b.c.min_discount,
            b.c.created_at,
            func.max(case((~waiting, bi.c.finished_at))).label("last_end"),
            func.sum(case((waiting, 1), else_=0)).label("left"),
        )
        .select_from(b.join(bi, bi.c.batch_id == b.c.id))
        .where(b.c.status.in_(("in_progress", "canceling")))
        .group_by(b.c.id, b.c.org_id, b.c.min_discount, b.c.created_at)
    )
    found = []
    for r in conn.execute(q):
        since = max(t for t in (r.created_at, r.last_end) if t is not None)
        if r.left and since <= before:
            found.append((r, since))
    models = _models(conn, bi, bi.c.batch_id, waiting, [r.id for r, _ in found])
    return [
        Idle("deferred_batch", r.id, r.org_id, since, int(r.left), models[r.id], r.min_discount)
        for r, since in found
    ]


def _runs(conn: Connection, before: datetime) -> list[Idle]:
    ri = run_items
    waiting = ri.c.state.in_(_WAITING_ROWS)
    q = (
        select(
            runs.c.id,
            runs.c.org_id,
            runs.c.spec,
            runs.c.updated_at,
            func.max(case((~waiting, ri.c.updated_at))).label("last_end"),
            func.sum(case((waiting, 1), else_=0)).label("left"),
        )
        .select_from(runs.join(ri, ri.c.run_id == runs.c.id))
        .where(runs.c.status.in_(_RUNS_WORKING))
        .group_by(runs.c.id, runs.c.org_id, runs.c.spec, runs.c.updated_at)
    )
    found = []
    for r in conn.execute(q):
        since = max(t for t in (r.updated_at, r.last_end) if t is not None)
        if r.left and since <= before:
            model = (json.loads(r.spec).get("model") or {}).get("id")
            models = (str(model),) if model else ()
            found.append(Idle("run", r.id, r.org_id, since, int(r.left), models, None))
    return found


def idle_work(conn: Connection, before: datetime) -> list[Idle]:
    """Every piece of work with units left whose last progress was at or before ``before``."""
    found = [*_file_batches(conn, before), *_deferred_batches(conn, before), *_runs(conn, before)]
    return sorted(found, key=lambda w: (w.since, w.id))


def noticed(conn: Connection, work: Sequence[Idle]) -> dict[str, dict[str, Any]]:
    """The ``work_stuck`` entry already recorded for each piece's standstill, by its ID.

    An entry counts for a standstill when it names the same ``since``: work
    that moved and stopped again is a new standstill, to be noticed again.
    """
    if not work:
        return {}
    want = {(w.id, isoformat(w.since)) for w in work}
    rows = conn.execute(
        select(activity.c.ref, activity.c.detail)
        .where(
            activity.c.org_id.in_(sorted({w.org_id for w in work})),
            activity.c.kind == STUCK_KIND,
            activity.c.ref.in_(sorted({w.id for w in work})),
        )
        .order_by(activity.c.id)
    )
    found: dict[str, dict[str, Any]] = {}
    for ref, detail in rows:
        d = json.loads(detail) if detail else {}
        if (ref, d.get("since")) in want:
            found[ref] = d
    return found
