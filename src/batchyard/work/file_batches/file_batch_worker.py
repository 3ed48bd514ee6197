"""The file-batch worker: lines claimed under leases, answered, and the batch finalized.

Each round, in order:

1. *Recover.* A dispatched line whose lease lapsed (its worker died mid-call)
   becomes ``uncertain`` with its error-file line if its call was sent (each
   line is marked sent, durably, just before its engine call); it is never
   sent again and never charged, and an activity record names it. A lapsed
   line that was never sent goes back to pending.
2. *Step the batches.* A cancelled batch's unsent lines are ``canceled``; past
   its window, an unfinished batch's unsent lines are ``expired`` with
   OpenAI's ``batch_expired``; a batch whose creating key was revoked is
   cancelled. A batch with no line left to answer is *finalized* in one
   transaction: the reservation is settled to the sum of its lines' charges
   (the rest released), its output and error files are written from the
   lines' rendered results, and it ends ``completed``, ``expired`` or
   ``canceled`` (OpenAI's ``cancelled`` on the wire).
3. *Execute.* Batches with unsent lines get a task each (up to
   ``max_active``). A task runs the runner's claim pipeline (``work.runner``)
   over the batch's ``LineQueue``: lines claimed under leases of their own,
   called concurrently through the dispatcher (the route's pace is the only
   limit), and recorded with their usage, charge and result in the
   transaction that renews the leases and claims the next lines: several
   workers share one batch, and a line is written once, by the worker that
   holds it (every write is fenced by the line's lease).

A batch that waits for a discount (``metadata.min_discount``) claims lines
only while a route's fresh price meets it (``lines.plan_for``). A batch whose
window is longer than 24 h waits for a price as a deferred item does: until 24 h
are left, the deferred batches' policy (``core.market``) says, per model, on each
claim, whether its lines go now and on which route, at the route's offered
price (``lines.plan_by_policy``); then they go as a 24 h batch's do.

``drain`` is the graceful stop (the runner's, ``work.runner``): nothing more
is claimed or sent, lines in flight land, and lines claimed but not sent go
back to pending at once; a line the grace period cuts off mid-call is
``uncertain`` at once, as a run's row or a deferred item is.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from decimal import Decimal
from functools import partial

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.ids import new_id
from batchyard.core.market import FirstEligible, Item, Policy
from batchyard.core.money import from_ticks
from batchyard.core.sealing import Sealer
from batchyard.core.sections import FileBatchSettings
from batchyard.store import accounts, billing, webhook_deliveries
from batchyard.store import file_batches as store
from batchyard.store import files as file_store
from batchyard.store.database import Database
from batchyard.work.batch_key import BatchKey
from batchyard.work.dispatcher import Dispatcher, OnSend
from batchyard.work.file_batches import lines
from batchyard.work.file_batches.line_queue import Line, LineQueue
from batchyard.work.market_prices import MarketPrices
from batchyard.work.runner import Answered, Ended, Failed, NotSent, Runner, recover_lapsed

__all__ = ["FileBatchWorker"]

log = logging.getLogger("batchyard.file_batches")

#: How often uploads abandoned mid-way and files past their expiry are deleted.
SWEEP_EVERY = timedelta(minutes=1)
#: An upload still invisible this long after it began belongs to a dead process.
STALE_UPLOAD = timedelta(hours=1)


class FileBatchWorker(Runner):
    """One process's share of the file-batch work: the runner's loop over file batches' rules."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        dispatcher: Dispatcher,
        key: BatchKey,
        prices: MarketPrices,
        policy: Policy | None = None,
        settings: FileBatchSettings | None = None,
        owner: str | None = None,
    ) -> None:
        self.settings = settings or FileBatchSettings()
        super().__init__(name="file_batches", clock=clock, poll_s=self.settings.poll_s, owner=owner)
        self.db = db
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.key = key
        self.prices = prices
        self.policy: Policy = policy if policy is not None else FirstEligible()
        self._swept: datetime | None = None
        self.pipeline = self.new_pipeline(
            db,
            dispatcher.metrics,
            lease_s=self.settings.lease_s,
            flush_s=self.settings.flush_s,
            unavailable_retries=dispatcher.upstream_unavailable_retries,
        )

    # -- the rounds ---------------------------------------------------------------------

    async def opening(self) -> bool:
        return self.key.available

    async def round(self) -> bool:
        """Recover, step the batches, start executing (see the module docstring)."""
        await self.recover()
        if self.draining:
            return False
        now = self.clock.now()
        if self._swept is None or now - self._swept >= SWEEP_EVERY:
            await self.sweep_files(now)
        live = await self.db.read(store.live_batches)
        for batch in live:
            await self._step(batch, now)
        if live:
            live = await self.db.read(store.live_batches)
        for batch in live:
            if len(self.active) >= self.settings.max_active:
                break
            if batch.id in self.active or batch.status != "in_progress":
                continue
            if now >= batch.expires_at or not await self._has_pending(batch.id):
                continue
            waits = batch.min_discount or lines.waits_until(batch.created_at, batch.expires_at)
            if waits and not await self._market_open(batch):
                continue  # no route meets the discount now; a later round looks again
            self.start(batch.id, self._execute(batch))
        return False

    async def _market_open(self, batch: store.BatchRow) -> bool:
        """Whether any of the batch's models has a route to go to now (``_plan``)."""
        models = await self.db.read(lambda c: store.models_of(c, batch.id))
        return any(self._plan(batch, m) is not None for m in models)

    async def _has_pending(self, batch_id: str) -> bool:
        totals = await self.db.read(lambda c: store.totals(c, [batch_id]))
        return totals[batch_id].per_state["pending"] > 0

    # -- recovery and the batches' own steps -------------------------------------------------

    async def recover(self) -> int:
        """Lines whose worker stopped renewing: ``uncertain`` if sent (never re-sent, not
        charged), waiting again if not; how many became uncertain."""
        queue = LineQueue(self.key.require(), chunk=self.settings.end_chunk)
        recovered = await recover_lapsed(self.db, self.clock, self.dispatcher.metrics, queue)
        return recovered.uncertain

    async def sweep_files(self, now: datetime) -> tuple[int, int]:
        """Delete uploads a dead process left half-written, and files past ``expires_after``.

        A file a running batch still reads is kept until the batch ends.
        """
        self._swept = now

        def tx(c: Connection) -> tuple[int, int]:
            stale = file_store.stale_uploads(c, now - STALE_UPLOAD)
            for file_id in stale:
                file_store.forget(c, file_id)
            expired = [
                f for f in file_store.expired_files(c, now) if not store.live_batch_reads(c, f)
            ]
            for file_id in expired:
                file_store.mark_deleted(c, file_id, now)
            return len(stale), len(expired)

        return await self.db.transact(tx)

    async def _step(self, batch: store.BatchRow, now: datetime) -> None:
        if batch.status == "in_progress":
            revoked = not await self.db.read(lambda c: accounts.key_is_active(c, batch.key_id))
            if revoked:
                await self.db.transact(
                    lambda c: store.set_status(
                        c, batch.id, "canceling", expect=("in_progress",), cancelling_at=now
                    )
                )
                batch = await self.db.read(partial(_reload, batch=batch))
        if batch.status == "canceling":
            await self._end_pending(batch, "canceled", now)
        elif now >= batch.expires_at:
            await self._end_pending(batch, "expired", now)
        if batch.id not in self._active:  # an executing task finalizes when it ends
            await self._finalize(batch.id)

    async def _end_pending(self, batch: store.BatchRow, state: str, now: datetime) -> None:
        sealer = self.key.require()
        chunk = self.settings.end_chunk

        def tx(c: Connection) -> int:
            pending = store.pending_lines(c, batch.id, chunk)
            ended = [
                lines.never_answered(sealer, batch.id, ln, cid, state, now) for ln, cid in pending
            ]
            store.end_lines(c, batch.id, "pending", ended, now)
            return len(pending)

        while await self.db.transact(tx) == chunk:
            pass

    async def _finalize(self, batch_id: str) -> str | None:
        """Settle and write the result files once no line is left; the final status."""
        now = self.clock.now()
        per = (await self.db.read(lambda c: store.totals(c, [batch_id])))[batch_id].per_state
        if per["pending"] or per["dispatched"]:
            return None  # a cheap read first: most rounds have lines left

        def tx(c: Connection) -> str | None:
            batch = store.load_batch(c, batch_id, lock=True)
            if batch is None or batch.status not in ("in_progress", "canceling", "finalizing"):
                return None
            totals = store.totals(c, [batch_id])[batch_id]
            per = totals.per_state
            if per["pending"] or per["dispatched"]:
                return None
            charged = 0
            if batch.reservation_id is not None:
                settled = billing.settle(
                    c,
                    batch.reservation_id,
                    totals.charge,
                    now,
                    ref=batch_id,
                    detail={
                        "purpose": "file_batch",
                        "lines": per["succeeded"],
                        "uncertain": per["uncertain"],
                        "input_tokens": totals.input_tokens,
                        "output_tokens": totals.output_tokens,
                    },
                    if_held=True,
                )
                charged = settled.charged
                if settled.now:
                    over = from_ticks(settled.over)
                    self.dispatcher.metrics.charged("file_batch", from_ticks(charged), over)
            files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
            halves = (
                ("output", per["succeeded"], totals.output_bytes),
                ("error", sum(per.values()) - per["succeeded"], totals.error_bytes),
            )
            for kind, count, size in halves:
                if not count:
                    continue
                file_id = new_id("file", now)
                file_store.create_file(
                    c,
                    file_id=file_id,
                    org_id=batch.org_id,
                    purpose="batch_output",
                    filename=f"{batch_id}_{kind}.jsonl",
                    now=now,
                    status="processed",
                    size=size,
                    line_count=count,
                    endpoint=batch.endpoint,
                    batch_id=batch_id,
                    kind=kind,
                    key_id=batch.key_id,
                )
                files[f"{kind}_file_id"] = file_id
            if batch.status == "canceling":
                final, stamp = "canceled", {"cancelled_at": now}
            elif per["expired"]:
                final, stamp = "expired", {"expired_at": now}
            else:
                final, stamp = "completed", {"completed_at": now}
            store.set_status(
                c,
                batch_id,
                final,
                expect=(batch.status,),
                finalizing_at=now,
                charge=charged,
                **files,
                **stamp,
            )
            # The webhooks of its end, in the transaction that ends it (the outbox).
            webhook_deliveries.batch_ended(c, batch_id, now)
            return final

        final = await asyncio.shield(self.db.transact(tx))
        if final:
            log.info("file batch finished", extra={"batch_id": batch_id, "status": final})
        return final

    # -- executing -------------------------------------------------------------------------

    def _plan(self, batch: store.BatchRow, model: str) -> lines.LinePlan | None:
        """Where a line of ``model`` goes now (None while it waits for a price)."""
        now = self.clock.now()
        min_discount = Decimal(batch.min_discount) if batch.min_discount else None
        until = lines.waits_until(batch.created_at, batch.expires_at)
        if until is not None and now < until:
            # The batch's lines of one model, as one deferred item (a line's own size is
            # not known before its claim; 1000 and 1000 tokens rank routes as plan_for does).
            item = Item(
                id=f"{batch.id}/{model}",
                min_discount=min_discount or Decimal(0),
                deadline=until,
                submitted_at=batch.created_at,
                input_tokens=1000,
                max_output_tokens=1000,
            )
            return lines.plan_by_policy(self.catalog, self.prices, self.policy, item, model, now)
        return lines.plan_for(self.catalog, self.prices, model, min_discount, now)

    async def _call(
        self, batch: store.BatchRow, sealer: Sealer, line: Line, on_send: OnSend
    ) -> lines.LineAnswer:
        if line.plan is None:  # the market moved: back to waiting, never sent
            raise NotSent("no route meets the batch's discount or the policy now", stop=True)
        return await lines.call(
            self.dispatcher,
            sealer,
            batch.endpoint,
            batch.input_file_id,
            line.claimed,
            line.plan,
            on_send,
        )

    def _result(
        self,
        batch: store.BatchRow,
        sealer: Sealer,
        line: Line,
        attempt: Answered[lines.LineAnswer] | Failed,
    ) -> store.LineEnd:
        assert line.plan is not None  # a line without a route is never called
        return lines.result(sealer, batch.id, line.claimed, line.plan, attempt, self.clock.now())

    async def _execute(self, batch: store.BatchRow) -> None:
        """Answer the batch's lines with the others sharing it; see the module docstring."""
        sealer = self.key.require()
        first = await self.db.read(lambda c: store.pending_lines(c, batch.id, 1))
        if not first:
            return
        models = await self.db.read(lambda c: store.models_of(c, batch.id))
        routes = [p.route for m in models if (p := self._plan(batch, m)) is not None]
        if not routes:
            return  # no route meets the discount now; a later round looks again
        width = max(self.dispatcher.concurrency(r) or self.settings.concurrency for r in routes)
        queue = LineQueue(
            sealer,
            owner=self.owner,
            batch=batch,
            plan=partial(self._plan, batch),
            chunk=self.settings.end_chunk,
        )
        ran = await self.pipeline.run(
            queue,
            width=width,
            call=partial(self._call, batch, sealer),
            render=partial(self._result, batch, sealer),
        )
        if ran.ended is Ended.HANDED_OVER:
            return  # drained: what was not sent waits for the next worker
        await self._finalize(batch.id)


def _reload(c: Connection, *, batch: store.BatchRow) -> store.BatchRow:
    return store.load_batch(c, batch.id) or batch
