"""One batch object for both dialects of ``/v1/batches``, shown by ID and listed together.

Every batch, deferred or from a file, shows OpenAI's Batch fields and batchyard's own
together, so the ``openai`` SDK reads every batch and a deferred-dialect client reads its
own; where the two name the same thing one field serves both, and fields a dialect lacks
are null. ``status`` is the dialect's own word: ``openai_status`` is the one place that
writes OpenAI's ``cancelling``/``cancelled``. docs/explanation/batch-dialects.md gives
the reasons.

Deferred and file batches live in their own tables but share the ``bat.`` prefix and its
time order (UUIDv7), so one cursor pages through both: each table gives its next
``limit + 1`` batches below the cursor, newest first, and the merge keeps the newest
``limit``.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from batchyard.core.accounts import Principal
from batchyard.core.clock import isoformat
from batchyard.core.money import format_money
from batchyard.errors import NotFound
from batchyard.service.deployment import Service
from batchyard.store import deferred_batches as dstore
from batchyard.store import file_batches as fstore
from batchyard.work.deferred_batches.housekeeping import RESULTS_KEPT

__all__ = [
    "counts_of",
    "deferred_batch",
    "deferred_batch_view",
    "file_batch",
    "file_batch_view",
    "is_file_batch",
    "list_views",
    "load_deferred_view",
    "load_file_view",
    "load_view",
    "number",
    "openai_status",
    "ts",
]

#: OpenAI's spelling of the two cancel states (its ``Batch.status`` literals).
_OPENAI_WORDS = {"canceling": "cancelling", "canceled": "cancelled"}


def openai_status(status: str) -> str:
    """A file batch's status as OpenAI writes it: ``cancelling``/``cancelled``."""
    return _OPENAI_WORDS.get(status, status)


def ts(when: datetime | None) -> int | None:
    """Unix seconds, OpenAI's timestamps."""
    return int(when.timestamp()) if when is not None else None


def number(d: Decimal) -> int | float:
    return int(d) if d == d.to_integral_value() else float(d)


def counts_of(per_state: dict[str, int]) -> dict[str, int]:
    """Both dialects' request counts from the count of requests in each state."""
    per = dict(per_state)
    if "pending" in per:  # a file batch's not-yet-sent lines are the deferred dialect's "waiting"
        per["waiting"] = per.pop("pending")
    return {"total": sum(per.values()), "completed": per.get("succeeded", 0), **per}


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def file_batch_view(row: fstore.BatchRow, totals: fstore.Totals | None) -> dict[str, Any]:
    per = totals.per_state if totals is not None else dict.fromkeys(fstore.LINE_STATES, 0)
    counts = counts_of(per)
    counts["total"] = row.request_count
    errors = json.loads(row.errors) if row.errors else None
    charge = row.charge if row.charge is not None else (totals.charge if totals else 0)
    direct = totals.direct_charge if totals else 0
    return {
        "id": row.id,
        "object": "batch",
        "dialect": "file",
        "endpoint": row.endpoint,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": openai_status(row.status),
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "errors": {"object": "list", "data": errors} if errors else None,
        "created_at": ts(row.created_at),
        "in_progress_at": ts(row.in_progress_at),
        "expires_at": ts(row.expires_at),
        "finalizing_at": ts(row.finalizing_at),
        "completed_at": ts(row.completed_at),
        "failed_at": ts(row.failed_at),
        "expired_at": ts(row.expired_at),
        "cancelling_at": ts(row.cancelling_at),
        "cancelled_at": ts(row.cancelled_at),
        "request_counts": counts,
        "metadata": json.loads(row.metadata) if row.metadata else None,
        "usage": _usage(totals.input_tokens, totals.output_tokens) if totals else None,
        # The deferred dialect's fields.
        "deadline": isoformat(row.expires_at),
        "min_discount": number(Decimal(row.min_discount)) if row.min_discount else None,
        "results_url": None,
        "results_expire_at": None,
        "results_purged": False,
        # batchyard's: the quote held, and what was charged so far.
        "max_cost": format_money(row.max_cost),
        "charge": format_money(charge),
        # batchyard's: what the answered lines would have cost at the direct price their
        # quote held at, and what paying the market's price instead saved so far (lines
        # answered before batchyard recorded it count as saving nothing).
        "direct_charge": format_money(direct),
        "saved": format_money(max(0, direct - (totals.charge if totals else 0))),
        "reservation_id": row.reservation_id,
        # batchyard's: the batch this one retries, and the batch that retried it.
        "retry_of": row.retry_of,
        "retried_by": row.retried_by,
    }


