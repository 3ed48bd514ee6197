"""Webhook endpoints: ``/v1/webhook-endpoints``, where an organisation hears that batches ended.

``POST`` registers a URL for some events and answers its signing secret
(``whsec_...``) once; ``GET`` lists and shows endpoints (never the secret);
``DELETE`` removes one; ``POST …/rotate-secret`` makes a new secret, shown once.
The rules (which URLs, which events) are ``service.webhook_subscriptions``';
deliveries are ``work.webhook_sender``'s.

A create is not replayed under an ``Idempotency-Key``: the answer holds the
secret, which is kept nowhere readable but the endpoint's own sealed row. A
client that lost the answer deletes the endpoint or rotates its secret.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from batchyard.api.bodies import WebhookEndpointBody
from batchyard.api.context import ServiceDep, authenticate, json_response, read_json
from batchyard.api.inputs import object_id, query_id_cursor, query_limit, read_empty, strict
from batchyard.service import webhook_subscriptions as subscriptions

__all__ = ["router"]

router = APIRouter()

_BASE = "/v1/webhook-endpoints"


def _endpoint_id(value: str) -> str:
    return object_id(value, "we", param="endpoint_id", what="webhook endpoint")


@router.post(_BASE)
async def create_endpoint(request: Request, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    body = strict(WebhookEndpointBody, await read_json(request))
    view = await subscriptions.create(svc, principal, body.url, body.events, body.description)
    return json_response(view, 201)


@router.get(_BASE)
async def list_endpoints(request: Request, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    limit = query_limit(request, default=20, most=100)
    after = query_id_cursor(request, "we", name="after")
    page = await subscriptions.list_page(svc, principal, after=after, limit=limit)
    return json_response(page)


@router.get(_BASE + "/{endpoint_id}")
async def get_endpoint(request: Request, endpoint_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    view = await subscriptions.get(svc, principal, _endpoint_id(endpoint_id))
    return json_response(view)


@router.delete(_BASE + "/{endpoint_id}")
async def delete_endpoint(request: Request, endpoint_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    view = await subscriptions.delete(svc, principal, _endpoint_id(endpoint_id))
    return json_response(view)


@router.post(_BASE + "/{endpoint_id}/rotate-secret")
async def rotate_secret(request: Request, endpoint_id: str, svc: ServiceDep) -> JSONResponse:
    principal = await authenticate(request)
    await read_empty(request)
    view = await subscriptions.rotate(svc, principal, _endpoint_id(endpoint_id))
    return json_response(view)
