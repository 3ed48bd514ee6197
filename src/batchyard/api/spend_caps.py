"""``PUT /v1/keys/{key_id}/spend-cap`` and ``PUT /v1/projects/{project_id}/spend-cap``.

A full key caps what one of its organisation's keys, or one of its projects,
may spend in total and in a calendar month (UTC); ``service.spend_caps``
checks the body and ``store.spend_caps`` enforces the caps at every hold.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.context import ServiceDep, authenticate, idempotent, read_json
from batchyard.api.inputs import object_id
from batchyard.service import spend_caps

__all__ = ["router"]

router = APIRouter()


@router.put("/v1/keys/{key_id}/spend-cap")
async def set_key_cap(request: Request, key_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    object_id(key_id, "key", param="key_id", what="key")
    body = await read_json(request)
    caps = spend_caps.parse_caps(body)

    async def handler() -> tuple[int, Any]:
        return 200, await spend_caps.set_key_cap(svc, principal, key_id, caps)

    return await idempotent(request, principal, body, handler)


@router.put("/v1/projects/{project_id}/spend-cap")
async def set_project_cap(request: Request, project_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    object_id(project_id, "pp", param="projectId", what="project")
    body = await read_json(request)
    caps = spend_caps.parse_caps(body)

    async def handler() -> tuple[int, Any]:
        return 200, await spend_caps.set_project_cap(svc, principal, project_id, caps)

    return await idempotent(request, principal, body, handler)
