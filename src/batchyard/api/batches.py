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
from batchyard.api.inputs import object_id, query_id_cursor, query_limit, read_empty
from batchyard.service import batches
from batchyard.service.batch_requests import MAX_BODY_BYTES, parse_submission

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    principal = await authenticate(request)
    svc = service_of(request)
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=MAX_BODY_BYTES)
    sub = parse_submission(svc, raw)

    async def handler() -> tuple[int, Any]:
        return 201, await batches.submit(svc, principal, sub)

    return await idempotent(request, principal, raw, handler, min_len=8, required=True)


def _batch_id(value: str) -> str:
    return object_id(value, "bat", param="batch_id", what="batch")


@router.get("/v1/batches")
async def list_batches(request: Request) -> JSONResponse:
    principal = await authenticate(request)
    limit = query_limit(request, default=20, most=100)
    after = query_id_cursor(request, "bat", name="after")
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
    principal = await authenticate(request)
    _batch_id(batch_id)
    svc = service_of(request)
    view = await svc.db.read(lambda c: batches.load_view(c, principal, batch_id))
    return json_response(view)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request)
    _batch_id(batch_id)
    body = await read_empty(request)
    svc = service_of(request)

    async def handler() -> tuple[int, Any]:
        return 200, await batches.cancel(svc, principal, batch_id)

    return await idempotent(request, principal, body, handler)


@router.get("/v1/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request)
    _batch_id(batch_id)
    lines = await batches.result_lines(service_of(request), principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")
