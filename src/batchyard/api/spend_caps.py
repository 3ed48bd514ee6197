"""``PUT /v1/keys/{key_id}/spend-cap`` and ``PUT /v1/projects/{project_id}/spend-cap``.

A full key caps what one of its organisation's keys, or one of its projects,
may spend in total and in a calendar month (UTC); ``service.spend_caps``
checks the body and ``store.spend_caps`` enforces the caps at every hold.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.context import Caller, ServiceDep, once, path_id, read_json
from batchyard.api.openapi import SpendCapBody, declare
from batchyard.api.projects import ProjectId
from batchyard.core.accounts import Principal
from batchyard.service import Service, spend_caps

__all__ = ["router"]

router = APIRouter()
#: ``spend_caps.set_key_cap`` or ``set_project_cap``: the caps of one key or project.
_Cap = Callable[[Service, Principal, str, Any], Awaitable[Any]]
KeyId = Annotated[str, path_id("key_id", "key", "key")]


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
