"""The market worker: dispatch waiting items when a route meets their discount.

Each pass, in order:

1. *Recover.* A dispatched item whose lease lapsed becomes ``uncertain``,
   its reservation still held; nothing is retried or released
   (``work.batches.housekeeping``).
2. *Housekeep.* Overdue waiting items expire, those of revoked keys are
   canceled, and results of batches completed 24 hours ago are purged.
3. *Choose.* For each waiting item (most urgent first), the policy picks a
   route among those that qualify on fresh prices, or says wait.
   A policy that learns from the market has what it saw saved
   (``work.batches.memory``), and restored when a worker starts.
4. *Claim.* Per chosen item, one transaction locks the row, rechecks the
   deadline, the submitting key and the price, reserves the most the call can
   cost on that route, and marks the item ``dispatched`` with its reservation
   and a lease, all before the engine is called. No qualifying route, no
   reservation: funds are never held while waiting.
5. *Execute.* Up to ten items, concurrently, through the dispatcher's pacing.
   The lease is renewed while the call runs. The result is settled to real
   usage at the route's offered price in one transaction with the item's
   result and its activity record; a failure is released and recorded, and
   never retried (``work.batches.results``).

Cancelling the worker mid-call (shutdown, crash) leaves the item
``dispatched``; the lease lapses and the next pass of any worker makes it
``uncertain``. Without a batch encryption key (``work.batches.sealing``) the
worker does nothing and the door answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.market import (
    Item,
    LearningPolicy,
    Policy,
    RouteOffer,
    offer_cost,
    qualifies,
)
from batchyard.core.money import quote_ticks
from batchyard.core.sealing import Sealer, SealError
from batchyard.core.tiers import Tier
from batchyard.engines.base import Completion, CompletionRequest
from batchyard.errors import (
    BatchyardError,
    InsufficientCredit,
    InternalError,
    UpstreamError,
)
from batchyard.store import accounts, activity, ledger
from batchyard.store import batches as store
from batchyard.store.database import Database
from batchyard.work.batches import housekeeping
from batchyard.work.batches.feed import PriceFeed
from batchyard.work.batches.memory import MarketMemory
from batchyard.work.batches.prices import MarketPrices
from batchyard.work.batches.results import Claimed, finish_failed, record_failure, record_success
from batchyard.work.batches.sealing import BatchKey
from batchyard.work.dispatcher import Dispatcher

__all__ = ["MarketSettings", "MarketWorker", "PassReport"]

log = logging.getLogger("batchyard.market")


@dataclass(frozen=True, slots=True)
class MarketSettings:
    """How often and how much the worker does: seed 003's numbers by default."""

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


@dataclass
class PassReport:
    """What one pass did, for logs and tests."""

    uncertain: int = 0
    expired: int = 0
    canceled: int = 0
    purged: int = 0
    dispatched: int = 0
    succeeded: int = 0
    failed: int = 0
    waiting: int = 0


