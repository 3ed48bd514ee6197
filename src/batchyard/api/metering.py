"""``/metrics``: HTTP requests counted by route, and Prometheus's scrape of the deployment.

``MeteringMiddleware`` is the outermost middleware, so it sees the status the
envelope's last-resort 500 sent too. It counts requests by route template,
method and status, with latency. The route label is the template the router
matched (``/v1/runs/{run_id}``), never the raw path, so the number of series
stays bounded; a path no route matched is ``unmatched``. The time is read from
the deployment's clock (``core.clock``), from the first byte in to the last
out. A request whose client hung up before any answer is counted as status 499.

``GET /metrics`` is rendered by ``service.metrics``. Open by default, like
``/healthz``: it carries counts and route IDs, never an organisation, a key or
any text; a deployment on the internet sets ``metrics_token``. A store or a
model that cannot answer in time leaves its gauges out
(``batchyard_store_up`` 0) rather than failing the scrape.
"""

from __future__ import annotations

import asyncio
import hmac

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchyard.core.clock import Clock
from batchyard.core.telemetry import Recorder
from batchyard.errors import BatchyardError, StorageUnavailable, Unauthorized
from batchyard.service import service_of
from batchyard.service.metrics import CONTENT_TYPE
from batchyard.store import backlog

__all__ = ["MeteringMiddleware", "route_template", "router"]

router = APIRouter()

#: How long a scrape waits for the store's backlog before answering without it.
BACKLOG_TIMEOUT_S = 5.0
#: How long it waits for the embedded model's shelf before answering without it.
CACHE_TIMEOUT_S = 2.0


def route_template(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


class MeteringMiddleware:
    def __init__(self, app: ASGIApp, *, recorder: Recorder, clock: Clock) -> None:
        self.app = app
        self._recorder = recorder
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = self._clock.time()
        status = 0

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except BaseException:
            status = status or 500  # escaped before an answer started
            raise
        finally:
            # No answer and no error: the client hung up first (nginx's 499).
            status = status or 499
            elapsed = self._clock.time() - started
            self._recorder.http_request(route_template(scope), scope["method"], status, elapsed)


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
