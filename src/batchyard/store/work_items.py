"""A run's rows (work items): frozen at the quote, claimed, answered, written.

A row is frozen as ``(row id, version)`` when the run is quoted, so the run
answers exactly the text it priced. Its state moves ``pending`` →
``dispatched`` → ``succeeded`` | ``failed``. Just before its engine call a
row is marked sent (``sent_at``, durably): a dispatched row whose worker died
or was stopped becomes ``uncertain`` (never sent again) only if it was sent,
and goes back to ``pending`` if it was still waiting for its turn. Each
change to the rows updates the run's counters in the same transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    delete,
    false,
    func,
    insert,
    literal,
    select,
    update,
)

from batchyard.core.leases import Lease
from batchyard.core.runs import ItemState
from batchyard.store import end_order, leases
from batchyard.store.at_rest import open_text, seal_text
from batchyard.store.projects import dataset_rows as dr
from batchyard.store.projects import row_aad
from batchyard.store.runs import run_items, runs

#: The error an uncertain row carries.
UNCERTAIN_ERROR = json.dumps(
    {
        "code": "uncertain",
        "message": "the worker stopped while this row's call was in flight; it may have "
        "been answered upstream, so it was not sent again",
    }
)

__all__ = [
    "ItemResult",
    "RetryCopy",
    "WorkItem",
    "add_items",
    "cancel_pending",
    "claim_items",
    "clear_items",
    "copy_for_retry",
    "ended_rows",
    "list_failures",
    "mark_sent",
    "mark_uncertain",
    "mark_written",
    "record_results",
    "recount",
    "recover_dispatched",
    "requeue_unsent",
    "succeeded_unwritten",
]


@dataclass(frozen=True, slots=True)
class WorkItem:
    row_id: int
    version: int
    input_tokens: int


@dataclass(frozen=True, slots=True)
class ItemResult:
    """What one row's call came to; ``state`` is succeeded or failed."""

    row_id: int
    state: str
    outputs: list[str] | None = None
    usage_input: int = 0
    usage_output: int = 0
    charge: int = 0
    error: dict[str, Any] | None = None
    #: Of ``usage_input``, the prompt tokens the engine read from its cache.
    usage_cached: int = 0


@dataclass(frozen=True, slots=True)
class RetryCopy:
    """What a retry took from the run it retries, and what it left (``copy_for_retry``)."""

    rows: int
    input_tokens: int
    succeeded: int
    too_long: int
    uncertain: int
    uncertain_row_ids: list[int]


#: The row states a retry sends again: the call failed, or it was never sent.
RETRIED = (ItemState.FAILED, ItemState.CANCELED)


def copy_for_retry(
    conn: Connection, from_run: str, to_run: str, *, fits: int, name_at_most: int
) -> RetryCopy:
    """Freeze another run's failed and canceled rows into ``to_run``, pending, as they were.

    Each keeps its row ID and the version the first run froze (the text it
    priced) and its token count; one ``INSERT … SELECT``, so a retry of a
    million rows moves no row through Python. A row whose prompt cannot fit
    (``fits`` tokens) would fail again and is left out; a row that succeeded
    or is ``uncertain`` (its call may have been answered upstream) is never
    copied, and up to ``name_at_most`` uncertain rows are named.
    """
    ri = run_items
    source = select(
        literal(to_run),
        ri.c.row_id,
        ri.c.version,
        ri.c.input_tokens,
        literal(str(ItemState.PENDING)),
        false(),
    ).where(ri.c.run_id == from_run, ri.c.state.in_(RETRIED), ri.c.input_tokens <= fits)
    conn.execute(
        insert(ri).from_select(
            ["run_id", "row_id", "version", "input_tokens", "state", "written"], source
        )
    )
    rows, tokens = conn.execute(
        select(func.count(), func.sum(ri.c.input_tokens)).where(ri.c.run_id == to_run)
    ).one()
    by_state: dict[str, int] = {
        str(state): int(n)
        for state, n in conn.execute(
            select(ri.c.state, func.count()).where(ri.c.run_id == from_run).group_by(ri.c.state)
        )
    }
    retriable = sum(by_state.get(state, 0) for state in RETRIED)
    uncertain = (
        conn.execute(
            select(ri.c.row_id)
            .where(ri.c.run_id == from_run, ri.c.state == ItemState.UNCERTAIN)
            .order_by(ri.c.row_id)
            .limit(name_at_most)
        )
        .scalars()
        .all()
    )
    return RetryCopy(
        rows=int(rows),
        input_tokens=int(tokens or 0),
        succeeded=by_state.get(ItemState.SUCCEEDED, 0),
        too_long=retriable - int(rows),
        uncertain=by_state.get(ItemState.UNCERTAIN, 0),
        uncertain_row_ids=[int(r) for r in uncertain],
    )


