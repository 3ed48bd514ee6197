"""``/v1/account``, ``/v1/activity`` and the spend caps: credit, tier, limits, what was charged.

A full key caps what one of its organisation's keys, or one of its projects, may
spend in total and in a calendar month (UTC); ``service.spend_caps`` checks the
body and ``store.spend_caps`` enforces the caps at every hold.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Connection

from batchyard.api.context import (
    Caller,
    ServiceDep,
    once,
    path_id,
    query_id_cursor,
    query_limit,
    read_json,
)
from batchyard.api.openapi import Account, ListOf, SpendCapBody, declare
from batchyard.api.projects import ProjectId
from batchyard.core.accounts import Organisation, Principal
from batchyard.core.clock import isoformat
from batchyard.core.money import format_money
from batchyard.service import Service, spend_caps
from batchyard.store import accounts, activity, ledger

__all__ = ["router"]

router = APIRouter()
#: ``spend_caps.set_key_cap`` or ``set_project_cap``: the caps of one key or project.
_Cap = Callable[[Service, Principal, str, Any], Awaitable[Any]]
KeyId = Annotated[str, path_id("key_id", "key", "key")]


@router.get("/v1/account", summary="Your account")
@declare(Account)
async def get_account(principal: Caller, svc: ServiceDep) -> JSONResponse:
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


@router.put("/v1/keys/{key_id}/spend-cap", summary="Cap what a key may spend")
@declare(body=SpendCapBody)
async def set_key_cap(
    request: Request, principal: Caller, key_id: KeyId, svc: ServiceDep
) -> Response:
    return await _capped(request, principal, svc, key_id, spend_caps.set_key_cap)


@router.put("/v1/projects/{project_id}/spend-cap", summary="Cap what a project's runs may spend")
@declare(body=SpendCapBody)
async def set_project_cap(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> Response:
    return await _capped(request, principal, svc, project_id, spend_caps.set_project_cap)


async def _capped(
    request: Request, principal: Principal, svc: Service, of: str, cap: _Cap
) -> Response:
    body = await read_json(request)
    caps = spend_caps.parse_caps(body)
    return await once(request, principal, body, lambda: cap(svc, principal, of, caps))
