"""What ``/v1/account`` and ``/v1/activity`` show: credit, tier, limits, caps, what was charged."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection

from batchyard.core.accounts import Organisation, Principal
from batchyard.core.clock import isoformat
from batchyard.core.money import format_money
from batchyard.service import spend_caps
from batchyard.service.deployment import Service
from batchyard.store import accounts, activity, ledger

__all__ = ["account_view", "activity_views"]


async def account_view(svc: Service, principal: Principal) -> dict[str, Any]:
    now = svc.clock.now()

    def load(conn: Connection) -> tuple[Organisation, ledger.Balance, list[dict[str, object]]]:
        org = accounts.get_org(conn, principal.org_id)
        return (
            org,
            ledger.balance(conn, principal.org_id),
            spend_caps.cap_views(conn, principal, now),
        )

    org, bal, caps = await svc.db.read(load)
    tier = svc.tier(org.tier)
    auto = None
    if org.auto_topup_amount is not None and org.auto_topup_threshold is not None:
        auto = {
            "threshold": format_money(org.auto_topup_threshold),
            "amount": format_money(org.auto_topup_amount),
        }
    return {
        "organization": {"id": principal.org_id, "name": principal.org_name},
        "tier": tier.level,
        "credit": {
            "balance": format_money(bal.topups - bal.settled),
            "held": format_money(bal.held),
            "available": format_money(max(bal.available, 0)),
        },
        "effective_limits": tier.effective_limits(),
        "zero_data_retention": principal.zero_data_retention,
        "auto_top_up": auto,
        # Each capped key and project: its caps, and what it has charged and holds.
        "spend_caps": caps,
    }


async def activity_views(
    svc: Service, principal: Principal, *, after: str | None, limit: int
) -> list[dict[str, Any]]:
    """Up to ``limit`` credit events after the cursor, oldest first."""
    rows = await svc.db.read(
        lambda c: activity.list_activity(c, principal.org_id, after=after, limit=limit)
    )
    return [
        {
            **r,
            "amount": format_money(r["amount"]) if r["amount"] is not None else None,
            "created_at": isoformat(r["created_at"]),
        }
        for r in rows
    ]