class MarketWorker:
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
        settings: MarketSettings | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.tiers = tiers
        self.key = key
        self.prices = prices
        # Workers in one process may share a book; each process polls its own feed.
        self.book = prices.book
        self.policy = policy
        self.feed = feed
        self.settings = settings or MarketSettings()
        self.per_pass = self.settings.per_pass
        self.lease = timedelta(seconds=self.settings.lease_s)
        self.scan_limit = self.settings.scan_limit
        self.memory = MarketMemory(db, clock, policy)

    # --- availability -------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self.key.available

    def sealer(self) -> Sealer:
        """The sealer, or 503 ``batches_unavailable`` saying why there is none."""
        return self.key.require()

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Pass after pass until cancelled; idle passes are ``market_interval_s`` apart."""
        clock = self.clock
        if not self.available:
            log.warning(
                "deferred batches are off", extra={"event": "market_off", "reason": self.key.reason}
            )
            return
        await self.memory.restore()
        feed_task: asyncio.Task[None] | None = None
        if self.feed is not None:
            await self.feed.refresh()
            feed_task = asyncio.create_task(self._feed_loop())
        try:
            while True:
                report: PassReport | None = None
                try:
                    report = await self.run_pass()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("market pass failed", extra={"event": "market_pass_error"})
                # A full pass suggests more work is ready; otherwise wait for the market.
                if report is None or report.dispatched < self.per_pass:
                    await clock.sleep(self.settings.interval_s)
        finally:
            if feed_task is not None:
                feed_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feed_task

    async def _feed_loop(self) -> None:
        assert self.feed is not None
        interval = self.settings.feed_interval_s
        while True:
            await self.clock.sleep(interval)
            await self.feed.refresh()

    async def run_pass(self) -> PassReport:
        report = PassReport()
        if not self.available:
            return report
        await self.recover(report)
        await self.housekeep(report)
        chosen = await self._choose(report)
        await self.memory.save()
        claimed: list[Claimed] = []
        for candidate, offer in chosen:
            got = await self._claim(candidate, offer, report)
            if got is not None:
                claimed.append(got)
        report.dispatched = len(claimed)
        if claimed:
            outcomes = await asyncio.gather(*(self._execute(c) for c in claimed))
            report.succeeded = sum(1 for ok in outcomes if ok)
            report.failed += sum(1 for ok in outcomes if not ok)
        if any((report.dispatched, report.expired, report.canceled, report.uncertain)):
            log.info(
                "market pass",
                extra={
                    "event": "market_pass",
                    "dispatched": report.dispatched,
                    "succeeded": report.succeeded,
                    "failed": report.failed,
                    "expired": report.expired,
                    "canceled": report.canceled,
                    "uncertain": report.uncertain,
                },
            )
        return report

    # --- recovery and housekeeping -------------------------------------------------------

    async def recover(self, report: PassReport | None = None) -> int:
        """Dispatched items whose lease lapsed become ``uncertain``, reservation held."""
        n = await housekeeping.recover_lapsed(self.db, self.clock)
        if report is not None:
            report.uncertain += n
        return n

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
            if cand.model not in self.catalog.models:
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
            for model_id in self.catalog.models:
                if model_id not in offers and self.catalog.routes_for(model_id):
                    self.policy.observe(
                        self.prices.offers(model_id, now), self.prices.direct(model_id), now
                    )
        return chosen

    async def _claim(
        self, cand: store.ItemRow, chosen: RouteOffer, report: PassReport
    ) -> Claimed | None:
        sealer = self.sealer()
        route = self.catalog.routes[chosen.route]

        def tx(conn: Connection) -> Claimed | None:
            now = self.clock.now()
            got = store.claim(conn, cand.id)
            if got is None:
                return None
            item, sealed = got
            if now >= item.deadline:
                store.finish_item(conn, item, status="expired", reason="deadline", now=now)
                report.expired += 1
                return None
            if not accounts.key_is_active(conn, item.key_id):
                store.finish_item(conn, item, status="canceled", reason="key_revoked", now=now)
                report.canceled += 1
                return None
            # The price that authorises this spend is read now, not at the top of the pass.
            offer = self.prices.offer(route.id, now)
            direct = self.prices.direct(item.model)
            if offer.price is None or not qualifies(offer, direct, item.min_discount):
                return None
            try:
                stored = json.loads(sealer.open(sealed, item.id.encode()))
            except SealError as exc:
                # Sealed under another key: it can never run; say so instead of
                # failing every pass until it expires.
                err = InternalError(f"the stored request cannot be read: {exc}", retryable=False)
                finish_failed(conn, sealer, item, err, now)
                report.failed += 1
                return None
            amount = quote_ticks(offer_cost(offer, item.input_tokens, item.max_tokens))
            try:
                with conn.begin_nested():
                    res = ledger.reserve(
                        conn,
                        item.org_id,
                        amount,
                        now,
                        purpose="batch",
                        ref=item.id,
                        tiers=self.tiers,
                    )
            except InsufficientCredit as exc:
                finish_failed(conn, sealer, item, exc, now)
                report.failed += 1
                return None
            store.mark_dispatched(
                conn,
                item.id,
                route=route.id,
                reservation_id=res.id,
                now=now,
                lease_until=now + self.lease,
            )
            activity.record(
                conn,
                item.org_id,
                "dispatch",
                now,
                ref=item.id,
                reservation_id=res.id,
                amount=res.amount,
                detail={
                    "purpose": "batch",
                    "batch_id": item.batch_id,
                    "custom_id": item.custom_id,
                    "model": item.model,
                    "route": route.id,
                },
            )
            return Claimed(
                item=item,
                request=CompletionRequest(
                    model=route.upstream_model,
                    messages=stored["messages"],
                    max_tokens=item.max_tokens,
                    temperature=stored.get("temperature"),
                    top_p=stored.get("top_p"),
                    stop=stored.get("stop"),
                    seed=stored.get("seed"),
                    response_format=stored.get("response_format"),
                ),
                route=route,
                price=offer.price,
                reservation_id=res.id,
            )

        claimed = await self.db.transact(tx)
        if claimed is not None:
            log.info(
                "batch item dispatched",
                extra={
                    "event": "batch_item_dispatched",
                    "item_id": cand.id,
                    "route": route.id,
                    "reservation_id": claimed.reservation_id,
                },
            )
        return claimed

    # --- executing ----------------------------------------------------------------------

    async def _heartbeat(self, item_id: str) -> None:
        clock, db = self.clock, self.db
        lease = self.lease

        def renew(conn: Connection) -> bool:
            return store.extend_lease(conn, item_id, clock.now() + lease)

        while True:
            await clock.sleep(lease.total_seconds() / 3)
            await db.transact(renew)

    async def _execute(self, job: Claimed) -> bool:
        """Call, then settle or release with the item's result; True on success."""
        heartbeat = asyncio.create_task(self._heartbeat(job.item.id))
        try:
            try:
                completion = await self.dispatcher.call(
                    route=job.route, request=job.request, input_tokens=job.item.input_tokens
                )
            except asyncio.CancelledError:
                # Interrupted: the outcome is unknown. The lease lapses and a
                # later pass marks the item uncertain; nothing is released.
                raise
            except Exception as exc:
                err = (
                    exc
                    if isinstance(exc, BatchyardError)
                    else UpstreamError(f"the engine failed ({type(exc).__name__})")
                )
                await asyncio.shield(self._fail(job, err))
                return False
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        await asyncio.shield(self._succeed(job, completion))
        return True

    async def _succeed(self, job: Claimed, completion: Completion) -> None:
        await record_success(self.db, self.clock, self.sealer(), job, completion)

    async def _fail(self, job: Claimed, exc: BatchyardError) -> None:
        await record_failure(self.db, self.clock, self.sealer(), job, exc)
