"""``/v1/batches``: one resource, two dialects.

The body of ``POST /v1/batches`` says which dialect is meant. One that names
``input_file_id`` or ``endpoint`` is OpenAI's file batch
(``service.file_batches``: its lines are an uploaded file's, its quote is
held at once, ``work.file_batches`` runs it). Any other is a
deferred batch, exactly as docs/reference/batches.md says: inline ``requests`` checked whole
(``service.batch_requests``), sealed and written in one transaction, a
required Idempotency-Key, executed by the deferred-batch worker (``work.deferred_batches``).
Reads, lists and cancels serve both with one object
(``service.batch_views``); ``/results`` is the deferred batch's NDJSON, and a file
batch's results are its output and error files.

Scopes (``service.access``): ``full`` and ``inference`` keys create and cancel;
every key reads; an ``inference`` key sees and cancels only its own batches.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import ServiceDep, authenticate, idempotent, json_response, read_json
from batchyard.api.inputs import (
    finished_query,
    object_id,
    query_id_cursor,
    query_limit,
    read_empty,
)
from batchyard.errors import InvalidRequest, InvalidState
from batchyard.service import batch_listing, deferred_batches, file_batches
from batchyard.service.batch_requests import MAX_BODY_BYTES, parse_submission

__all__ = ["router"]

router = APIRouter()


#: Fields only a file batch names: their presence says the body is OpenAI's dialect.
FILE_DIALECT = {"input_file_id", "endpoint"}


@router.post("/v1/batches")
async def create_batch(request: Request, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=MAX_BODY_BYTES)
    if FILE_DIALECT & raw.keys():
        parsed = file_batches.parse_create(raw)

        async def create() -> tuple[int, Any]:
            view = await file_batches.create(svc, principal, parsed)
            svc.file_batches.notify()
            return 200, view

        return await idempotent(request, principal, raw, create, answers_text=False)
    sub = parse_submission(svc, raw, principal.org_id)

    async def handler() -> tuple[int, Any]:
        return 201, await deferred_batches.submit(svc, principal, sub)

    # A submission's answer is the batch's ID and status, no text: its key holds under
    # zero data retention too (same body: the same batch; another body: 409).
    return await idempotent(
        request, principal, raw, handler, min_len=8, required=True, answers_text=False
    )


def _batch_id(value: str) -> str:
    return object_id(value, "bat", param="batch_id", what="batch")


@router.get("/v1/batches")
async def list_batches(request: Request, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    for key in sorted(request.query_params.keys() - {"after", "limit"}):
        raise InvalidRequest(
            f"{key} is not a query parameter here", param=key, code="unsupported_parameter"
        )
    limit = query_limit(request, default=20, most=100)
    after = query_id_cursor(request, "bat", name="after")
    data, more = await batch_listing.list_views(svc, principal, after=after, limit=limit)
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
            "next_cursor": data[-1]["id"] if more else None,
        }
    )


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    _batch_id(batch_id)
    view = await svc.db.read(lambda c: batch_listing.load_view(c, principal, batch_id))
    return json_response(view)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    _batch_id(batch_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        if await batch_listing.is_file_batch(svc, principal, batch_id):
            view = await file_batches.cancel(svc, principal, batch_id)
            svc.file_batches.notify()
            return 200, view
        return 200, await deferred_batches.cancel(svc, principal, batch_id)

    return await idempotent(request, principal, body, handler, answers_text=False)


@router.post("/v1/batches/{batch_id}/retry")
async def retry_batch(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    """A batchyard extension: a new file batch of this one's failed, expired and canceled lines."""
    principal = await authenticate(request)
    _batch_id(batch_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        if not await batch_listing.is_file_batch(svc, principal, batch_id):
            # 404 unless it is the caller's deferred batch.
            await svc.db.read(lambda c: batch_listing.load_view(c, principal, batch_id))
            raise InvalidState(
                "a deferred batch is not retried here: submit its failed requests as a new batch",
                code="retry_unsupported",
            )
        view = await file_batches.retry(svc, principal, batch_id)
        svc.file_batches.notify()
        return 200, view

    return await idempotent(request, principal, body, handler)


@router.get("/v1/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request)
    _batch_id(batch_id)
    lines = await deferred_batches.result_lines(svc, principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")


@router.get("/v1/batches/{batch_id}/finished")
async def batch_finished(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    """A batchyard extension: the lines that ended so far, from a cursor, while the batch runs."""
    principal = await authenticate(request)
    _batch_id(batch_id)
    after, limit = finished_query(request)
    if await batch_listing.is_file_batch(svc, principal, batch_id):
        page = await file_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    else:
        page = await deferred_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    return json_response(page)
