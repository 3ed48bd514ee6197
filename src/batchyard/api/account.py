"""``/v1/account``, ``/v1/activity`` and the spend caps: credit, tier, limits, what was charged.

A full key caps what one of its organisation's keys, or one of its projects, may
spend in total and in a calendar month (UTC); ``service.spend_caps`` checks the
body and ``store.spend_caps`` enforces the caps at every hold.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

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
from batchyard.service import account, spend_caps

__all__ = ["router"]

router = APIRouter()
KeyId = Annotated[str, path_id("key_id", "key", "key")]


@router.get("/v1/account", summary="Your account")
@declare(Account)
async def get_account(principal: Caller, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await account.account_view(svc, principal))


@router.get("/v1/activity", summary="Credit activity")
@declare(ListOf)
async def get_activity(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    limit = query_limit(request, default=100, most=1000)
    after = query_id_cursor(request, "act", name="after")
    data = await account.activity_views(svc, principal, after=after, limit=limit)
    more = data[-1]["id"] if len(data) == limit else None
    return JSONResponse({"object": "list", "data": data, "next_cursor": more})


@router.put("/v1/keys/{key_id}/spend-cap", summary="Cap what a key may spend")
@declare(body=SpendCapBody)
async def set_key_cap(
    request: Request, principal: Caller, key_id: KeyId, svc: ServiceDep
) -> Response:
    body = await read_json(request)
    caps = spend_caps.parse_caps(body)
    set_cap = partial(spend_caps.set_key_cap, svc, principal, key_id, caps)
    return await once(request, principal, body, set_cap)


@router.put("/v1/projects/{project_id}/spend-cap", summary="Cap what a project's runs may spend")
@declare(body=SpendCapBody)
async def set_project_cap(
    request: Request, principal: Caller, project_id: ProjectId, svc: ServiceDep
) -> Response:
    body = await read_json(request)
    caps = spend_caps.parse_caps(body)
    set_cap = partial(spend_caps.set_project_cap, svc, principal, project_id, caps)
    return await once(request, principal, body, set_cap)
