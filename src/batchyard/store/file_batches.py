"""File batches (OpenAI's dialect of ``/v1/batches``): the batch rows and their request lines.

A file batch is a run whose rows are the request lines of an uploaded file:
its whole quote is held in one reservation when it is created, its lines are
claimed by workers under leases (each line its own, ``store.leases``),
each answered line is charged to
its real usage once, and the reservation is settled with the sum when the
batch finalizes. Line states::

    pending → dispatched → succeeded | failed
    dispatched, its worker's lease lapsed → uncertain (never sent again)
    pending → expired (the window closed) | canceled (the batch was cancelled)

Every line that ends keeps its line of the output or error file, already
rendered and sealed (``out``) with its size, so finalizing is two sums and
downloading is reading the lines in order: nothing is recomputed, and the
file's ``bytes`` is exact.

Deferred batches have their own tables (``store.deferred_batch_tables``);
both kinds share the ``bat.`` prefix and one listing at ``/v1/batches``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    and_,
    bindparam,
    func,
    insert,
    literal,
    select,
    update,
)

from batchyard.core.leases import Lease
from batchyard.store import end_order, leases
from batchyard.store.files import LineRow as file_lines_row
from batchyard.store.files import file_lines
from batchyard.store.tables import UtcDateTime, metadata

__all__ = [
    "LINE_STATES",
    "LIVE",
    "RUN_TIME",
    "BatchRow",
    "Claimed",
    "LineEnd",
    "Totals",
    "claim_lines",
    "create_batch",
    "end_lines",
    "ended_lines",
    "file_batch_lines",
    "file_batches",
    "get_batch",
    "has_unsent_lapsed",
    "lapsed_lines",
    "lines_in_states",
    "link_retry",
    "list_batches",
    "live_batch_reads",
    "live_batches",
    "load_batch",
    "mark_sent",
    "models_of",
    "out_aad",
    "output_lines",
    "page_lines",
    "pending_lines",
    "record_results",
    "renew",
    "requeue_unsent",
    "set_status",
    "totals",
    "waits_until",
]

LINE_STATES = ("pending", "dispatched", "succeeded", "failed", "expired", "canceled", "uncertain")
#: Batch statuses in which lines may still be dispatched or finish.
LIVE = ("validating", "in_progress", "finalizing", "canceling")

file_batches = Table(
    "file_batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("org_id", String(64), ForeignKey("organisations.id"), nullable=False),
    # The creating key: revoking it stops the lines not yet dispatched.
    Column("key_id", String(64), nullable=False),
    # validating | failed | in_progress | finalizing | completed | expired |
    # canceling | canceled: OpenAI's states in batchyard's one spelling (the view
    # writes OpenAI's cancelling/cancelled, service.batch_views.openai_status)
    Column("status", String(16), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(8), nullable=False),
    Column("metadata", Text, nullable=True),
    # metadata.min_discount: lines wait on the price market for it.
    Column("min_discount", String(16), nullable=True),
    # OpenAI's errors.data (JSON list) when the batch failed as a whole.
    Column("errors", Text, nullable=True),
    Column("request_count", Integer, nullable=False),
    Column("max_cost", BigInteger, nullable=False),
    Column("reservation_id", String(64), nullable=True),
    Column("charge", BigInteger, nullable=True),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=False),
    Column("in_progress_at", UtcDateTime(), nullable=True),
    Column("finalizing_at", UtcDateTime(), nullable=True),
    Column("completed_at", UtcDateTime(), nullable=True),
    Column("failed_at", UtcDateTime(), nullable=True),
    Column("expired_at", UtcDateTime(), nullable=True),
    Column("cancelling_at", UtcDateTime(), nullable=True),
    Column("cancelled_at", UtcDateTime(), nullable=True),
    # How many end numbers its lines have taken (``store.end_order``): the
    # high-water mark of a cursor that follows the batch while it runs.
    Column("ended_seq", BigInteger, nullable=False, default=0, server_default="0"),
    # A retry batch (made of another's failed, expired and canceled lines) names the
    # batch it retries, and that batch names it: one retry each, so no line runs twice.
    Column("retry_of", String(64), nullable=True),
    Column("retried_by", String(64), nullable=True),
    Index("ix_file_batches_org", "org_id", "id"),
    Index("ix_file_batches_status", "status", "expires_at"),
)

file_batch_lines = Table(
    "file_batch_lines",
    metadata,
    Column("batch_id", String(64), ForeignKey("file_batches.id"), primary_key=True),
    Column("line", Integer, primary_key=True, autoincrement=False),
    Column("custom_id", Text, nullable=False),
    Column("model", String(200), nullable=False),
    Column("input_tokens", Integer, nullable=False),
    Column("max_tokens", Integer, nullable=False),
    Column("state", String(16), nullable=False),
    Column("lease_owner", String(64), nullable=True),
    Column("lease_expires_at", UtcDateTime(), nullable=True),
    # The fencing token: one more at each claim of the line (see ``claim_lines``).
    Column("lease_token", BigInteger, nullable=False, default=0, server_default="0"),
    Column("route", String(200), nullable=True),
    Column("usage_input", Integer, nullable=True),
    Column("usage_output", Integer, nullable=True),
    Column("charge", BigInteger, nullable=True),
    # What the line's usage would have cost at the model's direct price (its quote's).
    Column("direct_charge", BigInteger, nullable=True),
    # The line's rendered output- or error-file line (with its newline), sealed.
    Column("out", LargeBinary, nullable=True),
    Column("out_bytes", Integer, nullable=True),
    Column("updated_at", UtcDateTime(), nullable=True),
    # Written durably just before the line's engine call: an unsent line is never uncertain.
    Column("sent_at", UtcDateTime(), nullable=True),
    # The line's place in the order lines ended (``store.end_order``), set with ``out``.
    Column("ended_seq", BigInteger, nullable=True),
    Index("ix_fbl_state", "batch_id", "state", "line"),
    Index("ix_fbl_ended", "batch_id", "ended_seq"),
    Index("ix_fbl_lease", "state", "lease_expires_at"),
)


@dataclass(frozen=True, slots=True)
class BatchRow:
    id: str
    org_id: str
    key_id: str
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: str | None
    min_discount: str | None
    errors: str | None
    request_count: int
    max_cost: int
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    reservation_id: str | None = None
    charge: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    expired_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None
    ended_seq: int = 0
    retry_of: str | None = None
    retried_by: str | None = None


@dataclass(frozen=True, slots=True)
class Claimed:
    """A line a worker now holds: what it needs to answer it."""

    line: int
    custom_id: str
    model: str
    input_tokens: int
    max_tokens: int
    body: bytes  # sealed under (input file id, line)
    lease: Lease  # this claim of the line: the worker's name and its fencing token


@dataclass(frozen=True, slots=True)
class LineEnd:
    """A line's end: its state, usage and charge, and its rendered, sealed file line."""

    line: int
    state: str
    out: bytes
    out_bytes: int
    route: str | None = None
    usage_input: int = 0
    usage_output: int = 0
    charge: int = 0
    #: What the usage would have cost at the model's direct price (the quote's).
    direct_charge: int = 0


