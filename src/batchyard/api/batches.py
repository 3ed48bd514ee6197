"""``/v1/batches``: deferred batches that wait for a discount (seed 003).

A submission is checked whole first (``service.batch_requests``), then the
bodies are sealed and the batch and all its items are written in one
transaction, so a submission that fails anywhere queues nothing. Execution
is the market worker's (``work.batches``); these handlers only authenticate
and hand over to ``service.batches``, which the workspace (``web``) calls
too.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import authenticate, idempotent, json_response, read_json, service_of
from batchyard.core.accounts import Scope
from batchyard.service import batches
from batchyard.service.batch_requests import MAX_BODY_BYTES, parse_submission

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    principal = await authenticate(request, Scope.FULL, Scope.INFERENCE)
    svc = service_of(request)
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=MAX_BODY_BYTES)
    sub = parse_submission(svc, raw)

    async def handler() -> tuple[int, Any]:
        return 201, await batches.submit(svc, principal, sub)

    return await idempotent(request, principal, raw, handler, min_len=8, required=True)


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    limit = max(1, min(limit, 100))
    data = await batches.list_views(service_of(request), principal, after=after, limit=limit)
    return json_response(
        {
            "object": "list",
            "data": data,
            "next_cursor": data[-1]["id"] if len(data) == limit else None,
        }
    )


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    svc = service_of(request)
    view = await svc.db.read(lambda c: batches.load_view(c, principal.org_id, batch_id))
    return json_response(view)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    principal = await authenticate(request, Scope.FULL, Scope.INFERENCE)
    return json_response(await batches.cancel(service_of(request), principal, batch_id))


@router.get("/v1/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request, Scope.FULL, Scope.READ, Scope.INFERENCE)
    lines = await batches.result_lines(service_of(request), principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")