def clear_items(conn: Connection, run_id: str) -> None:
    """Forget a half-prepared quote's rows, so a new preparation starts clean."""
    conn.execute(delete(run_items).where(run_items.c.run_id == run_id))


def add_items(
    conn: Connection, run_id: str, items: Sequence[tuple[int, int, int, str, str | None]]
) -> None:
    """Freeze rows into a run: ``(row id, version, input tokens, state, error JSON)``.

    A quote freezes a million rows this way, so the insert goes to the driver
    as plain tuples: SQLAlchemy's per-row parameter processing cost more than
    the insert itself (bench/runs.py).
    """
    if not items:
        return
    # A row frozen as failed (its prompt cannot fit) has ended already: it takes its number
    # now, in the same insert (the numbers run from ``first``, one per failed row, in order).
    failed = sum(1 for item in items if item[3] != ItemState.PENDING)
    seq = end_order.take(conn, runs, runs.c.id, run_id, failed) if failed else 0
    rows: list[tuple[str, int, int, int, str, str | None, bool, int | None]] = []
    for r, v, t, s, e in items:
        if s == ItemState.PENDING:
            rows.append((run_id, r, v, t, str(s), e, False, None))
        else:
            rows.append((run_id, r, v, t, str(s), e, False, seq))
            seq += 1
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    table = run_items.name
    conn.exec_driver_sql(
        f"INSERT INTO {table} (run_id, row_id, version, input_tokens, state, error, written, "
        f"ended_seq) VALUES ({', '.join([mark] * 8)})",
        rows,
    )


def claim_items(
    conn: Connection, run_id: str, dataset_id: str, n: int, now: datetime
) -> list[tuple[WorkItem, dict[str, Any] | None]]:
    """Mark up to ``n`` pending rows dispatched, with their frozen data; lowest IDs first."""
    if n <= 0:
        return []
    rows = conn.execute(
        select(run_items.c.row_id, run_items.c.version, run_items.c.input_tokens, dr.c.data)
        .select_from(
            run_items.outerjoin(
                dr,
                and_(
                    dr.c.dataset_id == dataset_id,
                    dr.c.row_id == run_items.c.row_id,
                    dr.c.version == run_items.c.version,
                ),
            )
        )
        .where(run_items.c.run_id == run_id, run_items.c.state == ItemState.PENDING)
        .order_by(run_items.c.row_id)
        .limit(n)
    ).all()
    if rows:
        conn.execute(
            update(run_items)
            .where(
                run_items.c.run_id == run_id,
                run_items.c.state == ItemState.PENDING,
                run_items.c.row_id.in_([r[0] for r in rows]),
            )
            .values(state=ItemState.DISPATCHED, updated_at=now, sent_at=None)
        )
    return [
        (
            WorkItem(r[0], r[1], r[2]),
            json.loads(open_text(conn, r[3], row_aad(dataset_id, r[0], r[1])))
            if r[3] is not None
            else None,
        )
        for r in rows
    ]


def _outputs_aad(run_id: str, row_id: int) -> str:
    return f"run-outputs:{run_id}:{row_id}"


def record_results(
    conn: Connection, run_id: str, results: Sequence[ItemResult], now: datetime
) -> None:
    """Write finished rows and their usage, and add them to the run's counters.

    Only rows still ``dispatched`` are written, so a row is recorded (and its
    usage counted) once, even if a result arrives after a takeover.
    """
    if not results:
        return
    first = end_order.take(conn, runs, runs.c.id, run_id, len(results))
    params = [
        {
            "seq": first + i,
            "rid": r.row_id,
            "st": r.state,
            # A model's answers wait here until they are written: sealed, like the rows.
            "out": seal_text(
                conn, json.dumps(r.outputs, ensure_ascii=False), _outputs_aad(run_id, r.row_id)
            )
            if r.outputs is not None
            else None,
            "ui": r.usage_input,
            "uo": r.usage_output,
            "uc": r.usage_cached,
            "ch": r.charge,
            "err": json.dumps(r.error) if r.error else None,
            "now": now,
        }
        for i, r in enumerate(results)
    ]
    conn.execute(
        update(run_items)
        .where(
            and_(
                run_items.c.run_id == run_id,
                run_items.c.row_id == bindparam("rid"),
                run_items.c.state == ItemState.DISPATCHED,
            )
        )
        .values(
            state=bindparam("st"),
            outputs=bindparam("out"),
            usage_input=bindparam("ui"),
            usage_output=bindparam("uo"),
            usage_cached=bindparam("uc"),
            charge=bindparam("ch"),
            error=bindparam("err"),
            updated_at=bindparam("now"),
            ended_seq=bindparam("seq"),
        ),
        params,
    )
    ok = [r for r in results if r.state == ItemState.SUCCEEDED]
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id)
        .values(
            rows_done=runs.c.rows_done + len(ok),
            rows_failed=runs.c.rows_failed + (len(results) - len(ok)),
            input_tokens=runs.c.input_tokens + sum(r.usage_input for r in ok),
            output_tokens=runs.c.output_tokens + sum(r.usage_output for r in ok),
            cached_input_tokens=runs.c.cached_input_tokens + sum(r.usage_cached for r in ok),
            charge_accum=runs.c.charge_accum + sum(r.charge for r in ok),
            updated_at=now,
        )
    )


