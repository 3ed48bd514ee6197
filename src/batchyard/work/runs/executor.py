"""Executing a queued run: answering its rows, then writing outputs and settling.

Rows are dispatched concurrently (the embedded engine's pool of contexts, or
the route's concurrency) through ``dispatcher.call``, which paces each route
by its limits. Finished rows are written with their usage in the same
transaction that marks them succeeded, batched with the next claim and the
lease renewal, so a fast upstream costs one commit per handful of rows, not
one per row. A long streak of failures means the route is broken, not the
rows, and the run stops instead of burning through every row.

The run's one reservation pays for every row; it is settled once, at the end,
with the sum of the rows' charges. A settlement that fails leaves the run
``blocked`` on ``payment``, and a worker retries it later.

Each row is marked sent (durably, through the dispatcher's ``on_send``) just
before its engine call. A row that was claimed but never sent (the run was
stopping, the worker draining, the store refused the mark) is not failed:
it waits again. When a drain's grace period ends with calls in flight, the
run is handed back in one transaction: answered rows recorded, sent rows
``uncertain``, unsent rows pending, lease released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog, RouteSpec
from batchyard.core.clock import Clock
from batchyard.core.leases import Lease
from batchyard.core.money import charge_ticks, from_ticks, quote_ticks
from batchyard.core.prices import Price
from batchyard.core.runs import (
    BlockedReason,
    ItemState,
    RunSettings,
    RunStatus,
    prompt_messages,
    resolve_model,
)
from batchyard.engines.base import CompletionRequest
from batchyard.errors import BatchyardError, LimiterUnavailable, StorageUnavailable
from batchyard.store import activity, ledger, work_items
from batchyard.store.database import Database
from batchyard.store.run_leases import heartbeat, release_lease
from batchyard.store.runs import Run, load_run, update_run
from batchyard.store.work_items import ItemResult, WorkItem
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.runs.outputs import write_outputs
from batchyard.work.sending import SentMarks

__all__ = ["RunExecutor"]


class _NotSent(Exception):
    """The row's call was not made: it waits again."""


log = logging.getLogger("batchyard.runs")
S = RunStatus


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every call of one run shares."""

    route: RouteSpec
    upstream: str
    price: Price
    source: dict[str, Any]
    max_tokens: int
    samples: int
    temperature: float | None
    top_p: float | None

    def row_cap(self, input_tokens: int) -> int:
        """The most one row may be charged: its own share of the quote."""
        return quote_ticks(self.price.cost(input_tokens, self.max_tokens * self.samples))


def _plan(catalog: Catalog, run: Run) -> _Plan:
    """Resolve the run's model and sampling once; the model may have left the catalog."""
    model, route, upstream = resolve_model(catalog, run.spec["model"])
    sampling = run.spec["sampling"]
    return _Plan(
        route=route,
        upstream=upstream,
        price=Price(model.input_per_mtok, model.output_per_mtok),
        source=run.spec["input"],
        max_tokens=int(sampling["maxOutputTokens"]),
        samples=int(sampling["samplesPerRow"]),
        temperature=sampling.get("temperature"),
        top_p=sampling.get("topP"),
    )


