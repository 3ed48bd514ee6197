"""``/v1/messages/batches``: Anthropic's Message Batches, on the file-batch machinery.

Answered in Anthropic's objects and error envelope (``messages.anthropic_door``);
everything underneath is the file batches' (``service.message_batches`` explains
the mapping): the quote held at create, the leased worker, ``uncertain``, one
settlement.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchyard.api.context import (
    ServiceDep,
    allow_query,
    authenticate,
    finished_query,
    idempotent,
    object_id,
    query_id_cursor,
    query_limit,
    read_empty,
    read_json,
)
from batchyard.api.messages import anthropic_door
from batchyard.api.openapi import Finished, declare
from batchyard.errors import InvalidRequest
from batchyard.service import Service, message_batches
from batchyard.service.files import settings_of
from batchyard.service.message_batches import MessageBatchBody

__all__ = ["router"]

router = APIRouter()
_PATH = "/v1/messages/batches"
#: ``message_batches.cancel`` or ``retry``: a change to one batch, answered with its view.
_Change = Callable[..., Awaitable[dict[str, Any]]]


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _id(value: str) -> str:
    return object_id(value, "bat", param="message_batch_id", what="message batch")


@router.post(_PATH, summary="Create a Message Batch (Anthropic's shape; a file batch underneath)")
@declare(body=MessageBatchBody, errors=(402,))
@anthropic_door
async def create_message_batch(request: Request, svc: ServiceDep) -> Response:
    principal = await authenticate(request, x_api_key=True)
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=settings_of(svc).max_bytes)

    async def handler() -> tuple[int, Any]:
        view = await message_batches.create(svc, principal, raw)
        svc.file_batches.notify()
        return 200, view

    return await idempotent(request, principal, raw, handler)


@router.get(_PATH, summary="Message Batches, newest first (before_id / after_id)")
@anthropic_door
async def list_message_batches(request: Request, svc: ServiceDep) -> Response:
    principal = await authenticate(request, x_api_key=True)
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
@anthropic_door
async def get_message_batch(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request, x_api_key=True)
    view = await message_batches.get(svc, principal, _id(batch_id), base_url=_base(request))
    return JSONResponse(view)


@router.post(_PATH + "/{batch_id}/cancel")
@anthropic_door
async def cancel_message_batch(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    return await _changed(request, batch_id, svc, message_batches.cancel)


@router.post(
    _PATH + "/{batch_id}/retry",
    summary="A batchyard extension: a new batch of the errored, canceled, expired requests",
)
@declare(errors=(402,))
@anthropic_door
async def retry_message_batch(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    return await _changed(request, batch_id, svc, message_batches.retry)


async def _changed(request: Request, batch_id: str, svc: Service, change: _Change) -> Response:
    """Cancel or retry: once per idempotency key, then the worker is woken for what it holds."""
    principal = await authenticate(request, x_api_key=True)
    batch_id = _id(batch_id)
    body = await read_empty(request)

    async def handler() -> tuple[int, Any]:
        view = await change(svc, principal, batch_id, base_url=_base(request))
        svc.file_batches.notify()
        return 200, view

    return await idempotent(request, principal, body, handler)


@router.get(
    _PATH + "/{batch_id}/results",
    summary="Results, one {custom_id, result} line per request, once ended",
)
@declare(errors=(409,), media="application/x-jsonl")
@anthropic_door
async def message_batch_results(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request, x_api_key=True)
    lines = await message_batches.results(svc, principal, _id(batch_id))
    return StreamingResponse(lines, media_type="application/x-jsonl")


@router.get(
    _PATH + "/{batch_id}/finished",
    summary="A batchyard extension: the results so far, from a cursor, while it runs",
)
@declare(Finished)
@anthropic_door
async def message_batch_finished(request: Request, batch_id: str, svc: ServiceDep) -> Response:
    principal = await authenticate(request, x_api_key=True)
    after, limit = finished_query(request)
    page = await message_batches.finished(svc, principal, _id(batch_id), after=after, limit=limit)
    return JSONResponse(page)
