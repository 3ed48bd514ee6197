"""The run worker: takes runs through leases and hands each to what it needs.

One loop per process (the service owns it and runs it) takes runs through
leases in the store, so any number of processes can share the work and a dead
one's runs are taken over once its lease expires:

- *preparing* runs are quoted (``work.runs.quoting``);
- *blocked* runs are retried: ``funds`` when credit may have arrived,
  ``payment`` when the settlement may now succeed;
- *queued* runs are executed, their outputs written and their usage settled
  (``work.runs.executor``, ``work.runs.outputs``).

Confirming a run funds it (``work.runs.funding``): its whole quote is
reserved, or it is blocked. A row whose call was in flight when its worker
died becomes ``uncertain`` on takeover and is never sent again; a row it had
claimed but not yet sent waits again. Every round also stops the live runs
of revoked keys (``work.runs.canceling``).

``drain`` is the graceful stop: no run or row is claimed and no call is sent
any more; calls in flight land and are recorded, then each run is handed back
(its lease released) for another worker to continue at once. Only calls still
in flight when the grace period ends become ``uncertain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.ids import new_id
from batchyard.core.runs import BlockedReason, RunSettings, RunStatus
from batchyard.core.tiers import Tier
from batchyard.core.tokens import TokenizerSource
from batchyard.errors import StorageUnavailable
from batchyard.store import activity, work_items
from batchyard.store import projects as pstore
from batchyard.store.database import Database
from batchyard.store.run_leases import HELD, blocked_runs, claim_run, work_waiting
from batchyard.store.runs import Run, load_run, update_run
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.runs.canceling import revoked_runs_exist, stop_runs_of_revoked_keys
from batchyard.work.runs.executor import RunExecutor
from batchyard.work.runs.funding import fund
from batchyard.work.runs.quoting import QuotePreparer

__all__ = ["RunWorker"]

log = logging.getLogger("batchyard.runs")
S = RunStatus
# Statuses a worker takes runs in (held ones only once their lease expired).
CLAIMABLE = (S.PREPARING, S.QUEUED, *HELD)
#: An upload untouched this long stopped part-way; its hidden rows are purged.
STALE_UPLOAD = timedelta(hours=1)


class RunWorker:
    """One process's share of the run work; ``run_forever`` is its loop."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        dispatcher: Dispatcher,
        tokenizers: TokenizerSource,
        tiers: tuple[Tier, ...],
        settings: RunSettings | None = None,
        billing_review_threshold: Decimal | None = None,
        embedded_contexts: int = 1,
        owner: str | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.tiers = tiers
        self.billing_review_threshold = billing_review_threshold
        self.owner = owner or new_id("wkr", clock.now())
        self.settings = settings or RunSettings()
        self._active: dict[str, asyncio.Task[None]] = {}
        # (run ID, status when claimed) of every claim, for operators and tests.
        self.claims: list[tuple[str, str]] = []
        self._wake: asyncio.Event | None = None
        # Tells a quote being prepared on a thread to give up (the loop stopped).
        self._stopping = False
        #: Set by ``drain``: claim nothing more, send nothing more.
        self.draining = False
        self._quotes = QuotePreparer(
            db=db,
            clock=clock,
            catalog=catalog,
            tokenizers=tokenizers,
            owner=self.owner,
            settings=self.settings,
            lease_until=self._lease_until,
            stopping=lambda: self._stopping,
        )
        self._executor = RunExecutor(
            db=db,
            clock=clock,
            catalog=catalog,
            dispatcher=dispatcher,
            owner=self.owner,
            settings=self.settings,
            lease_until=self._lease_until,
            embedded_contexts=embedded_contexts,
            draining=lambda: self.draining,
        )

    # -- the loop ----------------------------------------------------------------

    def notify(self) -> None:
        """Wake the loop now (a run was created, confirmed or canceled)."""
        if self._wake is not None:
            self._wake.set()

    async def run_forever(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = False
        try:
            while True:
                try:
                    await self.tick()
                except StorageUnavailable as exc:
                    # An outage, not a bug: no traceback; the next tick reconnects.
                    log.warning(
                        "store unavailable; the worker waits for it",
                        extra={"worker": self.owner, "code": exc.code},
                    )
                except Exception:
                    log.exception("run worker tick failed", extra={"worker": self.owner})
                # A poll interval, not a time rule: leases and quotes read the clock.
                # (asyncio.wait, not wait_for: on Python 3.11 a wait_for cancelled
                # just as its event is set can hang the cancellation forever.)
                waiter = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({waiter}, timeout=self.settings.poll_s)
                finally:
                    waiter.cancel()
                self._wake.clear()
        finally:
            await self.stop()

    def drain(self) -> None:
        """Stop claiming and sending; calls in flight go on (see ``wait_idle``)."""
        self.draining = True
        self.notify()

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to ``grace_s`` seconds for active runs to hand over; True if none is left."""
        tasks = [t for t in self._active.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        return all(t.done() for t in self._active.values())

    async def stop(self) -> None:
        """Abandon active runs: as a crash would, or, while draining, handing each one back."""
        self._stopping = True
        tasks = list(self._active.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._active.clear()

    async def tick(self) -> int:
        """One round: start what can be started; returns how many runs are active."""
        for run_id, task in list(self._active.items()):
            if task.done():
                del self._active[run_id]
                if not task.cancelled() and task.exception() is not None:
                    log.error(
                        "run task failed",
                        extra={"run_id": run_id, "error_type": type(task.exception()).__name__},
                    )
        if self.draining:
            return len(self._active)
        now, exclude = self.clock.now(), list(self._active)
        claimable, funds = await self.db.read(lambda c: work_waiting(c, now, CLAIMABLE, exclude))
        await self._housekeep(now)
        if funds:
            await self._retry_blocked_funds()
        while claimable and len(self._active) < self.settings.max_active_runs:
            run = await self._claim()
            if run is None:
                break
            self.claims.append((run.id, run.status))
            self._active[run.id] = asyncio.create_task(self._work(run), name=f"run {run.id}")
        return len(self._active)

    async def run_until_idle(self, *, rounds: int = 10_000) -> None:
        """Work until nothing is left to start or finish (tests, benchmarks, CLI)."""
        for _ in range(rounds):
            if not await self.tick():
                return
            await asyncio.wait(list(self._active.values()), return_when=asyncio.FIRST_COMPLETED)

    def _lease_until(self) -> datetime:
        return self.clock.now() + timedelta(seconds=self.settings.lease_s)

    async def _claim(self) -> Run | None:
        now, until = self.clock.now(), self._lease_until()
        exclude = list(self._active)

        def tx(c: Connection) -> Run | None:
            run = claim_run(
                c,
                self.owner,
                now,
                until,
                statuses=CLAIMABLE,
                exclude=exclude,
            ) or claim_run(
                c,
                self.owner,
                now,
                until,
                statuses=[S.BLOCKED],
                exclude=exclude,
                blocked_reason=BlockedReason.PAYMENT,
            )
            if run is None:
                return None
            if run.status == S.QUEUED:
                update_run(c, run.id, now, status=S.RUNNING)
            elif run.status in HELD:
                self._take_over(c, run, now)
            return load_run(c, run.id)

        return await self.db.transact(tx)

    async def _housekeep(self, now: datetime) -> None:
        """Stop runs of revoked keys; purge uploads that stopped part-way. Cheap reads first."""
        if await self.db.read(revoked_runs_exist):
            stopped = await self.db.transact(lambda c: stop_runs_of_revoked_keys(c, now))
            if stopped:
                log.info("runs of revoked keys stopped", extra={"runs": stopped})
                self.notify()
        if await self.db.read(lambda c: pstore.unready_before(c, now - STALE_UPLOAD)):
            await self.db.transact(lambda c: pstore.purge_unready(c, now - STALE_UPLOAD))

    def _take_over(self, c: Connection, run: Run, now: Any) -> None:
        """A stopped worker's run: its sent rows become uncertain, its unsent ones wait again."""
        uncertain, _ = work_items.recover_dispatched(c, run.id, now)
        self._executor.dispatcher.metrics.leases_recovered("runs", 1)
        self._executor.dispatcher.metrics.uncertain("runs", len(uncertain))
        if uncertain:
            activity.record(
                c,
                run.org_id,
                "uncertain",
                now,
                ref=run.id,
                reservation_id=run.reservation_id,
                detail={"rows": uncertain[:100], "count": len(uncertain)},
            )
            log.warning(
                "run taken over with calls in flight",
                extra={"run_id": run.id, "uncertain": len(uncertain), "worker": self.owner},
            )
        work_items.recount(c, run.id, now)

    async def _retry_blocked_funds(self) -> None:
        now = self.clock.now()
        threshold = self.billing_review_threshold
        tiers = self.tiers

        def tx(c: Connection) -> int:
            queued = 0
            for run in blocked_runs(c, BlockedReason.FUNDS, limit=20):
                queued += fund(c, run, now, threshold=threshold, tiers=tiers) == S.QUEUED
            return queued

        if await self.db.transact(tx):
            self.notify()

    async def _work(self, run: Run) -> None:
        if run.status == S.PREPARING:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._quotes.prepare, run)
            return
        if run.status == S.BLOCKED:
            await self._executor.settle(run.id, run.lease)
            return
        await self._executor.execute(run)
