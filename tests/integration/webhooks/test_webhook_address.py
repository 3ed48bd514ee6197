"""A delivery goes to the address that was checked, under the name that was registered.

The sender resolves the URL's host, refuses a disallowed address, and then
connects to that same address: a name whose DNS answer changes between the
check and the connection (DNS rebinding) cannot move the POST. Here the name
does not resolve at all outside the sender's check (``.invalid`` is reserved),
so the receiver on 127.0.0.1 is reached only if the POST used the checked
address; it sees the registered name in ``Host``.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
from aiohttp import web

from batchyard.core.leases import Lease
from batchyard.core.sections import WebhookSettings, parse_networks
from batchyard.core.telemetry import MemoryRecorder
from batchyard.errors import UpstreamError
from batchyard.store.webhook_deliveries import Delivery
from batchyard.work.webhook_sender import WebhookSender
from tests.support.server import free_port
from tests.support.waits import HANG_S

SECRET = "whsec_" + "A" * 43 + "="
NAME = "hooks.rebound.invalid"


class _Resolver(WebhookSender):
    """The sender with DNS answered by the test: the name points where the test says."""

    answer: list[str]

    async def _addresses(self, host: str, port: int) -> list[str]:
        return list(self.answer) if host == NAME else await super()._addresses(host, port)


async def _receiver(port: int, hosts: list[str]) -> web.AppRunner:
    async def hook(request: web.Request) -> web.Response:
        hosts.append(request.headers.get("host", ""))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hooks", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _delivery(url: str) -> Delivery:
    return Delivery(
        id="msg.01a242d0-891f-730f-b9cb-c2c7a83c45e6",
        lease=Lease("w1", 1),
        org_id="org.1",
        endpoint_id="we.1",
        url=url,
        secret=SECRET,
        event_type="batch.completed",
        payload=b'{"type":"batch.completed"}',
        attempts=0,
    )


async def test_the_post_goes_to_the_checked_address_under_the_registered_name(
    service: Any, clock: Any
) -> None:
    port = free_port()
    hosts: list[str] = []
    runner = await _receiver(port, hosts)
    settings = WebhookSettings(allowed_networks=parse_networks(["127.0.0.0/8"]))
    sender = _Resolver(
        db=service.db,
        clock=clock,
        metrics=MemoryRecorder(),
        settings=settings,
        rand=random.Random(1),
    )
    sent: list[bool] = []

    async def on_send() -> None:
        sent.append(True)

    try:
        async with httpx.AsyncClient(timeout=HANG_S, follow_redirects=False) as http:
            sender.answer = ["127.0.0.1"]
            status = await sender.call(http, _delivery(f"http://{NAME}:{port}/hooks"), on_send)
            assert status == 204
            assert hosts == [f"{NAME}:{port}"]

            # The same name now answered with a metadata address: refused before any send.
            sender.answer = ["169.254.169.254"]
            try:
                await sender.call(http, _delivery(f"http://{NAME}:{port}/hooks"), on_send)
            except UpstreamError as exc:
                assert exc.code == "webhook_target_refused"
            else:
                raise AssertionError("a disallowed address was not refused")
            assert sent == [True] and hosts == [f"{NAME}:{port}"]
    finally:
        await runner.cleanup()
