"""Run the real batchyard app on a loopback port inside the test's own event loop.

Serving in the same loop as the test means a ``ManualClock`` advanced by the
test is seen by the server at once, with no cross-thread hand-off, while
requests still travel over real HTTP.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import ASGIApp

from batchyard.app import create_app
from batchyard.service import Service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def live_server(
    service: Service,
    *,
    worker: bool = True,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
) -> AsyncIterator[str]:
    """Serve ``service`` on 127.0.0.1; yields the base URL (no trailing slash).

    ``wrap`` puts middleware of the test's own around the app (to count what
    goes over the wire, say).
    """
    port = free_port()
    app: ASGIApp = create_app(service, worker=worker, close_on_exit=False)
    if wrap is not None:
        app = wrap(app)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=30)
