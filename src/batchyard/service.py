"""The wiring of one batchyard deployment: settings, store, clock, limiter, engines.

The API, the worker loop and the CLI all build one ``Service`` and share it,
so a test can hand in a ``ManualClock`` or a scripted engine once and every
part of the system sees the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from batchyard.core.catalog import ModelSpec
from batchyard.core.clock import Clock, SystemClock
from batchyard.core.config import Settings
from batchyard.core.limits import Limiter, limiter_from_url
from batchyard.core.tokens import Tokenizer, tokenizer_for
from batchyard.engines.base import Engine
from batchyard.store.database import Database
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry

__all__ = ["Service"]

log = logging.getLogger("batchyard.service")


class Service:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Clock | None = None,
        engines: dict[str, Engine] | None = None,
        limiter: Limiter | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = settings.catalog
        self.clock: Clock = clock or SystemClock()
        self.db = Database(settings.database_url)
        self.limiter: Limiter = limiter or limiter_from_url(
            settings.limiter_url, self.clock, engine=self.db.engine
        )
        self.engines = EngineRegistry(
            embedded_model_path=settings.embedded_model_path,
            embedded_contexts=settings.embedded_contexts,
            embedded_n_ctx=settings.embedded_n_ctx,
            overrides=engines,
        )
        self.dispatcher = Dispatcher(
            db=self.db,
            clock=self.clock,
            limiter=self.limiter,
            engines=self.engines,
            tiers=settings.tiers,
        )
        self._tokenizers: dict[str, Tokenizer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: list[Callable[[], Any]] = []
        self.started = False
        # Background work of the front doors; each door adds its own line.
        from batchyard.work import market as market_worker
        from batchyard.work import runs as runs_worker
        from batchyard.work import warmth

        market_worker.install(self)  # deferred batches (seed 003)
        runs_worker.install(self)  # batch inference runs (seed 002)
        warmth.install(self)  # fine-tuned versions going cold (seed 000)

    def tokenizer(self, model: ModelSpec) -> Tokenizer:
        spec = model.tokenizer
        if spec == "default" and self.settings.embedded_model_path:
            spec = f"gguf:{self.settings.embedded_model_path}"
        tok = self._tokenizers.get(spec)
        if tok is None:
            tok = self._tokenizers[spec] = tokenizer_for(spec)
        return tok

    def tier(self, level: int) -> Any:
        for t in self.settings.tiers:
            if t.level == level:
                return t
        return self.settings.tiers[0]

    def add_background(self, factory: Callable[[], Any]) -> None:
        """Register a coroutine factory run as a task while the service is up."""
        self._background.append(factory)

    async def start(self, *, worker: bool = True) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.db.migrate)
        if worker:
            for factory in self._background:
                self._tasks.append(asyncio.create_task(factory()))
        self.started = True

    async def stop(self) -> None:
        """Stop background work and close every resource."""
        await self.stop_workers()
        await self.engines.aclose()
        await self.limiter.close()
        self.db.close()

    async def stop_workers(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
