"""One batch object for both dialects of ``/v1/batches``.

Every batch, deferred or from a file, shows OpenAI's Batch fields and batchyard's own
together, so the ``openai`` SDK reads every batch and a deferred-dialect client reads its
own; where the two name the same thing one field serves both, and fields a dialect lacks
are null. ``status`` is the dialect's own word: ``openai_status`` is the one place that
writes OpenAI's ``cancelling``/``cancelled``. docs/explanation/batch-dialects.md gives
the reasons.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

from batchyard.core.clock import isoformat
from batchyard.core.money import format_money
from batchyard.store import file_batches as fstore

__all__ = ["counts_of", "file_batch_view", "number", "openai_status", "ts"]

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