def _set_state(
    conn: Connection, run_id: str, old: str, new: str, now: datetime, error: str | None = None
) -> list[int]:
    ids = [
        r[0]
        for r in conn.execute(
            select(run_items.c.row_id).where(run_items.c.run_id == run_id, run_items.c.state == old)
        )
    ]
    if ids:
        conn.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.state == old)
            .values(
                state=new, updated_at=now, error=error, ended_seq=_end_numbers(conn, run_id, ids)
            )
        )
    return ids


def _end_numbers(conn: Connection, run_id: str, ids: Sequence[int]) -> Any:
    """The end numbers of rows ``ids`` that end in this statement (``store.end_order``).

    One range is taken, from the lowest ID to the highest, and each row gets
    its place in it, so a million rows canceled at once end in one ``UPDATE``
    rather than a statement per row; the IDs left out of the range are gaps,
    which a follower's cursor does not mind.
    """
    low = min(ids)
    first = end_order.take(conn, runs, runs.c.id, run_id, max(ids) - low + 1)
    return run_items.c.row_id + (first - low)


def mark_sent(
    conn: Connection, run_id: str, row_ids: Sequence[int], lease: Lease, now: datetime
) -> set[int]:
    """Record that these rows' calls are about to start; the rows that are still ours.

    A row has no lease of its own: it is the run holder's, so the fence is the run's lease.
    """
    ours = select(runs.c.id).where(runs.c.id == run_id, leases.held_by(runs, lease))
    return leases.mark_sent(
        conn,
        run_items,
        run_items.c.row_id,
        row_ids,
        now,
        where=[
            run_items.c.run_id == run_id,
            run_items.c.state == ItemState.DISPATCHED,
            run_items.c.run_id.in_(ours),
        ],
    )


def requeue_unsent(conn: Connection, run_id: str, row_ids: Sequence[int], now: datetime) -> int:
    """Claimed rows whose call never left wait again (``pending``); how many.

    The worker hands back only rows it knows were not sent: never marked, or
    marked and refused at the connection, so a sent mark is taken back.
    """
    if not row_ids:
        return 0
    done = conn.execute(
        update(run_items)
        .where(
            run_items.c.run_id == run_id,
            run_items.c.row_id.in_(list(row_ids)),
            run_items.c.state == ItemState.DISPATCHED,
        )
        .values(state=ItemState.PENDING, updated_at=now, sent_at=None)
    ).rowcount
    return int(done or 0)


def recover_dispatched(conn: Connection, run_id: str, now: datetime) -> tuple[list[int], int]:
    """Dispatched rows of a worker that stopped: (sent ones made uncertain, unsent ones re-queued).

    A sent row may have been answered upstream, so it is never sent again; a
    row that never reached the engine simply waits for the next worker.
    """
    returned = conn.execute(
        update(run_items)
        .where(
            run_items.c.run_id == run_id,
            run_items.c.state == ItemState.DISPATCHED,
            run_items.c.sent_at.is_(None),
        )
        .values(state=ItemState.PENDING, updated_at=now)
    ).rowcount
    return mark_uncertain(conn, run_id, now), int(returned or 0)


def mark_uncertain(conn: Connection, run_id: str, now: datetime) -> list[int]:
    """Rows whose call was sent when their worker stopped: never sent again."""
    ids = [
        r[0]
        for r in conn.execute(
            select(run_items.c.row_id).where(
                run_items.c.run_id == run_id,
                run_items.c.state == ItemState.DISPATCHED,
                run_items.c.sent_at.is_not(None),
            )
        )
    ]
    if ids:
        conn.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.row_id.in_(ids))
            .values(
                state=ItemState.UNCERTAIN,
                updated_at=now,
                error=UNCERTAIN_ERROR,
                ended_seq=_end_numbers(conn, run_id, ids),
            )
        )
    return ids


def cancel_pending(conn: Connection, run_id: str, now: datetime) -> list[int]:
    return _set_state(conn, run_id, ItemState.PENDING, ItemState.CANCELED, now)


