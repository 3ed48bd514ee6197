"""``GET /metrics``: Prometheus's scrape of this deployment (``service.metrics`` renders it).

Open by default, like ``/healthz``: it carries counts and route IDs, never an
organisation, a key or any text; a deployment on the internet sets
``metrics_token``. A store or a model that cannot answer in time leaves its
gauges out (``batchyard_store_up`` 0) rather than failing the scrape.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.errors import BatchyardError, StorageUnavailable, Unauthorized
from batchyard.service import service_of
from batchyard.service.metrics import CONTENT_TYPE
from batchyard.store import backlog

__all__ = ["router"]

router = APIRouter()

#: How long a scrape waits for the store's backlog before answering without it.
BACKLOG_TIMEOUT_S = 5.0
#: How long it waits for the embedded model's shelf before answering without it.
CACHE_TIMEOUT_S = 2.0


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    svc = service_of(request)
    token = svc.settings.metrics_token
    if token is not None and not hmac.compare_digest(
        request.headers.get("authorization", "").encode(), f"Bearer {token}".encode()
    ):
        raise Unauthorized("/metrics needs the metrics token: Authorization: Bearer <token>")
    try:
        waiting = await asyncio.wait_for(svc.db.read(backlog.backlog), BACKLOG_TIMEOUT_S)
    except (StorageUnavailable, TimeoutError):
        waiting = None
    try:
        # Read between two of the model's steps: a long prompt's step may keep it a while.
        shelves = await asyncio.wait_for(svc.engines.cache_states(), CACHE_TIMEOUT_S)
    except (TimeoutError, BatchyardError):  # busy past the timeout, or closing
        shelves = []
    return Response(svc.metrics.exposition(waiting, shelves), media_type=CONTENT_TYPE)
