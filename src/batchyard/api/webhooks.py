"""Webhook endpoints: ``/v1/webhook-endpoints``, where an organisation hears that batches ended.

The rules are ``service.webhook_subscriptions``', deliveries ``work.webhook_sender``'s.
A create is not replayed under an ``Idempotency-Key``: the answer holds the
secret, which is kept nowhere readable but the endpoint's own sealed row; a
client that lost the answer deletes the endpoint or rotates its secret.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from batchyard.api.bodies import WebhookEndpointBody
from batchyard.api.context import (
    Caller,
    Empty,
    ServiceDep,
    path_id,
    query_id_cursor,
    query_limit,
    read_json,
)
from batchyard.api.openapi import (
    WebhookEndpoint,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    declare,
)
from batchyard.core.inputs import strict
from batchyard.service import webhook_subscriptions as subscriptions

__all__ = ["router"]

router = APIRouter()
_BASE = "/v1/webhook-endpoints"
EndpointId = Annotated[str, path_id("endpoint_id", "we", "webhook endpoint")]


@router.post(
    _BASE,
    status_code=201,
    summary="Register a webhook endpoint (its secret is in this answer only)",
)
@declare(WebhookEndpoint, body=WebhookEndpointBody)
async def create_endpoint(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    body = strict(WebhookEndpointBody, await read_json(request))
    view = await subscriptions.create(svc, principal, body.url, body.events, body.description)
    return JSONResponse(view, 201)


@router.get(_BASE, summary="Webhook endpoints")
@declare(WebhookEndpointList)
async def list_endpoints(request: Request, principal: Caller, svc: ServiceDep) -> JSONResponse:
    limit = query_limit(request, default=20, most=100)
    after = query_id_cursor(request, "we", name="after")
    page = await subscriptions.list_page(svc, principal, after=after, limit=limit)
    return JSONResponse(page)


@router.get(_BASE + "/{endpoint_id}")
@declare(WebhookEndpoint)
async def get_endpoint(principal: Caller, endpoint_id: EndpointId, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await subscriptions.get(svc, principal, endpoint_id))


@router.delete(_BASE + "/{endpoint_id}")
@declare(WebhookEndpointDeleted)
async def delete_endpoint(
    principal: Caller, endpoint_id: EndpointId, svc: ServiceDep
) -> JSONResponse:
    return JSONResponse(await subscriptions.delete(svc, principal, endpoint_id))


@router.post(
    _BASE + "/{endpoint_id}/rotate-secret", summary="A new signing secret, in this answer only"
)
@declare(WebhookEndpoint)
async def rotate_secret(
    principal: Caller, endpoint_id: EndpointId, _: Empty, svc: ServiceDep
) -> JSONResponse:
    return JSONResponse(await subscriptions.rotate(svc, principal, endpoint_id))
