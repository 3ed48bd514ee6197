"""``/v1/messages/batches``: Anthropic's Message Batches, on the file-batch machinery.

Answered in Anthropic's objects and error envelope (its door's ``ANTHROPIC_WIRE``);
everything underneath is the file batches' (``service.message_batches`` explains
the mapping): the quote held at create, the leased worker, ``uncertain``, one
settlement.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import (
    Caller,
    ServiceDep,
    allow_query,
    finished_query,
    idempotent,
    path_id,
    query_id_cursor,
    query_limit,
    read_empty,
    read_json,
)
from batchyard.api.messages import ANTHROPIC_WIRE, translated
from batchyard.api.openapi import Finished, declare
from batchyard.core.accounts import Principal
from batchyard.errors import InvalidRequest
from batchyard.service import Service, message_batches
from batchyard.service.files import settings_of
from batchyard.service.message_batches import MessageBatchBody

__all__ = ["router"]

router = APIRouter(dependencies=[ANTHROPIC_WIRE])
_PATH = "/v1/messages/batches"
BatchId = Annotated[str, path_id("batch_id", "bat", "message batch", param="message_batch_id")]
#: ``message_batches.cancel`` or ``retry``: a change to one batch, answered with its view.
_Change = Callable[..., Awaitable[dict[str, Any]]]


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


@router.post(_PATH, summary="Create a Message Batch (Anthropic's shape; a file batch underneath)")
@declare(body=MessageBatchBody, errors=(402,))
async def create_message_batch(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=settings_of(svc).max_bytes)

    async def handler() -> tuple[int, Any]:
        view = await message_batches.create(svc, principal, raw)
        svc.file_batches.notify()
        return 200, view

    return translated(request, await idempotent(request, principal, raw, handler))


@router.get(_PATH, summary="Message Batches, newest first (before_id / after_id)")
async def list_message_batches(request: Request, principal: Caller, svc: ServiceDep) -> Response:
    allow_query(request, "after_id", "before_id", "limit")
    limit = query_limit(request, default=20, most=1000)
    after = query_id_cursor(request, "bat", name="after_id")
    before = query_id_cursor(request, "bat", name="before_id")
    if after and before:
        raise InvalidRequest("send after_id or before_id, not both", param="before_id")
    page = await message_batches.list_page(
        svc, principal, limit=limit, after=after, before=before, base_url=_base(request)
    )
    return JSONResponse(page)


@router.get(_PATH + "/{batch_id}")
async def get_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    view = await message_batches.get(svc, principal, batch_id, base_url=_base(request))
    return JSONResponse(view)


@router.post(_PATH + "/{batch_id}/cancel")
async def cancel_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    return await _changed(request, principal, batch_id, svc, message_batches.cancel)


@router.post(
    _PATH + "/{batch_id}/retry",
    summary="A batchyard extension: a new batch of the errored, canceled, expired requests",
)
@declare(errors=(402,))
async def retry_message_batch(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    return await _changed(request, principal, batch_id, svc, message_batches.retry)


async def _changed(
    request: Request, principal: Principal, batch_id: str, svc: Service, change: _Change
) -> Response:
    """Cancel or retry: once per idempotency key, then the worker is woken for what it holds."""
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        view = await change(svc, principal, batch_id, base_url=_base(request))
        svc.file_batches.notify()
        return 200, view

    return translated(request, await idempotent(request, principal, body, handler))


@router.get(
    _PATH + "/{batch_id}/results",
    summary="Results, one {custom_id, result} line per request, once ended",
)
@declare(errors=(409,), media="application/x-jsonl")
async def message_batch_results(principal: Caller, batch_id: BatchId, svc: ServiceDep) -> Response:
    lines = await message_batches.results(svc, principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-jsonl")


@router.get(
    _PATH + "/{batch_id}/finished",
    summary="A batchyard extension: the results so far, from a cursor, while it runs",
)
@declare(Finished)
async def message_batch_finished(
    request: Request, principal: Caller, batch_id: BatchId, svc: ServiceDep
) -> Response:
    after, limit = finished_query(request)
    page = await message_batches.finished(svc, principal, batch_id, after=after, limit=limit)
    return JSONResponse(page)
