"""``POST /v1/decide``, its estimate, and keep-warm: the door to ``service.decisions``.

A bad body is a 400 before its idempotency key is claimed, so the key stays
free for the fixed body. What the door adds is admission: the tier's limits
are checked when the service says how many tokens the call reads.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.api.bodies import DecideBody, KeepWarmBody
from batchyard.api.context import Caller, ServiceDep, check_tier_limits, once, read_json
from batchyard.api.openapi import MODEL_CALL, Decision, Estimate, KeptWarm, declare
from batchyard.core.accounts import Principal
from batchyard.core.inputs import strict
from batchyard.service import Service, decisions

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/decide", summary="Every question about one text")
@declare(Decision, body=DecideBody, errors=MODEL_CALL)
async def decide(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    return await _answered(request, principal, svc, "decide")


@router.post("/v1/decide/estimate", summary="Price a decide call without running it")
@declare(Estimate, body=DecideBody, errors=(429,))
async def estimate(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    return await _answered(request, principal, svc, "estimate")


async def _answered(
    request: Request, principal: Principal, svc: Service, kind: Literal["decide", "estimate"]
) -> Response:
    """Decide or its estimate: the same body, checked and planned, then run once per key."""
    raw = await read_json(request)
    strict(DecideBody, raw)
    call = await decisions.prepare(svc, principal.org_id, raw)

    async def admit(tokens: int) -> None:
        await check_tier_limits(request, principal, tokens=tokens, kind=kind)

    async def answer() -> object:
        if kind == "decide":
            return await decisions.decide(svc, principal, call, admit)
        return await decisions.estimate(svc, principal.org_id, call, admit)

    return await once(request, principal, raw, answer)


@router.post("/v1/models/{model_id}/keep-warm", summary="Keep a fine-tuned version loaded")
@declare(KeptWarm, body=KeepWarmBody)
async def keep_warm(
    request: Request, principal: Caller, model_id: str, svc: ServiceDep
) -> Response:
    raw = await read_json(request)
    minutes = strict(KeepWarmBody, raw).minutes
    target = await decisions.prepare_keep_warm(svc, principal.org_id, model_id, minutes)

    async def answer() -> object:
        return decisions.keep_warm(svc, target)

    return await once(request, principal, raw, answer)
