"""A real batchyard server on loopback, in real time, for the client's own tests.

The runner paces by the wall clock, so unlike most integration tests these
use ``SystemClock``: the tier limit they run under is real, and so are the
429s it sends. The tier is high enough (2,400 requests a minute) that a few
hundred texts take seconds, and still low enough to bind, since the scripted
engine answers at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchyard.client.async_client import AsyncClient
from batchyard.core.clock import SystemClock
from batchyard.core.config import Settings
from batchyard.core.tiers import Tier
from batchyard.engines.memory import ScriptedEngine
from batchyard.errors import UpstreamError
from batchyard.service import Service
from batchyard.store import ledger
from tests.support.accounts import Account, make_account
from tests.support.server import live_server

#: The test organisation's requests a minute: 40 a second, one every 25 ms.
TIER_RPM = 2400
TIER = Tier(1, TIER_RPM, 10_000_000, 100_000_000, Decimal("1000000"))


@dataclass
class Wire:
    """Every response the server sent, counted per status as it left the app.

    Counted at the server, around the ASGI app, so the SDK's own retries and
    the CLI's requests (which build their own client) are all seen.
    """

    statuses: Counter[int] = field(default_factory=Counter)
    decide_statuses: Counter[int] = field(default_factory=Counter)
    replayed: int = 0
    in_flight: int = 0

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return

            async def send_counted(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    self.statuses[status] += 1
                    if scope["path"] == "/v1/decide":
                        self.decide_statuses[status] += 1
                        if (b"idempotent-replayed", b"true") in message.get("headers", []):
                            self.replayed += 1
                await send(message)

            self.in_flight += 1
            try:
                await app(scope, receive, send_counted)
            finally:
                self.in_flight -= 1

        return counted

    async def drained(self, timeout: float = 30.0) -> None:
        """Wait until no request is being served: a killed client's calls still run to the end."""
        for _ in range(int(timeout / 0.01)):
            if self.in_flight == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.in_flight} requests still in flight")

    def reset(self) -> None:
        self.statuses.clear()
        self.decide_statuses.clear()
        self.replayed = 0


def counted_server(service: Service, wire: Wire) -> AbstractAsyncContextManager[str]:
    """``tests.support.server.live_server`` with ``wire`` around the app."""
    return live_server(service, worker=True, wrap=wire.wrap)


@dataclass
class LiveGateway:
    service: Service
    base_url: str
    account: Account
    engine: ScriptedEngine
    wire: Wire
    #: Texts whose scoring fails with a retryable 502 while listed here.
    broken: set[str] = field(default_factory=set)

    def client(self, **kw: Any) -> AsyncClient:
        return AsyncClient(self.base_url, self.account.key, **kw)

    def env(self) -> dict[str, str]:
        return {"BATCHYARD_BASE_URL": self.base_url, "BATCHYARD_API_KEY": self.account.key}


def _scorer(broken: set[str]) -> Callable[[str, list[dict[str, Any]], list[str]], list[float]]:
    """Favour the outcome the text names; fail for texts listed in ``broken``."""

    def score(model: str, messages: list[dict[str, Any]], candidates: list[str]) -> list[float]:
        prompt = str(messages[-1]["content"])
        if any(marker in prompt for marker in broken):
            raise UpstreamError("scripted upstream failure", retry_after=0)
        text = prompt.split("Text:")[-1].split("Reply with")[0].lower()
        out = []
        for candidate in candidates:
            outcome = candidate.rsplit("\n", 1)[-1].split(": ", 1)[-1].lower()
            out.append(-0.1 if outcome in text else -3.0 - 0.01 * len(outcome))
        return out

    return score


@pytest.fixture
async def gateway(settings: Settings) -> AsyncIterator[LiveGateway]:
    """The real app on loopback, real time, a scripted scorer, an org on the test tier."""
    tiers = (settings.tiers[0], TIER)
    svc = Service(dataclasses.replace(settings, tiers=tiers), clock=SystemClock())
    svc.db.migrate()
    broken: set[str] = set()
    engine = ScriptedEngine(clock=svc.clock, scorer=_scorer(broken))
    svc.engines.set("embedded", engine)
    account = make_account(svc, "acme", credit="50", tier=TIER.level)
    try:
        wire = Wire()
        async with counted_server(svc, wire) as base:
            yield LiveGateway(svc, base, account, engine, wire, broken)
    finally:
        problems = svc.db.run_sync(ledger.audit, readonly=True)
        await svc.stop()
        assert problems == [], problems
