"""A live batchyard in a thread of its own, for clients that bring their own HTTP stack.

The server gets its own event loop, so synchronous clients (the openai SDK,
LiteLLM, the CLI) and clients that run threads (LangChain's ``batch``) can
call it from the test's thread without blocking it. It runs on default
settings, with the embedded model and the real clock; the ledger is audited
when it stops.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchyard.app import build_service
from batchyard.core.clock import SystemClock
from batchyard.core.config import load_settings
from batchyard.service import Service
from batchyard.store import ledger
from tests.support.accounts import make_account
from tests.support.server import live_server
from tests.support.waits import HANG_S

__all__ = ["Gateway", "ServerThread"]


@dataclass
class Gateway:
    """A running server: its ``/v1`` URL and a way to make organisations on it."""

    url: str
    service: Service
    loop: asyncio.AbstractEventLoop
    base: str = ""
    made: list[str] = field(default_factory=list)

    def org(self, name: str, *, tier: int = 1, credit: str = "100") -> str:
        """A new organisation at ``tier`` with ``credit``; its full-scope API key."""
        acct = make_account(self.service, f"{name}-{len(self.made)}", credit=credit, tier=tier)
        self.made.append(acct.org_id)
        return acct.key

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop (to read its state safely)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(HANG_S)


class ServerThread:
    def __init__(
        self,
        home: Path,
        prepare: Callable[[Service], None] | None = None,
        *,
        overrides: dict[str, Any] | None = None,
        engines: dict[str, Any] | None = None,
    ) -> None:
        """``overrides`` replace settings (``tiers``, ``limits_queue_s`` ...); ``engines``
        replace routes' engines (``{"embedded": ScriptedEngine(...)}``); ``prepare`` is
        called with the service before it serves (to swap an engine, say)."""
        self.home = home
        self.overrides = overrides or {}
        self.engines = engines or {}
        self.prepare = prepare
        self.ready = threading.Event()
        self.gateway: Gateway | None = None
        self.problems: list[str] = []
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="compat-server", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        # Two slots, as the tests using it were written for (the product's default is 8).
        settings = load_settings(
            database_url=f"sqlite:///{self.home / 'batchyard.db'}",
            **{"embedded_slots": 2, **self.overrides},
        )
        service = build_service(settings, clock=SystemClock())
        for route, engine in self.engines.items():
            service.engines.set(route, engine)
        service.db.migrate()
        if self.prepare is not None:
            self.prepare(service)
        self._stop = asyncio.Event()
        try:
            async with live_server(service) as base:
                self.gateway = Gateway(f"{base}/v1", service, asyncio.get_running_loop(), base=base)
                self.ready.set()
                await self._stop.wait()
            self.problems = service.db.read_sync(ledger.audit)
        finally:
            await service.stop()

    def start(self) -> Gateway:
        self._thread.start()
        self.ready.wait(HANG_S)
        if self.error is not None:
            raise self.error
        assert self.gateway is not None, "the compat server did not start"
        return self.gateway

    def stop(self) -> None:
        if self.gateway is not None and self._stop is not None:
            self.gateway.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(HANG_S)
