"""``GET /v1/account`` and ``GET /v1/activity``: credit, tier, limits, and what was charged."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Connection

from batchyard.api.context import Caller, ServiceDep, query_id_cursor, query_limit
from batchyard.api.openapi import Account, ListOf, declare
from batchyard.core.accounts import Organisation
from batchyard.core.clock import isoformat
from batchyard.core.money import format_money
from batchyard.service.spend_caps import cap_views
from batchyard.store import accounts, activity, ledger

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/account", summary="Your account")
@declare(Account)
async def get_account(principal: Caller, svc: ServiceDep) -> JSONResponse:
    now = svc.clock.now()

    def load(conn: Connection) -> tuple[Organisation, ledger.Balance, list[dict[str, object]]]:
        org = accounts.get_org(conn, principal.org_id)
        return org, ledger.balance(conn, principal.org_id), cap_views(conn, principal, now)

    org, bal, caps = await svc.db.read(load)
    tier = svc.tier(org.tier)
    auto = None
    if org.auto_topup_amount is not None and org.auto_topup_threshold is not None:
        auto = {
            "threshold": format_money(org.auto_topup_threshold),
            "amount": format_money(org.auto_topup_amount),
        }
    return JSONResponse(
        {
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
    )


@router.get("/v1/activity", summary="Credit activity")
@declare(ListOf)
async def get_activity(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    limit = query_limit(request, default=100, most=1000)
    after = query_id_cursor(request, "act", name="after")
    rows = await svc.db.read(
        lambda c: activity.list_activity(c, principal.org_id, after=after, limit=limit)
    )
    data = [
        {
            **r,
            "amount": format_money(r["amount"]) if r["amount"] is not None else None,
            "created_at": isoformat(r["created_at"]),
        }
        for r in rows
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "next_cursor": data[-1]["id"] if len(data) == limit else None,
        }
    )
