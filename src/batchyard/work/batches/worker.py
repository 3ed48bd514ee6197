"""The market worker: dispatch waiting items when a route meets their discount.

Each pass, in order:

1. *Recover.* A dispatched item whose lease lapsed becomes ``uncertain``,
   its reservation still held, if its call was sent; nothing is retried or
   released. One that was never sent goes back to waiting and its hold is
   released (``work.batches.housekeeping``).
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
   The item is marked sent durably just before its engine call. The lease is
   renewed while the call runs. The result is settled to real usage at the
   route's offered price in one transaction with the item's result and its
   activity record; a failure is released and recorded, and never retried
   (``work.batches.results``).

A crash mid-call leaves the item ``dispatched``; the lease lapses and the
next pass of any worker makes it ``uncertain`` (sent) or waiting again (not
sent). A graceful stop (``drain``) claims nothing more and sends nothing
more: items still waiting for their turn go back to waiting at once, calls
in flight may finish until the grace period ends, and only those cut off
then become ``uncertain``. Without a batch encryption key
(``work.batches.sealing``) the worker does nothing and the door answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog, engine_name
from batchyard.core.clock import Clock
from batchyard.core.market import (
    Item,
    LearningPolicy,
    Policy,
    RouteOffer,
    offer_cost,
    qualifies,
)
from batchyard.core.money import from_ticks, quote_ticks
from batchyard.core.openai_bodies import ChatRequest
from batchyard.core.sealing import Sealer, SealError
from batchyard.core.tiers import Tier
from batchyard.engines.base import Completion
from batchyard.errors import (
    BatchyardError,
    InsufficientCredit,
    InternalError,
    LimiterUnavailable,
    StorageUnavailable,
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
from batchyard.work.openai_wire import chat_request

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
    #: Dispatched items never sent, back to waiting with their holds released.
    returned: int = 0
    expired: int = 0
    canceled: int = 0
    purged: int = 0
    dispatched: int = 0
    succeeded: int = 0
    failed: int = 0
    waiting: int = 0


class _NotSent(Exception):
    """The call was not made: the item goes back to waiting."""


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
        #: Set by ``drain``: claim nothing more, send nothing more.
        self.draining = False
        self._jobs: set[asyncio.Task[bool | None]] = set()

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
            while not self.draining:
                report: PassReport | None = None
                try:
                    report = await self.run_pass()
                except asyncio.CancelledError:
                    raise
                except StorageUnavailable as exc:
                    # An outage, not a bug: no traceback; the next pass reconnects.
                    log.warning(
                        "store unavailable; the worker waits for it",
                        extra={"event": "market_pass_error", "code": exc.code},
                    )
                except Exception:
                    log.exception("market pass failed", extra={"event": "market_pass_error"})
                # A full pass suggests more work is ready; otherwise wait for the market.
                if not self.draining and (report is None or report.dispatched < self.per_pass):
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

    def drain(self) -> None:
        """Stop claiming and sending; calls already sent go on (see ``wait_idle``)."""
        self.draining = True

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to ``grace_s`` seconds for the calls in flight; True if none is left."""
        jobs = [j for j in self._jobs if not j.done()]
        if jobs:
            await asyncio.wait(jobs, timeout=grace_s)
        return all(j.done() for j in self._jobs)

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
        claimed: list[Claimed] = []
        for candidate, offer in chosen:
            if self.draining:
                break
            got = await self._claim(candidate, offer, report)
            if got is not None:
                claimed.append(got)
        report.dispatched = len(claimed)
        if claimed:
            jobs = [asyncio.create_task(self._execute(c)) for c in claimed]
            self._jobs.update(jobs)
            try:
                outcomes = await asyncio.gather(*jobs)
            finally:
                self._jobs.difference_update(jobs)
            report.succeeded = sum(1 for ok in outcomes if ok is True)
            report.failed += sum(1 for ok in outcomes if ok is False)
            report.returned += sum(1 for ok in outcomes if ok is None)
        if any(
            (report.dispatched, report.expired, report.canceled, report.uncertain, report.returned)
        ):
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
                    "returned": report.returned,
                },
            )
        return report

    # --- recovery and housekeeping -------------------------------------------------------

    async def recover(self, report: PassReport | None = None) -> int:
        """Lapsed dispatches: sent ones ``uncertain`` (hold kept), unsent ones waiting again."""
        uncertain, returned = await housekeeping.recover_lapsed(self.db, self.clock)
        self.dispatcher.metrics.leases_recovered("deferred", uncertain + returned)
        self.dispatcher.metrics.uncertain("deferred", uncertain)
        if report is not None:
            report.uncertain += uncertain
            report.returned += returned
        return uncertain

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
            token = store.mark_dispatched(
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
                # The stored body is a chat body (seed 003's subset), sent as the door sends one.
                request=chat_request(
                    ChatRequest.model_validate({"model": item.model, **stored}),
                    model=engine_name(item.model, route),
                    max_tokens=item.max_tokens,
                ),
                route=route,
                price=offer.price,
                reservation_id=res.id,
                token=token,
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

    async def _heartbeat(self, item_id: str, token: int) -> None:
        """Renew the item's lease under its claim's token until it is lost (or the call ends)."""
        clock, db = self.clock, self.db
        lease = self.lease

        def renew(conn: Connection) -> bool:
            return store.extend_lease(conn, item_id, token, clock.now() + lease)

        while True:
            await clock.sleep(lease.total_seconds() / 3)
            try:
                if not await db.transact(renew):
                    return  # no longer ours: the write of its result is fenced too
            except StorageUnavailable:
                # The store is down: the next beat tries again. (Raising here would
                # surface from the call's ``finally`` and lose an answer in hand.)
                log.warning("could not renew a batch item's lease; the store is unavailable")

    async def _execute(self, job: Claimed) -> bool | None:
        """Call, then settle or release with the item's result.

        True on success, False on a failure, None when the call was never sent
        (the worker is draining, or the item is no longer ours).
        """
        heartbeat = asyncio.create_task(self._heartbeat(job.item.id, job.token))
        sent = False

        async def on_send() -> None:
            nonlocal sent
            if self.draining:
                raise _NotSent("the worker is stopping")
            now = self.clock.now()
            ours = await self.db.write(
                lambda c: store.mark_sent(c, job.item.id, job.reservation_id, job.token, now)
            )
            if not ours:
                raise _NotSent("the item is no longer this worker's")
            sent = True

        try:
            try:
                completion = await self.dispatcher.call(
                    route=job.route,
                    request=job.request,
                    input_tokens=job.item.input_tokens,
                    on_send=on_send,
                )
            except asyncio.CancelledError:
                if self.draining:
                    # The grace period ended with this call in flight (or not yet sent).
                    await asyncio.shield(self._cut_off(job, sent=sent))
                # Otherwise a crash-like stop: the lease lapses and recovery decides.
                raise
            except _NotSent as exc:
                await asyncio.shield(self._cut_off(job, sent=False, why=str(exc)))
                return None
            except Exception as exc:
                if not sent and isinstance(exc, StorageUnavailable | LimiterUnavailable):
                    # The store refused the mark: nothing reached the engine, so the
                    # item waits again rather than failing for a call never made.
                    await asyncio.shield(self._cut_off(job, sent=False, why=type(exc).__name__))
                    return None
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

    async def _cut_off(self, job: Claimed, *, sent: bool, why: str = "the worker stopped") -> None:
        """End a dispatch that did not finish: uncertain if sent, else waiting again."""
        now = self.clock.now()

        def tx(conn: Connection) -> None:
            item = store.dispatched_item(conn, job.item.id, job.reservation_id, job.token)
            if item is None:
                return  # already settled, failed or recovered by someone else
            if sent or item.sent_at is not None:
                housekeeping.settle_as_uncertain(
                    conn, item, now, f"{why} during the call; its outcome is unknown"
                )
            else:
                housekeeping.unwind_unsent(conn, item, now, why)

        try:
            await self.db.transact(tx)
        except BatchyardError:
            # The store is down: the lease lapses and the next pass decides the same way.
            log.warning("could not end a cut-off dispatch", extra={"event": "batch_cut_off_failed"})

    async def _succeed(self, job: Claimed, completion: Completion) -> None:
        charged = await record_success(self.db, self.clock, self.sealer(), job, completion)
        self.dispatcher.metrics.charged("batch", from_ticks(charged))

    async def _fail(self, job: Claimed, exc: BatchyardError) -> None:
        await record_failure(self.db, self.clock, self.sealer(), job, exc)
