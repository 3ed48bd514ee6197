"""The real batchyard app for a test: in process over ASGI, or on a loopback port.

``asgi_client`` is the default: the app runs in the test's event loop and an
``httpx.AsyncClient`` talks to it through ``httpx.ASGITransport``. Every request
goes through the same routing, middleware, error handlers and lifespan as on a
socket, at a fraction of the cost, and a ``ManualClock`` advanced by the test is
seen by the server at once.

Both wrap the app in ``tests.support.wire_check.WIRE``: every answer a test
gets is checked against the app's OpenAPI document on the side.

``live_server`` serves on 127.0.0.1 for the tests where the socket is the
subject: real clients (our SDK's pacing, the CLI, a browser) and fault tests
that need another process to reach the server.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.types import ASGIApp

from batchyard.app import create_app
from batchyard.service import Service
from tests.support.waits import HANG_S, settles
from tests.support.wire_check import WIRE

__all__ = ["asgi_app", "asgi_client", "free_port", "live_server"]

#: The base URL of in-process requests; no socket answers it.
ASGI_BASE = "http://batchyard.test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@asynccontextmanager
async def asgi_app(
    service: Service, *, worker: bool = True
) -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    """``service``'s app running in process; yields a maker of clients (each its own cookies).

    ``worker=False`` leaves the background workers off, so a test drives them itself.
    An exception the app does not turn into an answer is a 500, as on a socket.
    """
    app = create_app(service, worker=worker, close_on_exit=False)
    # Every answer is checked against the app's own OpenAPI document (tests.support.wire_check).
    transport = httpx.ASGITransport(app=WIRE.wrap(app), raise_app_exceptions=False)

    def client(timeout: float = HANG_S) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=transport, base_url=ASGI_BASE, timeout=timeout)

    async with app.router.lifespan_context(app):
        yield client


@asynccontextmanager
async def asgi_client(
    service: Service, *, worker: bool = True, timeout: float = HANG_S
) -> AsyncIterator[httpx.AsyncClient]:
    """One HTTP client wired to ``service``'s app in process (see ``asgi_app``)."""
    async with asgi_app(service, worker=worker) as client, client(timeout) as http:
        yield http


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
    app: ASGIApp = WIRE.wrap(create_app(service, worker=worker, close_on_exit=False))
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
        await settles(task, "the live server stops")
