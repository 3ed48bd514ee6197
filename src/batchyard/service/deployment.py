"""The parts of one deployment, held together: what every front door reaches for.

A ``Service`` holds what the composition root (``batchyard.app``) built and builds
nothing itself, so a test hands in a ``ManualClock`` or a scripted engine once and every
part sees the same one; each worker was given only the parts it uses, never the
``Service``. ``stop`` is abrupt, as a crash would be; ``drain`` is SIGTERM's graceful
stop: nothing more is claimed, calls in flight get ``grace_s`` to land, and claimed work
never sent goes back to waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchyard.core.catalog import Catalog, ModelSpec
from batchyard.core.clock import Clock
from batchyard.core.config import Settings
from batchyard.core.limits import Limiter
from batchyard.core.tiers import Tier
from batchyard.core.tokens import Tokenizer
from batchyard.engines.tokenizers import Tokenizers
from batchyard.service.metrics import PrometheusRecorder
from batchyard.service.preparation import Preparer
from batchyard.store.database import Database
from batchyard.work.batch_key import BatchKey
from batchyard.work.decide_scoring import Calibrations
from batchyard.work.deferred_batches.deferred_batch_worker import DeferredBatchWorker
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry
from batchyard.work.file_batches.file_batch_worker import FileBatchWorker
from batchyard.work.holds import HoldSweeper
from batchyard.work.runner import Worker
from batchyard.work.runs.run_worker import RunWorker
from batchyard.work.warmth import Warmth
from batchyard.work.webhook_sender import WebhookSender

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

__all__ = ["Service", "service_of"]

log = logging.getLogger("batchyard.service")


@dataclass(eq=False)
class Service:
    """One deployment's parts and the lifecycle of its background work."""

    settings: Settings
    clock: Clock
    db: Database
    limiter: Limiter
    engines: EngineRegistry
    dispatcher: Dispatcher
    #: Decide's calibration: each decision set's prior and running sums, written behind.
    calibrations: Calibrations
    tokenizers: Tokenizers
    batch_key: BatchKey
    deferred_batches: DeferredBatchWorker
    runs: RunWorker
    warmth: Warmth
    file_batches: FileBatchWorker
    holds: HoldSweeper
    #: The webhook outbox's sender (``work.webhook_sender``).
    webhooks: WebhookSender
    #: What the parts count, served at ``/metrics`` (``service.metrics``).
    metrics: PrometheusRecorder
    #: Every background loop, started, drained and stopped alike.
    workers: list[Worker] = field(default_factory=list)
    started: bool = field(default=False, init=False)
    #: True from the start of ``drain``: ``/readyz`` answers 503 so traffic moves away.
    draining: bool = field(default=False, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False, repr=False)

    @property
    def catalog(self) -> Catalog:
        return self.settings.catalog

    def tokenizer(self, model: ModelSpec) -> Tokenizer:
        return self.tokenizers.for_model(model)

    @property
    def preparer(self) -> Preparer:
        """What prepares every call of this deployment (``service.preparation``)."""
        return Preparer(self.catalog, self.tokenizers, self.settings.default_max_tokens)

    def tier(self, level: int) -> Tier:
        """The tier at ``level``; an unknown level (a tier removed from config) is tier 0."""
        for t in self.settings.tiers:
            if t.level == level:
                return t
        return self.settings.tiers[0]

    async def start(self, *, worker: bool = True) -> None:
        """Migrate the store, then run the background workers unless ``worker`` is off."""
        await asyncio.get_running_loop().run_in_executor(None, self.db.migrate)
        if worker:
            for w in self.workers:
                self._tasks.append(asyncio.create_task(w.run_forever(), name=w.name))
        self.started = True

    def begin_drain(self) -> None:
        """Claim and send nothing more (a SIGTERM's first step); in-flight calls go on."""
        if not self.draining:
            self.draining = True
            for w in self.workers:
                w.drain()
            log.info("draining", extra={"event": "drain_started"})

    async def drain(self, grace_s: float) -> None:
        """Stop gracefully: let calls in flight land for up to ``grace_s`` seconds, then stop.

        Only calls still in flight when the grace period ends are cut off (and
        become ``uncertain``); claimed work never sent goes back to waiting.
        Every worker waits out the same grace period, side by side.
        """
        self.begin_drain()
        idle = await asyncio.gather(*(w.wait_idle(grace_s) for w in self.workers))
        log.info("drained", extra={"event": "drain_finished", "cut_off": not all(idle)})
        await self.stop_workers()

    async def stop(self, *, grace_s: float | None = None) -> None:
        """Stop background work (draining for ``grace_s`` seconds first) and close everything."""
        if grace_s is not None:
            await self.drain(grace_s)
        await self.stop_workers()
        await self.calibrations.flush()
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


def service_of(request: HTTPConnection) -> Service:
    """The service an app was built over (``batchyard.app.create_app`` puts it there)."""
    svc: Service = request.app.state.service
    return svc
