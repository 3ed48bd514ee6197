"""``GET /metrics``: Prometheus's scrape of this deployment (``service.metrics`` renders it).

Open by default, like ``/healthz``: it carries counts and route IDs, never an
organisation, a key or any text. A deployment that serves the API to the
internet sets ``metrics_token`` (or ``BATCHYARD_METRICS_TOKEN``), and then
only ``Authorization: Bearer <metrics_token>`` is answered; anything else is
401 ``unauthorized``. The store's backlog (queue depths, open holds) is read
for each scrape; a store that cannot answer leaves those gauges out and sets
``batchyard_store_up`` to 0, while the counters still answer.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response

from batchyard.errors import StorageUnavailable, Unauthorized
from batchyard.service import service_of
from batchyard.service.metrics import CONTENT_TYPE
from batchyard.store import backlog

__all__ = ["router"]

router = APIRouter()

#: How long a scrape waits for the store's backlog before answering without it.
BACKLOG_TIMEOUT_S = 5.0


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
    return Response(svc.metrics.exposition(waiting), media_type=CONTENT_TYPE)
