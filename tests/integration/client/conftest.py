"""A real batchyard server on loopback, in real time, for the client's own tests.

The runner paces by the wall clock, so unlike most integration tests these
use ``SystemClock``: the tier limit they run under is real, and so are the
429s it sends. The tier is high enough (2,400 requests a minute) that a few
hundred texts take seconds, and still low enough to bind, since the scripted
engine answers at once.
"""

from __future__ import annotations

import asyncio
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
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import UpstreamError
from batchyard.service import Service
from tests.support.accounts import Account, make_account
from tests.support.server import live_server
from tests.support.services import ServiceFactory
from tests.support.waits import settles

#: The test organisation's requests a minute: 40 a second, one every 25 ms, and
#: as many in flight as the widest run here sends at once.
TIER_RPM = 2400
TIER = Tier(1, TIER_RPM, 10_000_000, 100_000_000, Decimal("1000000"), concurrency=16)


@dataclass
class Wire:
    """Every response the server sent, counted per status as it left the app.

    Counted at the server, around the ASGI app, so the SDK's own retries and
    the CLI's requests (which build their own client) are all seen.

    A client that is cancelled (a killed run) leaves its requests running on
    the server, which still answers them; those answers belong to the run that
    sent them. So counters are read and reset only once nothing is in flight
    (``quiet``), or a late 200 would land in the next run's count.
    """

    statuses: Counter[int] = field(default_factory=Counter)
    decide_statuses: Counter[int] = field(default_factory=Counter)
    replayed: int = 0
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set while answers are held back until the server refuses a decide call.
    _refused: asyncio.Event | None = None

    def __post_init__(self) -> None:
        self._idle.set()

    def hold_answers_until_refused(self) -> None:
        """Hold every decide answer after the first until a decide call is refused (429).

        A held answer keeps its request in flight, and with it one of the
        organisation's concurrency slots (given back only as the answer's last
        byte leaves). A client that keeps more calls in flight than its tier's
        concurrency therefore meets a refusal, however slowly the machine
        answers; once one is sent, the held answers go out. The first answer
        goes at once: the runner times its first text alone before it sends
        the rest.
        """
        self._refused = asyncio.Event()

    async def _held(self, status: int) -> None:
        if self._refused is None:
            return
        if status == 429:
            self._refused.set()
        elif status == 200 and self.decide_statuses[200] > 0:
            await self._refused.wait()

    async def quiet(self) -> None:
        """Wait until the server has finished every request it received."""
        await settles(self._idle.wait(), "the server has answered every request")

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            self.in_flight += 1
            self._idle.clear()
            try:
                await self._serve(app, scope, receive, send)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._idle.set()

        return counted

    async def _serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if scope["path"] == "/v1/decide":
                    await self._held(status)
                self.statuses[status] += 1
                if scope["path"] == "/v1/decide":
                    self.decide_statuses[status] += 1
                    if (b"idempotent-replayed", b"true") in message.get("headers", []):
                        self.replayed += 1
            await send(message)

        await app(scope, receive, send_counted)

    async def reset(self) -> None:
        """Forget what was counted, once the requests still in flight have answered."""
        await self.quiet()
        self.statuses.clear()
        self.decide_statuses.clear()
        self.replayed = 0
        if self._refused is not None:
            self._refused.set()
        self._refused = None


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
        text = prompt.split("Questions:")[0].lower()
        out = []
        for candidate in candidates:
            outcome = candidate.rsplit("\n", 1)[-1].split(": ", 1)[-1].lower()
            out.append(-0.1 if outcome in text else -3.0 - 0.01 * len(outcome))
        return out

    return score


@pytest.fixture
async def gateway(settings: Settings, make_service: ServiceFactory) -> AsyncIterator[LiveGateway]:
    """The real app on loopback, real time, a scripted scorer, an org on the test tier."""
    # No server-side queue: a request over the limit is a 429 at once, which is
    # what these tests hold the client's handling of.
    svc = make_service(tiers=(settings.tiers[0], TIER), clock=SystemClock(), limits_queue_s=0)
    broken: set[str] = set()
    engine = ScriptedEngine(clock=svc.clock, scorer=_scorer(broken))
    svc.engines.set("embedded", engine)
    account = make_account(svc, "acme", credit="50", tier=TIER.level)
    wire = Wire()
    async with counted_server(svc, wire) as base:
        yield LiveGateway(svc, base, account, engine, wire, broken)
