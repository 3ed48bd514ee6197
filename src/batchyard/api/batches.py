"""``/v1/batches``: one resource, two dialects.

The body of ``POST /v1/batches`` says which dialect is meant: one that names
``input_file_id`` or ``endpoint`` is OpenAI's file batch (``service.file_batches``),
any other a deferred batch (``service.batch_requests``, docs/reference/batches.md),
whose Idempotency-Key is required. Reads, lists and cancels serve both with one
object (``service.batch_views``); ``/results`` is the deferred batch's NDJSON, and a
file batch's results are its output and error files.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import (
    Caller,
    Empty,
    ServiceDep,
    allow_query,
    finished_query,
    listing,
    once,
    path_id,
    query_id_cursor,
    query_limit,
    read_json,
)
from batchyard.api.openapi import Finished, ListOf, declare
from batchyard.errors import InvalidState
from batchyard.service import batch_views, deferred_batches, file_batches
from batchyard.service.batch_requests import MAX_BODY_BYTES, BatchBody, parse_submission
from batchyard.service.file_batches import FileBatchBody

__all__ = ["router"]

router = APIRouter()
BatchId = Annotated[str, path_id("batch_id", "bat", "batch")]

#: Fields only a file batch names: their presence says the body is OpenAI's dialect.
FILE_DIALECT = {"input_file_id", "endpoint"}


@router.post(
    "/v1/batches",
    status_code=201,
    summary="Submit a batch: deferred (201, batchyard's body) or a file batch (200, OpenAI's)",
)
@declare(body=(BatchBody, FileBatchBody), errors=(402, 429), also=(200,))
async def create_batch(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=MAX_BODY_BYTES)
    if FILE_DIALECT & raw.keys():
        parsed = file_batches.parse_create(raw)

        async def create() -> dict[str, Any]:
            view = await file_batches.create(svc, principal, parsed)
            svc.file_batches.notify()
            return view

        return await once(request, principal, raw, create, answers_text=False)
    sub = parse_submission(svc, raw, principal.org_id)
    submit = partial(deferred_batches.submit, svc, principal, sub)
    # A submission's answer is the batch's ID and status, no text: its key holds under
    # zero data retention too (same body: the same batch; another body: 409).
    return await once(
        request, principal, raw, submit, status=201, min_len=8, required=True, answers_text=False
    )


@router.get("/v1/batches", summary="Batches of both dialects")
@declare(ListOf)
async def list_batches(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    allow_query(request, "after", "limit")
    limit = query_limit(request, default=20, most=100)
    after = query_id_cursor(request, "bat", name="after")
    data, more = await batch_views.list_views(svc, principal, after=after, limit=limit)
    return JSONResponse({**listing(data, more), "next_cursor": data[-1]["id"] if more else None})


@router.get("/v1/batches/{batch_id}")
async def get_batch(principal: Caller, batch_id: BatchId, svc: ServiceDep) -> JSONResponse:
    view = await svc.db.read(lambda c: batch_views.load_view(c, principal, batch_id))
    return JSONResponse(view)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(
    request: Request, principal: Caller, batch_id: BatchId, body: Empty, svc: ServiceDep
) -> Response:
    async def cancel() -> dict[str, Any]:
        if await batch_views.is_file_batch(svc, principal, batch_id):
            view = await file_batches.cancel(svc, principal, batch_id)
            svc.file_batches.notify()
            return view
        return await deferred_batches.cancel(svc, principal, batch_id)

    return await once(request, principal, body, cancel, answers_text=False)


@router.post(
    "/v1/batches/{batch_id}/retry",
    summary="A batchyard extension: a new file batch of the failed, expired, canceled lines",
)
@declare(errors=(402,))
async def retry_batch(
    request: Request, principal: Caller, batch_id: BatchId, body: Empty, svc: ServiceDep
) -> Response:
    async def retry() -> dict[str, Any]:
        if not await batch_views.is_file_batch(svc, principal, batch_id):
            # 404 unless it is the caller's deferred batch.
            await svc.db.read(lambda c: batch_views.load_view(c, principal, batch_id))
            raise InvalidState(
                "a deferred batch is not retried here: submit its failed requests as a new batch",
                code="retry_unsupported",
            )
        view = await file_batches.retry(svc, principal, batch_id)
        svc.file_batches.notify()
        return view

    return await once(request, principal, body, retry)


@router.get(
    "/v1/batches/{batch_id}/results",
    summary="Results, one JSON line per request (410 results_expired once purged)",
)
@declare(errors=(410,), media="application/x-ndjson")
async def batch_results(principal: Caller, batch_id: BatchId, svc: ServiceDep) -> Response:
    lines = await deferred_batches.result_lines(svc, principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")


@router.get(
    "/v1/batches/{batch_id}/finished",
    summary="A batchyard extension: what has ended so far, from a cursor, while it runs",
)
@declare(Finished, errors=(410,))
async def batch_finished(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    after, limit = finished_query(request)
    if await batch_views.is_file_batch(svc, principal, batch_id):
        page = await file_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    else:
        page = await deferred_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    return JSONResponse(page)