def deferred_batch_view(
    batch: dstore.DeferredBatchRow, per: dict[str, int], items: list[dstore.ItemRow] | None
) -> dict[str, Any]:
    """A deferred batch as the same object, with its requests' states where ``items`` are given."""
    ended = batch.completed_at
    view: dict[str, Any] = {
        "id": batch.id,
        "object": "batch",
        "dialect": "deferred",
        "endpoint": "/v1/chat/completions",
        # Its requests came inline; OpenAI's type needs a string here.
        "input_file_id": "",
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": None,
        "error_file_id": None,
        "errors": None,
        "created_at": ts(batch.created_at),
        "in_progress_at": ts(batch.created_at),
        "expires_at": ts(batch.deadline),
        "finalizing_at": None,
        "completed_at": ts(ended),
        "failed_at": None,
        "expired_at": ts(ended) if batch.status == "expired" else None,
        "cancelling_at": ts(batch.cancel_requested_at),
        "cancelled_at": ts(ended) if batch.status == "canceled" else None,
        "request_counts": {**counts_of(per), "total": batch.request_count},
        "metadata": None,
        "deadline": isoformat(batch.deadline),
        "min_discount": number(batch.min_discount),
        "results_url": f"/v1/batches/{batch.id}/results",
        "results_expire_at": isoformat(ended + RESULTS_KEPT) if ended else None,
        "results_purged": batch.purged_at is not None,
    }
    if items is not None:
        view["requests"] = [
            {"custom_id": it.custom_id, "status": it.status}
            | ({"reason": it.reason} if it.reason else {})
            for it in items
        ]
    return view


def _missing(batch_id: str) -> NotFound:
    return NotFound(f"batch {batch_id} not found", param="batch_id")


def file_batch(
    conn: Connection, org_id: str, batch_id: str, key_id: str | None, lock: bool = False
) -> fstore.BatchRow:
    """The organisation's (or the key's own) file batch; 404 otherwise."""
    row = fstore.get_batch(conn, org_id, batch_id, key_id=key_id, lock=lock)
    if row is None:
        raise _missing(batch_id)
    return row


def deferred_batch(
    conn: Connection, principal: Principal, batch_id: str
) -> dstore.DeferredBatchRow:
    """The caller's deferred batch; 404 for another organisation's (or key's)."""
    batch = dstore.get_batch(conn, principal.org_id, batch_id, key_id=principal.own_key)
    if batch is None:
        raise _missing(batch_id)
    return batch


def load_file_view(
    conn: Connection, org_id: str, batch_id: str, *, key_id: str | None = None
) -> dict[str, Any]:
    row = file_batch(conn, org_id, batch_id, key_id)
    return file_batch_view(row, fstore.totals(conn, [row.id])[row.id])


def load_deferred_view(conn: Connection, principal: Principal, batch_id: str) -> dict[str, Any]:
    batch = deferred_batch(conn, principal, batch_id)
    per = dstore.counts(conn, [batch.id])[batch.id]
    return deferred_batch_view(batch, per, dstore.items_of(conn, batch.id))


def load_view(conn: Connection, principal: Principal, batch_id: str) -> dict[str, Any]:
    """The caller's batch of either dialect; another organisation's (or key's) is 404."""
    org, own = principal.org_id, principal.own_key
    if fstore.get_batch(conn, org, batch_id, key_id=own) is not None:
        return load_file_view(conn, org, batch_id, key_id=own)
    return load_deferred_view(conn, principal, batch_id)


async def is_file_batch(svc: Service, principal: Principal, batch_id: str) -> bool:
    org, own = principal.org_id, principal.own_key
    found = await svc.db.read(lambda c: fstore.get_batch(c, org, batch_id, key_id=own))
    return found is not None


async def list_views(
    svc: Service, principal: Principal, *, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """One page of the caller's batches of both dialects, newest first; and whether more follow."""

    def load(conn: Connection) -> list[tuple[str, dict[str, Any]]]:
        org, own = principal.org_id, principal.own_key
        seed_rows = dstore.list_batches(conn, org, after=after, limit=limit + 1, key_id=own)
        seed_counts = dstore.counts(conn, [b.id for b in seed_rows])
        file_rows = fstore.list_batches(conn, org, after=after, limit=limit + 1, key_id=own)
        file_totals = fstore.totals(conn, [b.id for b in file_rows])
        views = [(b.id, deferred_batch_view(b, seed_counts[b.id], None)) for b in seed_rows]
        views += [(b.id, file_batch_view(b, file_totals[b.id])) for b in file_rows]
        return sorted(views, key=lambda v: v[0], reverse=True)

    merged = await svc.db.read(load)
    return [v for _, v in merged[:limit]], len(merged) > limit
