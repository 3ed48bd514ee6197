"""Funding a confirmed run: its whole quote reserved, or the run blocked.

Confirming (the API), an operator's approval (the CLI) and a worker retrying
runs blocked on funds all end here, so the rule lives once: above the
billing-review threshold a run waits for an operator; otherwise its quote is
reserved in the same transaction that queues it, so the store never shows a
queued run without its money.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Connection

from batchyard.core.money import from_ticks
from batchyard.core.runs import BlockedReason, RunStatus
from batchyard.core.tiers import Tier
from batchyard.errors import InsufficientCredit, InvalidState, SpendCapExceeded
from batchyard.store import billing
from batchyard.store.runs import Run, load_run, update_run

__all__ = ["approve", "fund"]

S = RunStatus


def fund(
    conn: Connection,
    run: Run,
    now: datetime,
    *,
    threshold: Decimal | None,
    tiers: Sequence[Tier] | None = None,
) -> str:
    """Reserve a confirmed run's quote, or block it; returns the new status.

    One transaction moves the run and writes its reservation, so the store
    never shows a queued run without its money.
    """
    cost = run.quote_max_cost or 0
    if threshold is not None and from_ticks(cost) > threshold and not run.approved:
        update_run(conn, run.id, now, status=S.BLOCKED, blocked_reason=BlockedReason.BILLING_REVIEW)
        return S.BLOCKED
    try:
        res = billing.reserve(
            conn,
            run.org_id,
            cost,
            now,
            purpose="run",
            ref=run.id,
            tiers=tiers,
            key_id=run.key_id,
            project_id=run.project_id,
        )
    except InsufficientCredit as exc:
        why = BlockedReason.SPEND_CAP if isinstance(exc, SpendCapExceeded) else BlockedReason.FUNDS
        if run.status != S.BLOCKED or run.blocked_reason != why:
            update_run(conn, run.id, now, status=S.BLOCKED, blocked_reason=why)
        return S.BLOCKED
    update_run(conn, run.id, now, status=S.QUEUED, blocked_reason=None, reservation_id=res.id)
    return S.QUEUED


def approve(
    conn: Connection, run_id: str, now: datetime, *, tiers: Sequence[Tier] | None = None
) -> str:
    """An operator's approval of a run held for billing review; then it is funded."""
    run = load_run(conn, run_id, lock=True)
    if run.status != S.BLOCKED or run.blocked_reason != BlockedReason.BILLING_REVIEW:
        raise InvalidState(f"run {run_id} is {run.status}, not held for billing review")
    update_run(conn, run_id, now, approved=True)
    run = load_run(conn, run_id)
    return fund(conn, run, now, threshold=None, tiers=tiers)
