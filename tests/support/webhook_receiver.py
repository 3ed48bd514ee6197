"""A webhook receiver on 127.0.0.1 that verifies every delivery with ``standardwebhooks``.

What an organisation would run: an HTTP server (aiohttp) that checks each
POST's ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature`` with
the reference library (``Webhook(secret).verify(body, headers)``, which also
refuses a timestamp more than five minutes from the wall clock, so tests set
their clock to the real time), keeps the events it accepted, and dedupes on
``webhook-id`` as the contract asks. It can answer an error for a while
(``status``), not listen at all (``stop``) and come back on the same port, or
hold a POST open unanswered (``holding``) while the test kills its sender.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tests.support.server import free_port

__all__ = ["Receiver"]


@dataclass
class Receiver:
    """``url`` to register; ``events`` verified and accepted, by ``webhook-id``, in order."""

    port: int = field(default_factory=free_port)
    secret: str | None = None
    #: What to answer; anything but 2xx makes the sender retry.
    status: int = 204
    events: dict[str, Any] = field(default_factory=dict)
    #: Every POST that arrived: (webhook-id, the status answered).
    seen: list[tuple[str, int]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    #: While set, a POST is held open (never answered) until ``release``: a sender killed mid-POST.
    holding: bool = False
    _released: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    def release(self) -> None:
        """Answer the held POSTs (503: not accepted) and hold no more."""
        self.holding = False
        self._released.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def _hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        msg_id = request.headers.get("webhook-id", "")
        if self.holding:
            self.seen.append((msg_id, 0))
            await self._released.wait()
            return web.Response(status=503)
        if self.status >= 300:
            self.seen.append((msg_id, self.status))
            return web.Response(status=self.status)
        assert self.secret is not None, "the receiver needs the endpoint's secret"
        try:
            payload = Webhook(self.secret).verify(body, dict(request.headers))
        except WebhookVerificationError as exc:
            self.refused.append(f"{msg_id}: {exc}")
            self.seen.append((msg_id, 400))
            return web.Response(status=400)
        self.events.setdefault(msg_id, payload)  # a second copy of one id changes nothing
        self.seen.append((msg_id, self.status))
        return web.Response(status=self.status)

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hooks", self._hook)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Receiver:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
