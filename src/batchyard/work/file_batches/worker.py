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
   ``max_active``). A task claims lines (``FOR UPDATE SKIP LOCKED`` on
   PostgreSQL) under this worker's lease, calls them concurrently through the
   dispatcher (the route's pace is the only limit), and records finished
   lines with their usage, charge and result in the transaction that renews
   its leases and claims the next lines: several workers share one batch, and
   a line is written once, by the worker that holds it (``record_results`` is
   fenced by the lease).

A batch that waits for a discount (``metadata.min_discount``) claims lines
only while a route's fresh price meets it (``lines.plan_for``).

``drain`` is the graceful stop: nothing more is claimed or sent, lines in
flight land, and lines claimed but not sent go back to pending at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog
from batchyard.core.clock import Clock
from batchyard.core.ids import new_id
from batchyard.core.money import from_ticks
from batchyard.errors import BatchyardError, StorageUnavailable
from batchyard.store import accounts, activity, ledger
from batchyard.store import file_batches as store
from batchyard.store import files as file_store
from batchyard.store.database import Database
from batchyard.work.batches.prices import MarketPrices
from batchyard.work.batches.sealing import BatchKey
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.file_batches.lines import NotSent, Plan, answer, never_answered, plan_for
from batchyard.work.sending import SentMarks

__all__ = ["FileBatchSettings", "FileBatchWorker"]

log = logging.getLogger("batchyard.file_batches")

#: How often uploads abandoned mid-way and files past their expiry are deleted.
SWEEP_EVERY = timedelta(minutes=1)
#: An upload still invisible this long after it began belongs to a dead process.
STALE_UPLOAD = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class FileBatchSettings:
    """Timings and widths; an operator sets them under ``file_batches:`` in the config."""

    #: Seconds between idle rounds.
    poll_s: float = 0.5
    #: How long a worker may go silent before its in-flight lines become uncertain.
    lease_s: float = 60.0
    #: Finished lines are committed this often (or when half the slots are free).
    flush_s: float = 0.25
    #: Calls in flight per batch when the route names no concurrency of its own.
    concurrency: int = 32
    #: Batches one worker executes at once.
    max_active: int = 2
    #: Lines ended (expired, canceled, uncertain) per transaction.
    end_chunk: int = 1000

    @classmethod
    def from_raw(cls, raw: Any) -> FileBatchSettings:
        given: dict[str, Any] = {}
        for k, v in dict(raw or {}).items():
            if k in ("poll_s", "lease_s", "flush_s"):
                given[k] = float(v)
            elif k in cls.__dataclass_fields__:
                given[k] = int(v)
        return cls(**given)


class FileBatchWorker:
    """One process's share of the file-batch work; ``run_forever`` is its loop."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        dispatcher: Dispatcher,
        key: BatchKey,
        prices: MarketPrices,
        settings: FileBatchSettings | None = None,
        embedded_contexts: int = 1,
        owner: str | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.key = key
        self.prices = prices
        self.settings = settings or FileBatchSettings()
        self.embedded_contexts = embedded_contexts
        self.owner = owner or new_id("wkr", clock.now())
        self._active: dict[str, asyncio.Task[None]] = {}
        self._wake: asyncio.Event | None = None
        self._swept: datetime | None = None
        #: Set by ``drain``: claim nothing more, send nothing more.
        self.draining = False

    # -- the loop ----------------------------------------------------------------------

    def notify(self) -> None:
        """Wake the loop now (a batch was created or cancelled)."""
        if self._wake is not None:
            self._wake.set()

    async def run_forever(self) -> None:
        if not self.key.available:
            return
        self._wake = asyncio.Event()
        try:
            while True:
                try:
                    await self.tick()
                except StorageUnavailable as exc:
                    # An outage, not a bug: no traceback; the next round reconnects.
                    log.warning(
                        "store unavailable; the worker waits for it",
                        extra={"worker": self.owner, "code": exc.code},
                    )
                except Exception:
                    log.exception("file batch round failed", extra={"worker": self.owner})
                # A poll interval, not a time rule: deadlines and leases read the clock.
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
        """Stop claiming and sending; lines in flight go on (see ``wait_idle``)."""
        self.draining = True
        self.notify()

    async def wait_idle(self, grace_s: float) -> bool:
        """Wait up to ``grace_s`` seconds for the batches in hand; True if none is left."""
        tasks = [t for t in self._active.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        return all(t.done() for t in self._active.values())

    async def stop(self) -> None:
        """Abandon the batches in hand as a crash would: their leases lapse."""
        tasks = list(self._active.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._active.clear()

    async def tick(self) -> int:
        """One round (see the module docstring); returns how many batches are executing."""
        for batch_id, task in list(self._active.items()):
            if task.done():
                del self._active[batch_id]
                if not task.cancelled() and task.exception() is not None:
                    log.error(
                        "file batch task failed",
                        extra={"batch_id": batch_id, "error": repr(task.exception())},
                    )
        await self.recover()
        if self.draining:
            return len(self._active)
        now = self.clock.now()
        if self._swept is None or now - self._swept >= SWEEP_EVERY:
            await self.sweep_files(now)
        live = await self.db.read(store.live_batches)
        for batch in live:
            await self._step(batch, now)
        if live:
            live = await self.db.read(store.live_batches)
        for batch in live:
            if len(self._active) >= self.settings.max_active:
                break
            if batch.id in self._active or batch.status != "in_progress":
                continue
            if now >= batch.expires_at or not await self._has_pending(batch.id):
                continue
            if batch.min_discount and not await self._market_open(batch):
                continue  # no route meets the discount now; a later round looks again
            self._active[batch.id] = asyncio.create_task(
                self._execute(batch), name=f"file batch {batch.id}"
            )
        return len(self._active)

    async def run_until_idle(self, *, rounds: int = 10_000) -> None:
        """Work until nothing is left to start or finish (tests, benchmarks)."""
        for _ in range(rounds):
            if not await self.tick():
                await self.tick()  # finalize what the last task finished
                return
            await asyncio.wait(list(self._active.values()), return_when=asyncio.FIRST_COMPLETED)

    async def _market_open(self, batch: store.BatchRow) -> bool:
        """Whether a route's fresh price meets the batch's discount for any of its models."""
        models = await self.db.read(lambda c: store.models_of(c, batch.id))
        discount = Decimal(str(batch.min_discount))
        now = self.clock.now()
        return any(plan_for(self.catalog, self.prices, m, discount, now) for m in models)

    async def _has_pending(self, batch_id: str) -> bool:
        totals = await self.db.read(lambda c: store.totals(c, [batch_id]))
        return totals[batch_id].per_state["pending"] > 0

    # -- recovery and the batches' own steps -------------------------------------------------

    async def recover(self) -> int:
        """Lines whose worker stopped renewing: ``uncertain``, never re-sent, not charged."""
        sealer = self.key.require()
        now = self.clock.now()
        # A cheap read first, so an idle worker does not queue a write every round.
        if not await self.db.read(lambda c: store.lapsed_lines(c, now, 1, lock=False)):
            if await self.db.read(lambda c: store.has_unsent_lapsed(c, now)):
                await self.db.transact(lambda c: store.requeue_unsent(c, now))
            return 0

        def tx(c: Connection) -> int:
            lapsed = store.lapsed_lines(c, now, self.settings.end_chunk)
            by_batch: dict[str, list[store.Ended]] = {}
            for batch_id, line, custom_id in lapsed:
                ended = never_answered(sealer, batch_id, line, custom_id, "uncertain", now)
                by_batch.setdefault(batch_id, []).append(ended)
            store.requeue_unsent(c, now)  # lapsed but never sent: they wait again
            for batch_id, ends in by_batch.items():
                store.end_lines(c, batch_id, "dispatched", ends, now)
                batch = store.load_batch(c, batch_id)
                if batch is not None:
                    activity.record(
                        c,
                        batch.org_id,
                        "uncertain",
                        now,
                        ref=batch_id,
                        reservation_id=batch.reservation_id,
                        detail={"lines": [e.line for e in ends][:100], "count": len(ends)},
                    )
            return len(lapsed)

        n = await self.db.transact(tx)
        self.dispatcher.metrics.leases_recovered("file_batches", n)
        self.dispatcher.metrics.uncertain("file_batches", n)
        if n:
            log.warning("file batch lines uncertain", extra={"lines": n, "worker": self.owner})
        return n

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
            ended = [never_answered(sealer, batch.id, ln, cid, state, now) for ln, cid in pending]
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
                res = ledger.get_reservation(c, batch.reservation_id, lock=True)
                if res.state == "held":
                    charged = (
                        ledger.settle(c, batch.reservation_id, totals.charge, now).charged or 0
                    )
                    self.dispatcher.metrics.charged("file_batch", from_ticks(charged))
                    activity.record(
                        c,
                        batch.org_id,
                        "charge",
                        now,
                        ref=batch_id,
                        reservation_id=batch.reservation_id,
                        amount=charged,
                        detail={
                            "purpose": "file_batch",
                            "lines": per["succeeded"],
                            "uncertain": per["uncertain"],
                            "input_tokens": totals.input_tokens,
                            "output_tokens": totals.output_tokens,
                        },
                    )
                else:
                    charged = res.charged or 0
            files: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
            halves = (
                ("output", per["succeeded"], totals.output_bytes),
                ("error", sum(per.values()) - per["succeeded"], totals.error_bytes),
            )
            for kind, lines, size in halves:
                if not lines:
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
                    line_count=lines,
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
            return final

        final = await asyncio.shield(self.db.transact(tx))
        if final:
            log.info("file batch finished", extra={"batch_id": batch_id, "status": final})
        return final

    # -- executing -------------------------------------------------------------------------

    def _width(self, plan: Plan) -> int:
        if plan.route.concurrency:
            return plan.route.concurrency
        if plan.route.engine == "llama_cpp":
            return max(1, self.embedded_contexts)
        return self.settings.concurrency

    def _lease_until(self) -> datetime:
        return self.clock.now() + timedelta(seconds=self.settings.lease_s)

    async def _execute(self, batch: store.BatchRow) -> None:
        """Answer the batch's lines with the others sharing it; see the module docstring."""
        sealer = self.key.require()
        min_discount = Decimal(batch.min_discount) if batch.min_discount else None
        plans: dict[str, Plan | None] = {}

        def plan(model: str) -> Plan | None:
            if model not in plans:
                plans[model] = plan_for(
                    self.catalog, self.prices, model, min_discount, self.clock.now()
                )
            return plans[model]

        first = await self.db.read(lambda c: store.pending_lines(c, batch.id, 1))
        if not first:
            return
        models = await self.db.read(lambda c: store.models_of(c, batch.id))
        widths = [self._width(p) for m in models if (p := plan(m)) is not None]
        if not widths:
            return  # no route meets the discount now; a later round looks again
        width = max(widths)
        loop = asyncio.get_running_loop()
        flying: set[asyncio.Task[store.Ended | None]] = set()
        line_of: dict[asyncio.Task[store.Ended | None], int] = {}
        requeue: list[int] = []
        stepping: asyncio.Task[tuple[str | None, list[store.Claimed]]] | None = None
        done: list[store.Ended] = []
        stop = exhausted = False
        asked, last = 0, float("-inf")
        interval = self.settings.flush_s
        owner = self.owner
        # The lines this loop holds, each with the fencing token of its claim:
        # every write of a line (sent mark, result, renewal, unclaim) names it.
        held: dict[int, int] = {}
        marks: SentMarks[int] = SentMarks(
            self.db,
            self.clock,
            lambda c, keys, now: store.mark_lines_sent(c, batch.id, keys, owner, held, now),
        )

        async def on_send(line: int) -> None:
            if stop or self.draining or not await marks.mark(line):
                raise NotSent

        try:
            while True:
                idle = stop or exhausted or self.draining
                if stepping is None:
                    due = loop.time() - last >= interval
                    claim = not idle and len(flying) <= width - max(1, width // 4)
                    if claim or due or (done and not flying):
                        asked = 0 if idle else width - len(flying)
                        stepping = asyncio.create_task(self._round(batch, held, done, asked))
                        done, last = [], loop.time()
                    elif idle and not flying:
                        break
                waiting: set[asyncio.Task[Any]] = set(flying)
                if stepping is not None:
                    waiting.add(stepping)
                timeout = max(0.0, last + interval - loop.time())
                finished, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in finished:
                    if task is stepping:
                        stepping = None
                        plans.clear()  # prices are read afresh for each round's claims
                        status, claimed = task.result()
                        if status != "in_progress" or self.clock.now() >= batch.expires_at:
                            stop = True
                        exhausted = exhausted or (asked > 0 and len(claimed) < asked)
                        for line in claimed:
                            p = plan(line.model)
                            if p is None:  # the market moved: back to waiting, never sent
                                await self.db.transact(
                                    partial(
                                        store.unclaim,
                                        batch_id=batch.id,
                                        owner=self.owner,
                                        line=line.line,
                                        token=held.pop(line.line, line.token),
                                    )
                                )
                                stop = True
                                continue
                            job = asyncio.create_task(
                                answer(
                                    dispatcher=self.dispatcher,
                                    sealer=sealer,
                                    endpoint=batch.endpoint,
                                    batch_id=batch.id,
                                    input_file_id=batch.input_file_id,
                                    claimed=line,
                                    plan=p,
                                    now_of=self.clock.now,
                                    on_send=partial(on_send, line.line),
                                )
                            )
                            flying.add(job)
                            line_of[job] = line.line
                        continue
                    flying.discard(task)
                    ended = task.result()
                    if ended is None:  # never sent: it waits again
                        requeue.append(line_of[task])
                        exhausted = False
                    else:
                        done.append(ended)
                if requeue:
                    lines, requeue = requeue, []
                    tokens = {line: held.pop(line) for line in lines if line in held}
                    await self.db.transact(partial(_unclaim_all, batch.id, owner, tokens))
        except asyncio.CancelledError:
            if self.draining:
                # Cut off by the end of a drain's grace period: what never reached the
                # engine waits again now; what did becomes uncertain when its lease lapses.
                with contextlib.suppress(BatchyardError):
                    await asyncio.shield(
                        self.db.transact(
                            lambda c: store.requeue_unsent(
                                c, self.clock.now(), batch_id=batch.id, owner=owner, held=held
                            )
                        )
                    )
            raise
        finally:
            for task in flying:
                task.cancel()
            if stepping is not None:
                stepping.cancel()
        if self.draining and not exhausted:
            if done:
                await self._round(batch, held, done, 0)  # record what landed; the rest waits
            return
        await self._finalize(batch.id)

    async def _round(
        self,
        batch: store.BatchRow,
        held: dict[int, int],
        done: list[store.Ended],
        free: int,
    ) -> tuple[str | None, list[store.Claimed]]:
        """Record finished lines, renew the leases, claim more: one transaction.

        ``held`` (line → fencing token) is the loop's own: ended lines leave it
        once the transaction commits, claimed ones join it.
        """
        now, until = self.clock.now(), self._lease_until()
        owner = self.owner
        tokens = dict(held)
        ended = {e.line for e in done}

        def tx(c: Connection) -> tuple[str | None, list[store.Claimed], int]:
            status = store.heartbeat(c, batch.id, owner, tokens, until)
            recorded = store.record_results(c, batch.id, owner, tokens, done, now)
            if status != "in_progress" or now >= batch.expires_at:
                return status, [], recorded
            return status, store.claim_lines(c, batch, owner, free, now, until), recorded

        status, claimed, recorded = await asyncio.shield(self.db.transact(tx))
        if recorded < len(done):
            # Their leases lapsed (or were claimed again): another claim decides them.
            log.warning(
                "file batch line leases lost",
                extra={"batch_id": batch.id, "lines": len(done) - recorded, "worker": owner},
            )
        for line in ended:
            held.pop(line, None)
        held.update((c.line, c.token) for c in claimed)
        return status, claimed


def _unclaim_all(batch_id: str, owner: str, tokens: dict[int, int], c: Connection) -> None:
    """Claimed lines that were never sent go back to pending (each under its claim's token)."""
    for line, token in tokens.items():
        store.unclaim(c, batch_id=batch_id, owner=owner, line=line, token=token)


def _reload(c: Connection, *, batch: store.BatchRow) -> store.BatchRow:
    return store.load_batch(c, batch.id) or batch
