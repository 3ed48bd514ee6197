"""A client that hangs up on a whole (not streamed) answer stops the work it asked for.

A stream's client is seen to go when a write fails, and closing the stream
stops the engine. A whole answer writes nothing until the end, so without a
listener the engine would generate to ``max_tokens`` for nobody and the call
would be paid in full (an SDK's timeout, then its retry, paid twice). So while
a whole answer is made, ``listening`` reads the connection for the server's
``http.disconnect`` and sets the returned event; the door hands the event to
the engine with the request (``CompletionRequest.hangup``), which ends the
generation at its next step with what it produced. The call is then settled
like any other: to its real usage, and kept under its Idempotency-Key, so a
retry replays it instead of running it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Request

__all__ = ["listening", "log_hangup"]

log = logging.getLogger("batchyard.api")


@contextlib.asynccontextmanager
async def listening(request: Request) -> AsyncIterator[asyncio.Event]:
    """An event set when the client of ``request`` hangs up, while the block runs.

    The body has been read whole before, so what the server hands the app
    from now on is only ``http.disconnect``.
    """
    hangup = asyncio.Event()

    async def listen() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        hangup.set()

    task = asyncio.create_task(listen())
    try:
        yield hangup
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def log_hangup(ref: str, route: str, output_tokens: int | None) -> None:
    """One structured line for a whole answer whose client hung up (no content, no caller)."""
    log.info(
        "client hung up; generation stopped",
        extra={
            "event": "client_disconnected",
            "ref": ref,
            "route": route,
            "output_tokens": output_tokens,
        },
    )
