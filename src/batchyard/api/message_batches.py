"""``/v1/messages/batches``: Anthropic's Message Batches, on the file-batch machinery.

Create, retrieve, list (Anthropic's ``before_id`` / ``after_id`` / ``limit``
paging), cancel and results, answered in Anthropic's objects and error
envelope (the Messages door's ``anthropic_door``). Everything underneath is
the file batches' (``service.message_batches`` explains the mapping): the
quote held at create, the leased worker, ``uncertain``, one settlement.

Scopes (``service.access``): ``full`` and ``inference`` keys create and
cancel; every key reads; an ``inference`` key sees only its own batches.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from batchyard.api.context import authenticate, idempotent, json_response, read_json, service_of
from batchyard.api.inputs import (
    finished_query,
    object_id,
    query_id_cursor,
    query_limit,
    read_empty,
)
from batchyard.api.messages import anthropic_door
from batchyard.errors import InvalidRequest
from batchyard.service import message_batches
from batchyard.service.files import settings_of

__all__ = ["router"]

router = APIRouter()
_PATH = "/v1/messages/batches"
#: ``message_batches.cancel`` or ``retry``: a change to one batch, answered with its view.
_Change = Callable[..., Awaitable[dict[str, Any]]]


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _id(value: str) -> str:
    return object_id(value, "bat", param="message_batch_id", what="message batch")


@router.post(_PATH)
@anthropic_door
async def create_message_batch(request: Request) -> Response:
    principal = await authenticate(request, x_api_key=True)
    svc = service_of(request)
    svc.batch_key.require()  # 503 before the body is read when batches are off
    raw = await read_json(request, limit=settings_of(svc).max_bytes)

    async def handler() -> tuple[int, Any]:
        view = await message_batches.create(svc, principal, raw)
        svc.file_batches.notify()
        return 200, view

    return await idempotent(request, principal, raw, handler)


@router.get(_PATH)
@anthropic_door
async def list_message_batches(request: Request) -> Response:
    principal = await authenticate(request, x_api_key=True)
    for key in sorted(request.query_params.keys() - {"after_id", "before_id", "limit"}):
        raise InvalidRequest(
            f"{key} is not a query parameter here", param=key, code="unsupported_parameter"
        )
    limit = query_limit(request, default=20, most=1000)
    after = query_id_cursor(request, "bat", name="after_id")
    before = query_id_cursor(request, "bat", name="before_id")
    if after and before:
        raise InvalidRequest("send after_id or before_id, not both", param="before_id")
    page = await message_batches.list_page(
        service_of(request),
        principal,
        limit=limit,
        after=after,
        before=before,
        base_url=_base(request),
    )
    return json_response(page)


@router.get(_PATH + "/{batch_id}")
@anthropic_door
async def get_message_batch(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request, x_api_key=True)
    batch_id = _id(batch_id)
    view = await message_batches.get(
        service_of(request), principal, batch_id, base_url=_base(request)
    )
    return json_response(view)


@router.post(_PATH + "/{batch_id}/cancel")
@anthropic_door
async def cancel_message_batch(request: Request, batch_id: str) -> Response:
    return await _changed(request, batch_id, message_batches.cancel)


@router.post(_PATH + "/{batch_id}/retry")
@anthropic_door
async def retry_message_batch(request: Request, batch_id: str) -> Response:
    """A batchyard extension: a new batch of this one's errored, canceled and expired requests."""
    return await _changed(request, batch_id, message_batches.retry)


async def _changed(request: Request, batch_id: str, change: _Change) -> Response:
    """Cancel or retry: once per idempotency key, then the worker is woken for what it holds."""
    principal = await authenticate(request, x_api_key=True)
    batch_id = _id(batch_id)
    body = await read_empty(request)
    svc = service_of(request)

    async def handler() -> tuple[int, Any]:
        view = await change(svc, principal, batch_id, base_url=_base(request))
        svc.file_batches.notify()
        return 200, view

    return await idempotent(request, principal, body, handler)


@router.get(_PATH + "/{batch_id}/results")
@anthropic_door
async def message_batch_results(request: Request, batch_id: str) -> Response:
    principal = await authenticate(request, x_api_key=True)
    batch_id = _id(batch_id)
    lines = await message_batches.results(service_of(request), principal, batch_id)
    return StreamingResponse(lines, media_type="application/x-jsonl")


@router.get(_PATH + "/{batch_id}/finished")
@anthropic_door
async def message_batch_finished(request: Request, batch_id: str) -> Response:
    """A batchyard extension: the results so far, from a cursor, while the batch runs."""
    principal = await authenticate(request, x_api_key=True)
    batch_id = _id(batch_id)
    after, limit = finished_query(request)
    page = await message_batches.finished(
        service_of(request), principal, batch_id, after=after, limit=limit
    )
    return json_response(page)