class RunExecutor:
    """Executes and settles the runs one worker holds (under its ``owner`` lease)."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        catalog: Catalog,
        dispatcher: Dispatcher,
        owner: str,
        settings: RunSettings,
        lease_until: Callable[[], datetime],
        embedded_contexts: int = 1,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.db = db
        self._draining = draining
        self.clock = clock
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.embedded_contexts = embedded_contexts
        self.owner = owner
        self.settings = settings
        self._lease_until = lease_until

    def _concurrency(self, route: RouteSpec) -> int:
        if route.concurrency:
            return route.concurrency
        if route.engine == "llama_cpp":
            return max(1, self.embedded_contexts)
        return self.settings.default_concurrency

    async def _answer(
        self,
        marks: SentMarks[int],
        plan: _Plan,
        item: WorkItem,
        data: dict[str, Any] | None,
        stopping: Callable[[], bool],
    ) -> ItemResult:
        messages = prompt_messages(data or {}, plan.source)
        if messages is None:
            return ItemResult(
                item.row_id,
                ItemState.FAILED,
                error={"code": "missing_input", "message": "the frozen row has no prompt"},
            )
        request = CompletionRequest(
            model=plan.upstream,
            messages=messages,
            max_tokens=plan.max_tokens,
            temperature=plan.temperature,
            top_p=plan.top_p,
            n=plan.samples,
        )
        sent = False

        async def on_send() -> None:
            nonlocal sent
            if stopping() or not await marks.mark(item.row_id):
                raise _NotSent
            sent = True

        try:
            c = await self.dispatcher.call(
                route=plan.route, request=request, input_tokens=item.input_tokens, on_send=on_send
            )
        except _NotSent:
            return ItemResult(item.row_id, ItemState.PENDING)
        except BatchyardError as exc:
            if not sent and isinstance(exc, StorageUnavailable | LimiterUnavailable):
                # The store refused the mark, or the limiter could not admit the call:
                # nothing reached the engine, the row waits again. Not at once: the
                # outage is still on, and claiming it back now would only spin.
                await self.clock.sleep(self.settings.heartbeat_s)
                return ItemResult(item.row_id, ItemState.PENDING)
            return ItemResult(
                item.row_id, ItemState.FAILED, error={"code": exc.code, "message": exc.message}
            )
        except Exception as exc:
            log.exception("row call failed", extra={"row_id": item.row_id})
            return ItemResult(
                item.row_id,
                ItemState.FAILED,
                error={"code": "internal_error", "message": type(exc).__name__},
            )
        charge = charge_ticks(plan.price.cost(c.usage.input_tokens, c.usage.output_tokens))
        return ItemResult(
            item.row_id,
            ItemState.SUCCEEDED,
            outputs=[ch.text for ch in c.choices][: plan.samples],
            usage_input=c.usage.input_tokens,
            usage_output=c.usage.output_tokens,
            charge=min(charge, plan.row_cap(item.input_tokens)),
        )

    async def execute(self, run: Run) -> None:
        """Answer a claimed run's rows (unless it is past that), write its outputs, settle it.

        ``run`` is as its claim returned it: every write below names that claim's
        lease (``run.lease``), so once another claim takes the run, none lands.
        """
        try:
            await self._execute(run)
        except asyncio.CancelledError:
            if self._draining():
                # Cut off by the end of a drain's grace period: let another worker
                # take the run now rather than when the lease expires.
                await asyncio.shield(self._release(run.id, run.lease))
            raise

    async def _release(self, run_id: str, lease: Lease) -> None:
        with contextlib.suppress(BatchyardError):
            await self.db.transact(lambda c: release_lease(c, run_id, lease))

    async def _execute(self, run: Run) -> None:
        if run.status in (S.RUNNING, S.STOPPING):
            try:
                plan = _plan(self.catalog, run)
            except BatchyardError as exc:
                await self._begin_finish(
                    run.id, run.lease, error={"code": exc.code, "message": exc.message}
                )
            else:
                if not await self._dispatch_rows(run, plan):
                    return
        await write_outputs(
            self.db,
            self.clock,
            run.id,
            lease=run.lease,
            lease_until=self._lease_until,
            batch_size=self.settings.write_batch,
        )
        await self.settle(run.id, run.lease)

    async def _dispatch_rows(self, run: Run, plan: _Plan) -> bool:
        """Answer every pending row; ``False`` if the lease was lost on the way.

        Commits are pipelined with the calls: while one transaction records
        finished rows and claims the next ones, the calls still in flight go
        on, so the engine's slots stay busy and each commit covers many rows.
        """
        width = self._concurrency(plan.route)
        loop = asyncio.get_running_loop()
        interval = min(self.settings.heartbeat_s, self.settings.flush_s)
        flying: dict[asyncio.Task[ItemResult], int] = {}
        stepping: asyncio.Task[Any] | None = None
        asked = 0
        done: list[ItemResult] = []
        stop = exhausted = False
        streak, last_step = 0, float("-inf")
        error: dict[str, Any] | None = None

        def stopping() -> bool:
            return stop or self._draining()

        lease = run.lease
        marks: SentMarks[int] = SentMarks(
            self.db,
            self.clock,
            lambda c, keys, now: work_items.mark_rows_sent(c, run.id, keys, lease, now),
        )

        try:
            while True:
                idle = stopping() or exhausted
                if stepping is None:
                    due = loop.time() - last_step >= interval
                    claim = not idle and len(flying) <= width - max(1, width // 4)
                    if claim or due or (done and not flying):
                        asked = 0 if idle else width - len(flying)
                        stepping = asyncio.create_task(self._step(run, done, asked))
                        done, last_step = [], loop.time()
                    elif idle and not flying:
                        break
                waiting: set[asyncio.Task[Any]] = set(flying)
                if stepping is not None:
                    waiting.add(stepping)
                timeout = max(0.0, last_step + interval - loop.time())
                finished, _ = await asyncio.wait(
                    waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                for task in finished:
                    if task is stepping:
                        stepping = None
                        step = task.result()
                        if step is None:
                            # Another claim holds the run: what landed here is not written.
                            log.warning(
                                "run lease lost",
                                extra={"run_id": run.id, "lease_token": run.lease_token},
                            )
                            return False
                        status, claimed = step
                        stop = stop or status == S.STOPPING
                        exhausted = exhausted or (asked > 0 and len(claimed) < asked)
                        for item, data in claimed:
                            answer = asyncio.create_task(
                                self._answer(marks, plan, item, data, stopping)
                            )
                            flying[answer] = item.row_id
                        continue
                    del flying[task]
                    result = task.result()
                    done.append(result)
                    if result.state == ItemState.PENDING:
                        exhausted = False  # it waits again: the run is not done with it
                    else:
                        streak = 0 if result.state == ItemState.SUCCEEDED else streak + 1
                if streak >= self.settings.failure_streak and error is None:
                    last = done[-1].error if done else None
                    error = {
                        "code": "too_many_failures",
                        "message": f"{streak} rows in a row failed (last: "
                        f"{(last or {}).get('message')}); the route looks broken, so the run "
                        "stopped",
                    }
                    stop = True
        except asyncio.CancelledError:
            if self._draining():
                done += [
                    t.result()
                    for t in flying
                    if t.done() and not t.cancelled() and t.exception() is None
                ]
                for task in flying:
                    task.cancel()
                if stepping is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(stepping)
                    stepping = None
                await asyncio.shield(self._hand_over(run.id, lease, done))
            raise
        finally:
            for task in flying:
                task.cancel()
            if stepping is not None:
                stepping.cancel()
        if self._draining() and not stop and not exhausted:
            # Every call in flight landed: hand the run over with its rows recorded.
            await self._hand_over(run.id, lease, done)
            return False
        await self._begin_finish(run.id, lease, error=error)
        return True

    async def _hand_over(self, run_id: str, lease: Lease, results: list[ItemResult]) -> None:
        """Record what landed, settle what did not (sent: uncertain; unsent: pending), let go."""
        now = self.clock.now()

        def tx(c: Connection) -> None:
            if heartbeat(c, run_id, lease, now) is None:
                return  # no longer ours: its new owner decides
            work_items.record_results(c, run_id, results, now)
            uncertain, _ = work_items.recover_dispatched(c, run_id, now)
            self.dispatcher.metrics.uncertain("runs", len(uncertain))
            run = load_run(c, run_id)
            if uncertain:
                activity.record(
                    c,
                    run.org_id,
                    "uncertain",
                    now,
                    ref=run_id,
                    reservation_id=run.reservation_id,
                    detail={
                        "rows": uncertain[:100],
                        "count": len(uncertain),
                        "reason": "the worker stopped (its grace period ended) during the calls",
                    },
                )
            work_items.recount(c, run_id, now)
            release_lease(c, run_id, lease)

        try:
            await self.db.transact(tx)
        except BatchyardError:
            log.warning("could not hand a run over", extra={"run_id": run_id})

    async def _step(
        self, run: Run, results: list[ItemResult], free: int
    ) -> tuple[str, list[tuple[WorkItem, dict[str, Any] | None]]] | None:
        """Record finished rows, renew the lease and claim more: one transaction."""
        now, until = self.clock.now(), self._lease_until()

        def tx(c: Connection) -> tuple[str, list[Any]] | None:
            status = heartbeat(c, run.id, run.lease, until)
            if status is None:
                return None
            work_items.record_results(c, run.id, results, now)
            if status == S.STOPPING:
                return status, []
            return status, work_items.claim_items(c, run.id, run.dataset_id, free, now)

        # Finished rows are answers already paid for upstream: record them through
        # a short storage outage rather than lose them (and make them uncertain).
        return await asyncio.shield(self.db.transact_through(tx, patience_s=10.0))

    async def _begin_finish(
        self, run_id: str, lease: Lease, *, error: dict[str, Any] | None
    ) -> None:
        """No more calls: unsent rows are canceled and the outputs get written."""
        now = self.clock.now()

        def tx(c: Connection) -> None:
            run = load_run(c, run_id, lock=True)
            if run.lease != lease:
                return
            work_items.cancel_pending(c, run_id, now)
            work_items.recount(c, run_id, now)
            values: dict[str, Any] = {"outcome": S.FAILED if error else S.COMPLETED}
            if error:
                values["error"] = error
            if run.status == S.RUNNING:
                values["status"] = S.WRITING_OUTPUTS
            update_run(c, run_id, now, **values)

        await self.db.transact(tx)

    async def settle(self, run_id: str, lease: Lease) -> None:
        """Charge the summed usage against the run's reservation, release the rest, end it.

        Only under ``lease``: a worker that lost the run charges nothing.
        """
        now = self.clock.now()

        def tx(c: Connection) -> str | None:
            run = load_run(c, run_id, lock=True)
            if run.lease != lease:
                return None
            final = (
                S.CANCELED
                if run.status == S.STOPPING or run.outcome == S.CANCELED
                else (S.FAILED if run.outcome == S.FAILED else S.COMPLETED)
            )
            charged = 0
            if run.reservation_id is not None:
                res = ledger.get_reservation(c, run.reservation_id, lock=True)
                if res.state == "held":
                    settled = ledger.settle(c, run.reservation_id, run.charge_accum, now)
                    charged = settled.charged or 0
                    self.dispatcher.metrics.charged("run", from_ticks(charged))
                    activity.record(
                        c,
                        run.org_id,
                        "charge",
                        now,
                        ref=run.id,
                        reservation_id=run.reservation_id,
                        amount=charged,
                        detail={
                            "purpose": "run",
                            "model": run.spec["model"].get("id"),
                            "rows": run.rows_done,
                            "uncertain": run.rows_uncertain,
                            "input_tokens": run.input_tokens,
                            "output_tokens": run.output_tokens,
                        },
                    )
                else:
                    charged = res.charged or 0
            update_run(
                c,
                run_id,
                now,
                status=final,
                charge=charged,
                blocked_reason=None,
                outcome=final,
                lease_owner=None,
                lease_expires_at=None,
            )
            return final

        try:
            final = await asyncio.shield(self.db.transact(tx))
        except BatchyardError as exc:
            log.error("run settlement failed", extra={"run_id": run_id, "code": exc.code})

            def block(c: Connection) -> None:
                run = load_run(c, run_id, lock=True)
                canceled = run.status == S.STOPPING or run.outcome == S.CANCELED
                update_run(
                    c,
                    run_id,
                    now,
                    lease=lease,
                    status=S.BLOCKED,
                    outcome=S.CANCELED if canceled else run.outcome,
                    blocked_reason=BlockedReason.PAYMENT,
                    lease_owner=None,
                    lease_expires_at=None,
                )

            await self.db.transact(block)
            return
        if final:
            log.info("run finished", extra={"run_id": run_id, "status": final})