@dataclass(frozen=True, slots=True)
class Totals:
    """What a batch's lines came to so far."""

    per_state: dict[str, int]
    input_tokens: int
    output_tokens: int
    charge: int
    output_bytes: int
    error_bytes: int
    #: What the answered lines would have cost at their models' direct prices.
    direct_charge: int = 0


#: What a batch is left to run in once it stops waiting: OpenAI's window, which a
#: 24 h batch runs in today.
RUN_TIME = timedelta(hours=24)


def waits_until(created_at: datetime, expires_at: datetime) -> datetime | None:
    """Until when a batch's lines may wait for a price: None for a window of 24 h or less.

    A longer window waits until 24 h are left, the deferred batches' policy
    choosing when (``work.file_batches.lines.plan_by_policy``); then its lines go as a 24 h batch's
    would, so the window's end is met as a 24 h batch meets it.
    """
    if expires_at - created_at <= RUN_TIME:
        return None
    return expires_at - RUN_TIME


def out_aad(batch_id: str, line: int) -> bytes:
    """Associated data of a line's rendered output- or error-file line."""
    return f"{batch_id}:{line}:out".encode()


def _batch(row: Any) -> BatchRow:
    return BatchRow(**{f.name: row._mapping[f.name] for f in fields(BatchRow)})


