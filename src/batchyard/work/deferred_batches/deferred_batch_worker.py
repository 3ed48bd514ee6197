"""The deferred-batch worker: dispatch waiting items when a route meets their discount.

Each pass, in order:

1. *Recover.* A dispatched item whose lease lapsed becomes ``uncertain``,
   its reservation still held, if its call was sent; nothing is retried or
   released. One that was never sent goes back to waiting and its hold is
   released (``work.deferred_batches.housekeeping``).
2. *Housekeep.* Overdue waiting items expire, those of revoked keys are
   canceled, and results of batches completed 24 hours ago are purged.
3. *Choose.* For each waiting item (most urgent first), the policy picks a
   route among those that qualify on fresh prices, or says wait.
   A policy that learns from the market has what it saw saved
   (``work.deferred_batches.price_memory``), and restored when a worker starts.
4. *Claim.* The chosen items go through the runner's claim pipeline
   (``work.runner``) over an ``ItemQueue`` (``work.deferred_batches.item_queue``):
   each is locked, its deadline, submitting key and price rechecked, the
   most its call can cost on that route reserved, and the item marked
   ``dispatched`` with its reservation and a lease, all before the engine is
   called. No qualifying route, no reservation: funds are never held while
   waiting.
5. *Execute.* Up to ten items, concurrently, through the dispatcher's pacing.
   The item is marked sent durably just before its engine call. The leases
   are renewed while the calls run. The result is settled to real usage at
   the route's offered price in one transaction with the item's result and
   its activity record; a failure is released and recorded, and never
   retried (``work.deferred_batches.results``).

A crash mid-call leaves the item ``dispatched``; the lease lapses and the
next pass of any worker makes it ``uncertain`` (sent) or waiting again (not
sent). A graceful stop (``drain``) claims nothing more and sends nothing
more: items still waiting for their turn go back to waiting at once, calls
in flight may finish until the grace period ends, and only those cut off
then become ``uncertain``. Without a batch encryption key
(``work.batch_key``) the worker does nothing and the door answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.market import Item, LearningPolicy, Policy, RouteOffer, qualifies
from batchyard.core.sealing import Sealer
from batchyard.core.tiers import Tier
from batchyard.engines.protocol import Completion
from batchyard.store import deferred_batches as store
from batchyard.store.database import Database
from batchyard.work.batch_key import BatchKey
from batchyard.work.deferred_batches import housekeeping
from batchyard.work.deferred_batches.item_queue import ItemEnd, ItemQueue, PassReport
from batchyard.work.deferred_batches.price_memory import PriceMemory
from batchyard.work.deferred_batches.results import ClaimedItem
from batchyard.work.dispatcher import Dispatcher, OnSend
from batchyard.work.market_prices import MarketPrices
from batchyard.work.price_feed import PriceFeed
from batchyard.work.runner import Answered, Failed, Runner, recover_lapsed

__all__ = ["DeferredBatchSettings", "DeferredBatchWorker", "PassReport"]

log = logging.getLogger("batchyard.deferred_batches")


@dataclass(frozen=True, slots=True)
class DeferredBatchSettings:
    """How often and how much the worker does: by default, docs/reference/batches.md's numbers."""

    #: Seconds between idle passes ("checks the market about every 15 seconds").
    interval_s: float = 15.0
    #: Seconds between price-feed refreshes.
    feed_interval_s: float = 60.0
    #: Items executed per pass at most ("up to ten items per pass").
    per_pass: int = 10
    #: How long a dispatched item's lease lasts without a heartbeat.
    lease_s: float = 120.0
    #: Waiting items looked at per pass, most urgent first.
    scan_limit: int = 1000
    #: Answered items are recorded at least this often (a pass records all before it ends).
    flush_s: float = 0.25


