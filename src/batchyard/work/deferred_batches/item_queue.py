"""Deferred batch items as the runner sees them: the lease queue of deferred batches.

A pass of the deferred-batch worker chooses items and routes (its policy, on fresh
prices); this queue then claims them for the runner's pipeline, one claim per
chosen item, each rechecked at the moment it is taken: the deadline, the
submitting key, the route's price now (the one that authorises the spend),
the sealed body. A claimed item holds its own reservation (the most its call
can cost on that route, shown in the activity as ``dispatch``) and its own
lease. No qualifying route, no reservation: funds are never held while
waiting.

Recording an item settles its hold to real usage at the route's offered
price, or releases it on failure (``work.deferred_batches.results``). An item whose
call never started goes back to waiting with its hold released; a sent one
whose worker stopped (``let_go``) becomes ``uncertain``, charged nothing
(``work.deferred_batches.housekeeping``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog, engine_name
from batchyard.core.leases import Lease
from batchyard.core.market import RouteOffer, offer_cost, qualifies
from batchyard.core.money import from_ticks, quote_ticks
from batchyard.core.openai_bodies import ChatRequest
from batchyard.core.sealing import Sealer, SealError
from batchyard.core.telemetry import Recorder
from batchyard.core.tiers import Tier
from batchyard.engines.protocol import Completion
from batchyard.errors import BatchyardError, InsufficientCredit, InternalError
from batchyard.store import accounts, billing
from batchyard.store import deferred_batches as store
from batchyard.work.deferred_batches import housekeeping
from batchyard.work.deferred_batches.results import (
    ClaimedItem,
    fail,
    finish_failed,
    item_detail,
    succeed,
)
from batchyard.work.market_prices import MarketPrices
from batchyard.work.openai_wire import chat_request
from batchyard.work.runner import Claim, Recovered, Renewal

__all__ = ["ItemEnd", "ItemQueue", "PassReport"]

log = logging.getLogger("batchyard.deferred_batches")


@dataclass
class PassReport:
    """What one pass of the deferred-batch worker did, for logs and tests."""

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


@dataclass(frozen=True, slots=True)
class ItemEnd:
    """A dispatched item's call came back: its completion, or its error."""

    job: ClaimedItem
    completion: Completion | None = None
    error: BatchyardError | None = None


@dataclass
class ItemQueue:
    """Deferred batch items (``LeaseQueue[str, ClaimedItem, ItemEnd]``); ``chosen``: this pass's."""

    owner: str
    sealer: Sealer
    catalog: Catalog
    prices: MarketPrices
    tiers: tuple[Tier, ...]
    metrics: Recorder
    report: PassReport
    chosen: list[tuple[store.ItemRow, RouteOffer]] = field(default_factory=list)
    kind: str = "deferred"

    def claim(
        self, conn: Connection, want: int, now: datetime, until: datetime
    ) -> list[Claim[str, ClaimedItem]]:
        taken: list[Claim[str, ClaimedItem]] = []
        while self.chosen and len(taken) < want:
            cand, offer = self.chosen.pop(0)
            got = self._claim_one(conn, cand, offer, now, until)
            if got is not None:
                taken.append(Claim(got.item.id, got.lease, got))
        return taken

    def _claim_one(
        self,
        conn: Connection,
        cand: store.ItemRow,
        chosen: RouteOffer,
        now: datetime,
        until: datetime,
    ) -> ClaimedItem | None:
        """Lock a chosen item, recheck it, reserve its most, and lease it; None: not now."""
        report = self.report
        route = self.catalog.routes[chosen.route]
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
            stored = json.loads(self.sealer.open(sealed, item.id.encode()))
        except SealError as exc:
            # Sealed under another key: it can never run; say so instead of
            # failing every pass until it expires.
            err = InternalError(f"the stored request cannot be read: {exc}", retryable=False)
            finish_failed(conn, self.sealer, item, err, now)
            report.failed += 1
            return None
        amount = quote_ticks(offer_cost(offer, item.input_tokens, item.max_tokens))
        try:
            res = billing.reserve(
                conn,
                item.org_id,
                amount,
                now,
                purpose="batch",
                ref=item.id,
                tiers=self.tiers,
                record="dispatch",
                detail=item_detail(item, model=item.model, route=route.id),
                savepoint=True,
                key_id=item.key_id,
            )
        except InsufficientCredit as exc:
            finish_failed(conn, self.sealer, item, exc, now)
            report.failed += 1
            return None
        lease = store.mark_dispatched(
            conn, item, self.owner, until, route=route.id, reservation_id=res.id, now=now
        )
        report.dispatched += 1
        log.info(
            "batch item dispatched",
            extra={
                "event": "batch_item_dispatched",
                "item_id": item.id,
                "route": route.id,
                "reservation_id": res.id,
            },
        )
        return ClaimedItem(
            item=item,
            # The stored body is a chat body (the subset docs/reference/batches.md takes),
            # sent as the door sends one.
            request=chat_request(
                ChatRequest.model_validate({"model": item.model, **stored}),
                model=engine_name(item.model, route),
                max_tokens=item.max_tokens,
            ),
            route=route,
            price=offer.price,
            reservation_id=res.id,
            lease=lease,
        )

    def renew(
        self, conn: Connection, held: Mapping[str, Lease], now: datetime, until: datetime
    ) -> Renewal:
        store.renew(conn, held, until)  # an item no longer ours is fenced in every write
        return Renewal.GOING

    def record(
        self,
        conn: Connection,
        held: Mapping[str, Lease],
        results: Sequence[ItemEnd],
        now: datetime,
    ) -> int:
        for end in results:
            if end.completion is not None:
                settled = succeed(conn, self.sealer, end.job, end.completion, now)
                if settled is not None:
                    over = from_ticks(settled.over)
                    self.metrics.charged("batch", from_ticks(settled.charged), over)
            elif end.error is not None:
                fail(conn, self.sealer, end.job, end.error, now)
        return len(results)

    def mark_sent(self, conn: Connection, held: Mapping[str, Lease], now: datetime) -> set[str]:
        return store.mark_sent(conn, held, now)

    def requeue(self, conn: Connection, held: Mapping[str, Lease], now: datetime) -> int:
        back = 0
        for item_id, lease in held.items():
            item = store.dispatched_item(conn, item_id, lease)
            if item is not None:
                # Handed back by the pipeline: its call never left (see ``LeaseQueue.requeue``).
                why = "the worker gave the item back before its call left"
                back += housekeeping.unwind_unsent(conn, item, now, why, unmark=True)
        return back

    def let_go(
        self, conn: Connection, held: Mapping[str, Lease] | None, now: datetime
    ) -> Recovered:
        if held is None:
            items = store.lapsed_leases(conn, now)
            why = "the worker stopped"
        else:
            found = (store.dispatched_item(conn, i, lease) for i, lease in held.items())
            items = [item for item in found if item is not None]
            why = "the worker stopped (its grace period ended)"
        uncertain = returned = 0
        for item in items:
            if item.sent_at is not None:
                note = f"{why} during the call; its outcome is unknown"
                uncertain += housekeeping.settle_as_uncertain(conn, item, now, note)
            else:
                returned += housekeeping.unwind_unsent(conn, item, now, f"{why} before the call")
        self.report.uncertain += uncertain
        self.report.returned += returned
        return Recovered(leases=uncertain + returned, uncertain=uncertain, returned=returned)

    def lapsed(self, conn: Connection, now: datetime) -> bool:
        return bool(store.lapsed_leases(conn, now, lock=False))