def recount(conn: Connection, run_id: str, now: datetime) -> None:
    """Re-derive the run's counters from its rows (after a takeover or a stop)."""
    counts: dict[str, int] = {}
    tokens_in = tokens_out = tokens_cached = charge = 0
    for state, n, ui, uo, uc, ch in conn.execute(
        select(
            run_items.c.state,
            func.count(),
            func.sum(run_items.c.usage_input),
            func.sum(run_items.c.usage_output),
            func.sum(run_items.c.usage_cached),
            func.sum(run_items.c.charge),
        )
        .where(run_items.c.run_id == run_id)
        .group_by(run_items.c.state)
    ):
        counts[state] = int(n)
        if state == ItemState.SUCCEEDED:
            tokens_in, tokens_out, charge = int(ui or 0), int(uo or 0), int(ch or 0)
            tokens_cached = int(uc or 0)
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id)
        .values(
            rows_total=sum(counts.values()),
            rows_done=counts.get(ItemState.SUCCEEDED, 0),
            rows_failed=counts.get(ItemState.FAILED, 0) + counts.get(ItemState.UNCERTAIN, 0),
            rows_uncertain=counts.get(ItemState.UNCERTAIN, 0),
            rows_canceled=counts.get(ItemState.CANCELED, 0),
            input_tokens=tokens_in,
            output_tokens=tokens_out,
            cached_input_tokens=tokens_cached,
            charge_accum=charge,
            updated_at=now,
        )
    )


def succeeded_unwritten(
    conn: Connection, run_id: str, limit: int
) -> list[tuple[int, int, list[str]]]:
    """Answered rows whose completions are not written yet: ``(row, version, outputs)``."""
    rows = conn.execute(
        select(run_items.c.row_id, run_items.c.version, run_items.c.outputs)
        .where(
            run_items.c.run_id == run_id,
            run_items.c.state == ItemState.SUCCEEDED,
            run_items.c.written.is_(False),
        )
        .order_by(run_items.c.row_id)
        .limit(limit)
    ).all()
    return [
        (r[0], r[1], json.loads(open_text(conn, r[2], _outputs_aad(run_id, r[0]))) if r[2] else [])
        for r in rows
    ]


def mark_written(conn: Connection, run_id: str, row_ids: Sequence[int], now: datetime) -> None:
    if row_ids:
        conn.execute(
            update(run_items)
            .where(run_items.c.run_id == run_id, run_items.c.row_id.in_(list(row_ids)))
            .values(written=True, outputs=None)  # in the dataset now; no second copy
        )
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(outputs_written=runs.c.outputs_written + len(row_ids), updated_at=now)
        )


def list_failures(
    conn: Connection, run_id: str, *, after: int | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """Rows that failed or are uncertain, by row ID."""
    q = select(
        run_items.c.row_id,
        run_items.c.version,
        run_items.c.state,
        run_items.c.error,
        run_items.c.updated_at,
    ).where(
        run_items.c.run_id == run_id,
        run_items.c.state.in_([ItemState.FAILED, ItemState.UNCERTAIN]),
    )
    if after is not None:
        q = q.where(run_items.c.row_id > after)
    return [
        {
            "rowId": r.row_id,
            "version": r.version,
            "state": r.state,
            "error": json.loads(r.error) if r.error else None,
            "updatedAt": r.updated_at,
        }
        for r in conn.execute(q.order_by(run_items.c.row_id).limit(limit))
    ]


def ended_rows(
    conn: Connection, run_id: str, *, after: int, limit: int
) -> list[tuple[int, dict[str, Any]]]:
    """``(end number, row)`` of rows that ended after ``after``, in end order.

    Each row as ``list_failures`` shows a failed one, with its ``outputs``
    while they wait in the run (opened); once written into the dataset they
    are cleared here (``mark_written``) and ``written`` says where to read them.
    """
    rows = conn.execute(
        select(
            run_items.c.ended_seq,
            run_items.c.row_id,
            run_items.c.version,
            run_items.c.state,
            run_items.c.outputs,
            run_items.c.written,
            run_items.c.error,
            run_items.c.updated_at,
        )
        .where(run_items.c.run_id == run_id, run_items.c.ended_seq > after)
        .order_by(run_items.c.ended_seq)
        .limit(limit)
    ).all()
    return [
        (
            int(r.ended_seq),
            {
                "rowId": r.row_id,
                "version": r.version,
                "state": r.state,
                "outputs": json.loads(open_text(conn, r.outputs, _outputs_aad(run_id, r.row_id)))
                if r.outputs
                else None,
                "written": bool(r.written),
                "error": json.loads(r.error) if r.error else None,
                "updatedAt": r.updated_at,
            },
        )
        for r in rows
    ]