class DeferredBatchWorker(Runner):
    """Passes over the waiting items of every organisation; see the module docstring.

    Several workers, in one process or many, may share a database: a claim
    locks the item's row and a lease says who holds a dispatched item, so no
    item is dispatched twice.
    """

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        dispatcher: Dispatcher,
        tiers: tuple[Tier, ...],
        key: BatchKey,
        prices: MarketPrices,
        policy: Policy,
        feed: PriceFeed | None = None,
        settings: DeferredBatchSettings | None = None,
        owner: str | None = None,
    ) -> None:
        self.settings = settings or DeferredBatchSettings()
        # The market is checked on the clock ("about every 15 seconds"), not polled.
        super().__init__(
            name="deferred", clock=clock, poll_s=self.settings.interval_s, owner=owner, timed=True
        )
        self.db = db
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.tiers = tiers
        self.key = key
        self.prices = prices
        # Workers in one process may share a book; each process polls its own feed.
        self.book = prices.book
        self.policy = policy
        self.feed = feed
        self.per_pass = self.settings.per_pass
        self.scan_limit = self.settings.scan_limit
        self.memory = PriceMemory(db, clock, policy)
        self.pipeline = self.new_pipeline(
            db,
            dispatcher.metrics,
            lease_s=self.settings.lease_s,
            flush_s=self.settings.flush_s,
            unavailable_retries=dispatcher.upstream_unavailable_retries,
        )
        self._feed_task: asyncio.Task[None] | None = None

    # --- availability -------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.key.available

    def sealer(self) -> Sealer:
        """The sealer, or 503 ``batches_unavailable`` saying why there is none."""
        return self.key.require()

    # --- the loop -------------------------------------------------------------------

    async def opening(self) -> bool:
        if not self.available:
            log.warning(
                "deferred batches are off", extra={"event": "market_off", "reason": self.key.reason}
            )
            return False
        await self.memory.restore()
        if self.feed is not None:
            await self.feed.refresh()
            self._feed_task = asyncio.create_task(self._feed_loop())
        return True

    async def closing(self) -> None:
        if self._feed_task is not None:
            self._feed_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feed_task
            self._feed_task = None

    async def round(self) -> bool:
        """One pass; a full one suggests more work is ready, so the next comes at once."""
        report = await self.run_pass()
        return not self.draining and report.dispatched >= self.per_pass

    async def _feed_loop(self) -> None:
        assert self.feed is not None
        interval = self.settings.feed_interval_s
        while True:
            await self.clock.sleep(interval)
            await self.feed.refresh()

    def _queue(self, report: PassReport) -> ItemQueue:
        return ItemQueue(
            owner=self.owner,
            sealer=self.sealer(),
            catalog=self.catalog,
            prices=self.prices,
            tiers=self.tiers,
            metrics=self.dispatcher.metrics,
            report=report,
        )

    async def run_pass(self) -> PassReport:
        report = PassReport()
        if not self.available:
            return report
        await self.recover(report)
        await self.housekeep(report)
        if self.draining:
            return report
        chosen = await self._choose(report)
        await self.memory.save()
        if chosen:
            queue = self._queue(report)
            queue.chosen = chosen
            ran = await self.start(
                "pass",
                self.pipeline.run(queue, width=self.per_pass, call=self._call, render=self._end),
            )
            report.succeeded += ran.answered
            report.failed += ran.failed
            report.returned += ran.unsent
        if any(
            (report.dispatched, report.expired, report.canceled, report.uncertain, report.returned)
        ):
            log.info(
                "deferred-batch pass",
                extra={
                    "event": "deferred_batch_pass",
                    "dispatched": report.dispatched,
                    "succeeded": report.succeeded,
                    "failed": report.failed,
                    "expired": report.expired,
                    "canceled": report.canceled,
                    "uncertain": report.uncertain,
                    "returned": report.returned,
                },
            )
        return report

    async def _call(self, job: ClaimedItem, on_send: OnSend) -> Completion:
        return await self.dispatcher.call(
            route=job.route,
            request=job.request,
            input_tokens=job.item.input_tokens,
            on_send=on_send,
        )

    @staticmethod
    def _end(job: ClaimedItem, attempt: Answered[Completion] | Failed) -> ItemEnd:
        if isinstance(attempt, Failed):
            return ItemEnd(job, error=attempt.error)
        return ItemEnd(job, completion=attempt.value)

    # --- recovery and housekeeping -------------------------------------------------------

    async def recover(self, report: PassReport | None = None) -> int:
        """Lapsed dispatches: sent ones ``uncertain`` (hold released), unsent ones waiting again."""
        queue = self._queue(report or PassReport())
        return (await recover_lapsed(self.db, self.clock, self.dispatcher.metrics, queue)).uncertain

    async def housekeep(self, report: PassReport | None = None) -> None:
        """Expire, cancel for revoked keys, and purge old results."""
        swept = await housekeeping.housekeep(self.db, self.clock)
        if report is not None:
            report.expired += swept.expired
            report.canceled += swept.canceled
            report.purged += swept.purged

    # --- choosing and claiming --------------------------------------------------------------

    async def _choose(self, report: PassReport) -> list[tuple[store.ItemRow, RouteOffer]]:
        now = self.clock.now()
        candidates = await self.db.read(lambda c: store.waiting_candidates(c, now, self.scan_limit))
        report.waiting = len(candidates)
        offers: dict[str, list[RouteOffer]] = {}
        chosen: list[tuple[store.ItemRow, RouteOffer]] = []
        for cand in candidates:
            if len(chosen) >= self.per_pass:
                break
            if self.catalog.find(cand.model) is None:
                continue
            model_offers = offers.get(cand.model)
            if model_offers is None:
                model_offers = offers[cand.model] = self.prices.offers(cand.model, now)
            if not model_offers:
                continue
            direct = self.prices.direct(cand.model)
            item = Item(
                id=cand.id,
                min_discount=cand.min_discount,
                deadline=cand.deadline,
                submitted_at=cand.created_at,
                input_tokens=cand.input_tokens,
                max_output_tokens=cand.max_tokens,
            )
            offer = self.policy.choose(item, model_offers, direct, now)
            # A policy may only narrow the rule; check it anyway, money is at stake.
            if offer is not None and qualifies(offer, direct, cand.min_discount):
                chosen.append((cand, offer))
        # A policy that learns from the market should see it on quiet passes too.
        if isinstance(self.policy, LearningPolicy):
            for model_id in list(self.catalog.models):
                if model_id not in offers and self.catalog.routes_for(model_id):
                    self.policy.observe(
                        self.prices.offers(model_id, now), self.prices.direct(model_id), now
                    )
        return chosen
