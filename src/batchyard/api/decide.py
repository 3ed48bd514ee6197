"""``POST /v1/decide``, its estimate, and keep-warm: the door to ``service.decisions``.

Each handler authenticates, reads the body strictly, has the service check
and plan it (a bad body is a 400 before its idempotency key is claimed, so
the key stays free for the fixed body), and runs the call once per key. What
the door adds is admission: the tier's limits, which hold a slot of the
request's envelope, are checked when the service says how many tokens the
call reads.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.bodies import DecideBody, KeepWarmBody
from batchyard.api.context import ServiceDep, authenticate, check_tier_limits, idempotent, read_json
from batchyard.api.inputs import strict
from batchyard.service import decisions

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/decide")
async def decide(request: Request, svc: ServiceDep) -> Response:
    return await _answered(request, svc, "decide")


@router.post("/v1/decide/estimate")
async def estimate(request: Request, svc: ServiceDep) -> Response:
    return await _answered(request, svc, "estimate")


async def _answered(
    request: Request, svc: ServiceDep, kind: Literal["decide", "estimate"]
) -> Response:
    """Decide or its estimate: the same body, checked and planned, then run once per key."""
    principal = await authenticate(request)
    raw = await read_json(request)
    strict(DecideBody, raw)
    call = await decisions.prepare(svc, principal.org_id, raw)

    async def admit(tokens: int) -> None:
        await check_tier_limits(request, principal, requests=1, tokens=tokens, kind=kind)

    async def handler() -> tuple[int, Any]:
        if kind == "decide":
            return 200, await decisions.decide(svc, principal, call, admit)
        return 200, await decisions.estimate(svc, principal.org_id, call, admit)

    return await idempotent(request, principal, raw, handler)


@router.post("/v1/models/{model_id}/keep-warm")
async def keep_warm(request: Request, model_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    raw = await read_json(request)
    minutes = strict(KeepWarmBody, raw).minutes
    target = await decisions.prepare_keep_warm(svc, principal.org_id, model_id, minutes)

    async def handler() -> tuple[int, Any]:
        return 200, decisions.keep_warm(svc, target)

    return await idempotent(request, principal, raw, handler)