def create_batch(conn: Connection, batch: BatchRow) -> None:
    """The batch and one pending line per line of its input file (one statement)."""
    conn.execute(
        insert(file_batches).values(**{f.name: getattr(batch, f.name) for f in fields(batch)})
    )
    if batch.status not in ("in_progress", "validating"):
        return
    fl = file_lines
    conn.execute(
        insert(file_batch_lines).from_select(
            ["batch_id", "line", "custom_id", "model", "input_tokens", "max_tokens", "state"],
            select(
                literal(batch.id),
                fl.c.line,
                fl.c.custom_id,
                fl.c.model,
                fl.c.input_tokens,
                fl.c.max_tokens,
                literal("pending"),
            ).where(fl.c.file_id == batch.input_file_id),
        )
    )


def get_batch(
    conn: Connection,
    org_id: str,
    batch_id: str,
    *,
    lock: bool = False,
    key_id: str | None = None,
) -> BatchRow | None:
    """The organisation's batch (``key_id``'s own, when given), or None."""
    q = select(file_batches).where(file_batches.c.id == batch_id, file_batches.c.org_id == org_id)
    if key_id is not None:
        q = q.where(file_batches.c.key_id == key_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    return _batch(row) if row is not None else None


def load_batch(conn: Connection, batch_id: str, *, lock: bool = False) -> BatchRow | None:
    q = select(file_batches).where(file_batches.c.id == batch_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    return _batch(row) if row is not None else None


def list_batches(
    conn: Connection,
    org_id: str,
    *,
    after: str | None,
    limit: int,
    key_id: str | None = None,
    before: str | None = None,
    endpoint: str | None = None,
) -> list[BatchRow]:
    """Newest first; ``after`` is the last ID of the previous page; ``key_id``: its own only.

    ``before`` pages the other way (the newest ``limit`` newer than it, still
    newest first), as Anthropic's ``before_id``; ``endpoint`` keeps one kind.
    """
    q = select(file_batches).where(file_batches.c.org_id == org_id)
    if key_id is not None:
        q = q.where(file_batches.c.key_id == key_id)
    if endpoint is not None:
        q = q.where(file_batches.c.endpoint == endpoint)
    if after:
        q = q.where(file_batches.c.id < after)
    if before:
        q = q.where(file_batches.c.id > before).order_by(file_batches.c.id.asc()).limit(limit)
        return [_batch(r) for r in reversed(conn.execute(q).all())]
    return [_batch(r) for r in conn.execute(q.order_by(file_batches.c.id.desc()).limit(limit))]


def live_batches(conn: Connection) -> list[BatchRow]:
    """Batches a worker may still have something to do for, oldest first."""
    q = select(file_batches).where(file_batches.c.status.in_(LIVE)).order_by(file_batches.c.id)
    return [_batch(r) for r in conn.execute(q)]


def live_batch_reads(conn: Connection, file_id: str) -> list[str]:
    """Live batches that read ``file_id`` (it may not be deleted under them)."""
    return list(
        conn.execute(
            select(file_batches.c.id).where(
                file_batches.c.input_file_id == file_id, file_batches.c.status.in_(LIVE)
            )
        ).scalars()
    )


def set_status(
    conn: Connection, batch_id: str, status: str, *, expect: Sequence[str], **values: Any
) -> bool:
    """Move a batch to ``status`` if it is still in one of ``expect``."""
    done = conn.execute(
        update(file_batches)
        .where(file_batches.c.id == batch_id, file_batches.c.status.in_(list(expect)))
        .values(status=status, **values)
    )
    return bool(done.rowcount)


def totals(conn: Connection, batch_ids: Iterable[str]) -> dict[str, Totals]:
    """Per batch: lines per state, usage and charge of answered lines, each file's size."""
    ids = list(batch_ids)
    if not ids:
        return {}
    acc: dict[str, dict[str, Any]] = {
        b: {
            "per": dict.fromkeys(LINE_STATES, 0),
            **dict.fromkeys(("in", "out", "ch", "ob", "eb", "dc"), 0),
        }
        for b in ids
    }
    rows = conn.execute(
        select(
            file_batch_lines.c.batch_id,
            file_batch_lines.c.state,
            func.count(),
            func.sum(file_batch_lines.c.usage_input),
            func.sum(file_batch_lines.c.usage_output),
            func.sum(file_batch_lines.c.charge),
            func.sum(file_batch_lines.c.out_bytes),
            func.sum(file_batch_lines.c.direct_charge),
        )
        .where(file_batch_lines.c.batch_id.in_(ids))
        .group_by(file_batch_lines.c.batch_id, file_batch_lines.c.state)
    ).all()
    for batch_id, state, n, ui, uo, ch, ob, dc in rows:
        a = acc[batch_id]
        a["per"][state] = int(n)
        a["in"] += int(ui or 0)
        a["out"] += int(uo or 0)
        a["ch"] += int(ch or 0)
        a["dc"] += int(dc or 0)
        if state == "succeeded":
            a["ob"] += int(ob or 0)
        else:
            a["eb"] += int(ob or 0)
    return {
        b: Totals(a["per"], a["in"], a["out"], a["ch"], a["ob"], a["eb"], a["dc"])
        for b, a in acc.items()
    }


# --- the worker's claims ----------------------------------------------------------


def claim_lines(
    conn: Connection,
    batch: BatchRow,
    owner: str,
    n: int,
    now: datetime,
    lease_until: datetime,
) -> list[Claimed]:
    """Take up to ``n`` pending lines, lowest first, each under a lease of its own.

    Each line's fencing token grows by one; the worker keeps each line's
    (``Claimed.lease``) and names it in every later write of that line.
    """
    if n <= 0:
        return []
    fbl = file_batch_lines
    taken = leases.claim(
        conn,
        fbl,
        fbl.c.line,
        owner,
        lease_until,
        where=[fbl.c.batch_id == batch.id, fbl.c.state == "pending"],
        order_by=[fbl.c.line],
        limit=n,
        values={"state": "dispatched", "updated_at": now, "sent_at": None},
    )
    if not taken:
        return []
    rows = conn.execute(
        select(
            fbl.c.line,
            fbl.c.custom_id,
            fbl.c.model,
            fbl.c.input_tokens,
            fbl.c.max_tokens,
            file_lines.c.body,
        )
        .select_from(
            fbl.join(
                file_lines,
                and_(file_lines.c.file_id == batch.input_file_id, file_lines.c.line == fbl.c.line),
            )
        )
        .where(fbl.c.batch_id == batch.id, fbl.c.line.in_(list(taken)))
        .order_by(fbl.c.line)
    ).all()
    return [Claimed(r[0], r[1], r[2], r[3], r[4], bytes(r[5]), taken[r[0]]) for r in rows]


def renew(
    conn: Connection, batch_id: str, held: Mapping[int, Lease], lease_until: datetime
) -> str | None:
    """Extend the leases of the ``held`` lines (line → lease); the batch's status (None if gone).

    A line claimed since by another worker (or again by this one) has another
    token, so its lease is not extended by a stale holder.
    """
    if held:
        leases.renew(
            conn,
            file_batch_lines,
            lease_until,
            where=[
                file_batch_lines.c.batch_id == batch_id,
                file_batch_lines.c.state == "dispatched",
                leases.held_by_each(file_batch_lines, file_batch_lines.c.line, held),
            ],
        )
    status = conn.execute(
        select(file_batches.c.status).where(file_batches.c.id == batch_id)
    ).scalar()
    return str(status) if status is not None else None


def record_results(
    conn: Connection,
    batch_id: str,
    held: Mapping[int, Lease],
    ended: Sequence[LineEnd],
    now: datetime,
) -> int:
    """Write answered lines; only lines still dispatched under their claim in ``held``.

    The fence (each line's owner and token) is what makes "charged at most
    once" hold: a worker that lost its lease (its lines went ``uncertain``, or
    were claimed again) writes nothing, and no line can be answered twice.
    """
    ended = [e for e in ended if e.line in held]
    if not ended:
        return 0
    first = end_order.take(conn, file_batches, file_batches.c.id, batch_id, len(ended))
    fbl = file_batch_lines
    result = conn.execute(
        update(fbl)
        .where(
            fbl.c.batch_id == batch_id,
            fbl.c.line == bindparam("b_line"),
            fbl.c.state == "dispatched",
            fbl.c.lease_owner == bindparam("b_owner"),
            fbl.c.lease_token == bindparam("b_token"),
        )
        .values(
            state=bindparam("b_state"),
            route=bindparam("b_route"),
            usage_input=bindparam("b_ui"),
            usage_output=bindparam("b_uo"),
            charge=bindparam("b_ch"),
            direct_charge=bindparam("b_dc"),
            out=bindparam("b_out"),
            out_bytes=bindparam("b_ob"),
            ended_seq=bindparam("b_seq"),
            updated_at=now,
            **leases.LET_GO,
        ),
        [
            {
                "b_seq": first + i,
                "b_line": e.line,
                "b_owner": held[e.line].owner,
                "b_token": held[e.line].token,
                "b_state": e.state,
                "b_route": e.route,
                "b_ui": e.usage_input,
                "b_uo": e.usage_output,
                "b_ch": e.charge,
                "b_dc": e.direct_charge,
                "b_out": e.out,
                "b_ob": e.out_bytes,
            }
            for i, e in enumerate(ended)
        ],
    )
    return int(result.rowcount or 0)


def pending_lines(conn: Connection, batch_id: str, limit: int) -> list[tuple[int, str]]:
    """``(line, custom_id)`` of lines never dispatched, lowest first."""
    fbl = file_batch_lines
    q = (
        select(fbl.c.line, fbl.c.custom_id)
        .where(fbl.c.batch_id == batch_id, fbl.c.state == "pending")
        .order_by(fbl.c.line)
        .limit(limit)
    )
    return [(r[0], r[1]) for r in conn.execute(leases.lock_skipping(conn, q))]


def lapsed_lines(
    conn: Connection,
    now: datetime,
    limit: int,
    *,
    lock: bool = True,
    batch_id: str | None = None,
    held: Mapping[int, Lease] | None = None,
) -> list[tuple[str, int, str]]:
    """``(batch, line, custom_id)`` of sent lines whose worker stopped renewing.

    With ``batch_id`` and ``held``: the sent lines of these claims instead, whose
    worker is stopping with their calls cut off. A line that was never sent is
    not here: ``requeue_unsent`` puts it back.
    """
    fbl = file_batch_lines
    q = select(fbl.c.batch_id, fbl.c.line, fbl.c.custom_id).where(
        fbl.c.state == "dispatched", fbl.c.sent_at.is_not(None)
    )
    if held is not None:
        q = q.where(fbl.c.batch_id == batch_id, leases.held_by_each(fbl, fbl.c.line, held))
    else:
        q = q.where(leases.lapsed(fbl, now))
    q = q.limit(limit)
    return [(r[0], r[1], r[2]) for r in conn.execute(leases.lock_skipping(conn, q) if lock else q)]


def end_lines(
    conn: Connection, batch_id: str, from_state: str, ended: Sequence[LineEnd], now: datetime
) -> int:
    """End lines that no call answered (expired, canceled, uncertain) with their file lines."""
    if not ended:
        return 0
    first = end_order.take(conn, file_batches, file_batches.c.id, batch_id, len(ended))
    fbl = file_batch_lines
    result = conn.execute(
        update(fbl)
        .where(
            fbl.c.batch_id == batch_id,
            fbl.c.line == bindparam("b_line"),
            fbl.c.state == from_state,
        )
        .values(
            state=bindparam("b_state"),
            out=bindparam("b_out"),
            out_bytes=bindparam("b_ob"),
            ended_seq=bindparam("b_seq"),
            updated_at=now,
            **leases.LET_GO,
        ),
        [
            {
                "b_line": e.line,
                "b_state": e.state,
                "b_out": e.out,
                "b_ob": e.out_bytes,
                "b_seq": first + i,
            }
            for i, e in enumerate(ended)
        ],
    )
    return int(result.rowcount or 0)


def output_lines(
    conn: Connection, batch_id: str, *, errors: bool | None, after: int, limit: int
) -> list[tuple[int, bytes]]:
    """``(line, sealed file line)`` of one half of the results (both: ``errors`` None), by
    input line."""
    fbl = file_batch_lines
    query = select(fbl.c.line, fbl.c.out).where(
        fbl.c.batch_id == batch_id, fbl.c.out.is_not(None), fbl.c.line > after
    )
    if errors is not None:
        query = query.where(fbl.c.state != "succeeded" if errors else fbl.c.state == "succeeded")
    rows = conn.execute(query.order_by(fbl.c.line).limit(limit)).all()
    return [(r[0], bytes(r[1])) for r in rows]


def ended_lines(
    conn: Connection, batch_id: str, *, after: int, limit: int
) -> list[tuple[int, int, bytes]]:
    """``(end number, line, sealed file line)`` of lines that ended after ``after``, in end order.

    Both halves of the results at once (answers and errors), as they ended:
    what a reader following the batch has not seen yet (``store.end_order``).
    """
    fbl = file_batch_lines
    rows = conn.execute(
        select(fbl.c.ended_seq, fbl.c.line, fbl.c.out)
        .where(fbl.c.batch_id == batch_id, fbl.c.ended_seq > after, fbl.c.out.is_not(None))
        .order_by(fbl.c.ended_seq)
        .limit(limit)
    ).all()
    return [(int(r[0]), r[1], bytes(r[2])) for r in rows]


def lines_in_states(
    conn: Connection, batch: BatchRow, states: Sequence[str]
) -> list[tuple[file_lines_row, str]]:
    """The batch's lines in ``states``, by line: each as its input file holds it, and its state."""
    fbl, fl = file_batch_lines, file_lines
    rows = conn.execute(
        select(fl, fbl.c.state)
        .join(fbl, and_(fbl.c.line == fl.c.line, fl.c.file_id == batch.input_file_id))
        .where(fbl.c.batch_id == batch.id, fbl.c.state.in_(list(states)))
        .order_by(fbl.c.line)
    ).all()
    return [
        (
            file_lines_row(
                r.line, r.custom_id, r.model, r.input_tokens, r.max_tokens, bytes(r.body)
            ),
            r.state,
        )
        for r in rows
    ]


def link_retry(conn: Connection, batch_id: str, retry_id: str) -> bool:
    """Name ``retry_id`` as the batch's retry; False when it already has one."""
    done = conn.execute(
        update(file_batches)
        .where(file_batches.c.id == batch_id, file_batches.c.retried_by.is_(None))
        .values(retried_by=retry_id)
    )
    return bool(done.rowcount)


def models_of(conn: Connection, batch_id: str) -> list[str]:
    fbl = file_batch_lines
    q = select(fbl.c.model).where(fbl.c.batch_id == batch_id).distinct()
    return list(conn.execute(q).scalars())


def has_unsent_lapsed(conn: Connection, now: datetime) -> bool:
    """Whether a lapsed dispatched line was never sent (a cheap read first)."""
    fbl = file_batch_lines
    q = select(fbl.c.line).where(
        fbl.c.state == "dispatched", leases.lapsed(fbl, now), fbl.c.sent_at.is_(None)
    )
    return conn.execute(q.limit(1)).first() is not None


def requeue_unsent(
    conn: Connection,
    now: datetime,
    *,
    batch_id: str | None = None,
    held: Mapping[int, Lease] | None = None,
    unmark: bool = False,
) -> int:
    """Dispatched lines that never reached the engine go back to ``pending``.

    Those of a worker whose lease lapsed (``now``), or, with ``batch_id`` and
    ``held`` (line → lease), those of these claims (a worker that gives them up).
    ``unmark``: the worker knows these claims' calls never left (the route refused
    the connection), so a sent mark does not keep them back; it is taken back.
    """
    fbl = file_batch_lines
    q = update(fbl).where(fbl.c.state == "dispatched")
    if not unmark:
        q = q.where(fbl.c.sent_at.is_(None))
    if held is not None:
        if not held:
            return 0
        q = q.where(fbl.c.batch_id == batch_id, leases.held_by_each(fbl, fbl.c.line, held))
    else:
        q = q.where(leases.lapsed(fbl, now))
        if batch_id is not None:
            q = q.where(fbl.c.batch_id == batch_id)
    done = conn.execute(q.values(state="pending", sent_at=None, **leases.LET_GO))
    return int(done.rowcount or 0)


def mark_sent(
    conn: Connection, batch_id: str, held: Mapping[int, Lease], now: datetime
) -> set[int]:
    """Record that these lines' calls are about to start; the lines that are still ours."""
    fbl = file_batch_lines
    return leases.mark_sent(
        conn,
        fbl,
        fbl.c.line,
        list(held),
        now,
        where=[
            fbl.c.batch_id == batch_id,
            fbl.c.state == "dispatched",
            leases.held_by_each(fbl, fbl.c.line, held),
        ],
    )


def page_lines(
    conn: Connection, batch_id: str, *, after: int, limit: int
) -> list[tuple[int, str, str, bytes | None]]:
    """``(line, custom_id, state, sealed result line)`` of one page of a batch, by line."""
    fbl = file_batch_lines
    rows = conn.execute(
        select(fbl.c.line, fbl.c.custom_id, fbl.c.state, fbl.c.out)
        .where(fbl.c.batch_id == batch_id, fbl.c.line > after)
        .order_by(fbl.c.line)
        .limit(limit)
    ).all()
    return [(r[0], r[1], r[2], bytes(r[3]) if r[3] is not None else None) for r in rows]
