"""``GET /metrics``: Prometheus's scrape of this deployment (``service.metrics`` renders it).

Open by default, like ``/healthz``: it carries counts and route IDs, never an
organisation, a key or any text. A deployment that serves the API to the
internet sets ``metrics_token`` (or ``BATCHYARD_METRICS_TOKEN``), and then
only ``Authorization: Bearer <metrics_token>`` is answered; anything else is
401 ``unauthorized``. The store's backlog (queue depths, open holds) is read
for each scrape; a store that cannot answer leaves those gauges out and sets
``batchyard_store_up`` to 0, while the counters still answer. The embedded
model's shelf (prompts moved from its KV cache to host memory) is this
process's, for each model loaded here.
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
