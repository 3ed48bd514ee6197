"""The run worker: takes runs through leases and hands each to what it needs.

One loop per process (``work.runner``'s, which the service runs beside the
other workers) takes runs through leases in the store, so any number of
processes can share the work and a dead one's runs are taken over once its
lease expires:

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
import logging
from datetime import datetime, timedelta
from decimal import Decimal

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.runs import BlockedReason, RunStatus
from batchyard.core.sections import RunSettings
from batchyard.core.tiers import Tier
from batchyard.core.tokens import TokenizerSource
from batchyard.store import projects as pstore
from batchyard.store.database import Database
from batchyard.store.run_leases import (
    HELD,
    blocked_runs,
    claim_run,
    revoked_run_exists,
    work_waiting,
)
from batchyard.store.runs import Run, load_run, update_run
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.runner import Runner, recover_lapsed
from batchyard.work.runs.canceling import stop_runs_of_revoked_keys
from batchyard.work.runs.executor import RunExecutor
from batchyard.work.runs.funding import fund
from batchyard.work.runs.quoting import QuotePreparer
from batchyard.work.runs.row_queue import RowQueue

__all__ = ["RunWorker"]

log = logging.getLogger("batchyard.runs")
S = RunStatus
# Statuses a worker takes runs in (held ones only once their lease expired).
CLAIMABLE = (S.PREPARING, S.QUEUED, *HELD)
#: An upload untouched this long stopped part-way; its hidden rows are purged.
STALE_UPLOAD = timedelta(hours=1)


class RunWorker(Runner):
    """One process's share of the run work: the runner's loop over runs' rules."""

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
        owner: str | None = None,
    ) -> None:
        self.settings = settings or RunSettings()
        super().__init__(name="runs", clock=clock, poll_s=self.settings.poll_s, owner=owner)
        self.db = db
        self.dispatcher = dispatcher
        self.tiers = tiers
        self.billing_review_threshold = billing_review_threshold
        # (run ID, status when claimed) of every claim, for operators and tests.
        self.claims: list[tuple[str, str]] = []
        self._quotes = QuotePreparer(
            db=db,
            clock=clock,
            catalog=catalog,
            tokenizers=tokenizers,
            owner=self.owner,
            settings=self.settings,
            lease_until=self._lease_until,
            stopping=lambda: self.stopped,
        )
        self._executor = RunExecutor(
            db=db,
            clock=clock,
            catalog=catalog,
            dispatcher=dispatcher,
            owner=self.owner,
            settings=self.settings,
            pipeline=self.new_pipeline(
                db,
                dispatcher.metrics,
                lease_s=self.settings.lease_s,
                renew_s=self.settings.heartbeat_s,
                flush_s=self.settings.flush_s,
                outage_pause_s=self.settings.heartbeat_s,
                unavailable_retries=dispatcher.upstream_unavailable_retries,
            ),
        )

    async def round(self) -> bool:
        """Start what can be started: quotes, blocked runs, runs to execute."""
        if self.draining:
            return False
        now, exclude = self.clock.now(), list(self.active)
        claimable, funds = await self.db.read(lambda c: work_waiting(c, now, CLAIMABLE, exclude))
        await self._housekeep(now)
        if funds:
            await self._retry_blocked_funds()
        while claimable and len(self.active) < self.settings.max_active_runs:
            run = await self._claim()
            if run is None:
                break
            self.claims.append((run.id, run.status))
            self.start(run.id, self._work(run))
        return False

    def _lease_until(self) -> datetime:
        return self.clock.now() + timedelta(seconds=self.settings.lease_s)

    async def _claim(self) -> Run | None:
        now, until = self.clock.now(), self._lease_until()
        exclude = list(self.active)

        def tx(c: Connection) -> tuple[Run, bool] | None:
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
            return load_run(c, run.id), run.status in HELD

        claimed = await self.db.transact(tx)
        if claimed is None:
            return None
        run, taken_over = claimed
        if taken_over:
            # A stopped worker's run: its sent rows become uncertain, its unsent ones wait.
            await recover_lapsed(self.db, self.clock, self.dispatcher.metrics, RowQueue(run))
        return run

    async def _housekeep(self, now: datetime) -> None:
        """Stop runs of revoked keys; purge uploads that stopped part-way. Cheap reads first."""
        if await self.db.read(revoked_run_exists):
            stopped = await self.db.transact(lambda c: stop_runs_of_revoked_keys(c, now))
            if stopped:
                log.info("runs of revoked keys stopped", extra={"runs": stopped})
                self.notify()
        if await self.db.read(lambda c: pstore.unready_before(c, now - STALE_UPLOAD)):
            await self.db.transact(lambda c: pstore.purge_unready(c, now - STALE_UPLOAD))

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
