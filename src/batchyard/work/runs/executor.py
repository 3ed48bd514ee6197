"""Executing a queued run: answering its rows, then writing outputs and settling.

Rows are answered through the runner's claim pipeline (``work.runner``) over
the run's ``RowQueue``: concurrently (the route's concurrency, or the
embedded engine's slots) through ``dispatcher.call``, which paces each route
by its limits; finished rows are written with their usage in the same
transaction that renews the run's lease and claims the next ones. A long
streak of failures means the route is broken, not the rows, and the run
stops instead of burning through every row.

The run's one reservation pays for every row; it is settled once, at the end,
with the sum of the rows' charges (``store.billing``). A settlement that
fails leaves the run ``blocked`` on ``payment``, and a worker retries it
later.

A row whose call never started (the run was stopping, the worker draining,
the store refused the sent mark) is not failed: it waits again. When a
drain's grace period ends with calls in flight, the run is handed back in
one transaction: answered rows recorded, sent rows ``uncertain``, unsent rows
pending, lease released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Connection

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.clock import Clock
from batchyard.core.leases import Lease
from batchyard.core.money import from_ticks
from batchyard.core.prices import Price
from batchyard.core.quotes import charge, direct_price
from batchyard.core.runs import (
    BlockedReason,
    ItemState,
    RunStatus,
    prompt_messages,
    resolve_model,
)
from batchyard.core.sections import RunSettings
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.errors import BatchyardError, InvalidRequest
from batchyard.store import billing, work_items
from batchyard.store.database import Database
from batchyard.store.leases import LET_GO
from batchyard.store.run_leases import release
from batchyard.store.runs import Run, load_run, update_run
from batchyard.store.work_items import ItemResult
from batchyard.work.dispatcher import Dispatcher, OnSend
from batchyard.work.runner import Answered, Ended, Failed, Pipeline
from batchyard.work.runs.outputs import write_outputs
from batchyard.work.runs.row_queue import Row, RowQueue

__all__ = ["RunExecutor"]


log = logging.getLogger("batchyard.runs")
S = RunStatus


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every call of one run shares."""

    model: ModelSpec
    route: RouteSpec
    upstream: str
    price: Price
    source: dict[str, Any]
    max_tokens: int
    samples: int
    temperature: float | None
    top_p: float | None


def _plan(catalog: Catalog, run: Run) -> _Plan:
    """Resolve the run's model and sampling once; the model may have left the catalog."""
    model, route, upstream = resolve_model(catalog, run.spec["model"])
    sampling = run.spec["sampling"]
    return _Plan(
        model=model,
        route=route,
        upstream=upstream,
        price=direct_price(model),
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
        pipeline: Pipeline | None = None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.db = db
        self.clock = clock
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.owner = owner
        self.settings = settings
        self.pipeline = pipeline or Pipeline(
            db=db,
            clock=clock,
            metrics=dispatcher.metrics,
            lease_s=settings.lease_s,
            renew_s=settings.heartbeat_s,
            flush_s=settings.flush_s,
            draining=draining,
            outage_pause_s=settings.heartbeat_s,
            unavailable_retries=dispatcher.upstream_unavailable_retries,
        )

    def _lease_until(self) -> datetime:
        return self.clock.now() + timedelta(seconds=self.settings.lease_s)

    async def _call(self, plan: _Plan, row: Row, on_send: OnSend) -> Completion:
        """A row's call: its frozen prompt, the run's sampling, on the run's route."""
        item, data = row
        messages = prompt_messages(data or {}, plan.source)
        if messages is None:
            raise InvalidRequest("the frozen row has no prompt", code="missing_input")
        request = CompletionRequest(
            model=plan.upstream,
            messages=messages,
            max_tokens=plan.max_tokens,
            temperature=plan.temperature,
            top_p=plan.top_p,
            n=plan.samples,
        )
        return await self.dispatcher.call(
            route=plan.route, request=request, input_tokens=item.input_tokens, on_send=on_send
        )

    @staticmethod
    def _result(plan: _Plan, row: Row, attempt: Answered[Completion] | Failed) -> ItemResult:
        """A row's result: its answers and usage, charged at the run's price (``core.quotes``)."""
        item, _ = row
        if isinstance(attempt, Failed):
            error = {"code": attempt.error.code, "message": attempt.error.message}
            return ItemResult(item.row_id, ItemState.FAILED, error=error)
        c = attempt.value
        return ItemResult(
            item.row_id,
            ItemState.SUCCEEDED,
            outputs=[ch.text for ch in c.choices][: plan.samples],
            usage_input=c.usage.input_tokens,
            usage_output=c.usage.output_tokens,
            usage_cached=c.usage.cached_input_tokens,
            charge=charge(plan.price, plan.route, c.usage).ticks,
        )

    async def execute(self, run: Run) -> None:
        """Answer a claimed run's rows (unless it is past that), write its outputs, settle it.

        ``run`` is as its claim returned it: every write below names that claim's
        lease (``run.lease``), so once another claim takes the run, none lands.
        """
        try:
            await self._execute(run)
        except asyncio.CancelledError:
            if self.pipeline.draining():
                # Cut off by the end of a drain's grace period: let another worker
                # take the run now rather than when the lease expires.
                await asyncio.shield(self._release(run.id, run.lease))
            raise

    async def _release(self, run_id: str, lease: Lease) -> None:
        with contextlib.suppress(BatchyardError):
            await self.db.transact(lambda c: release(c, run_id, lease))

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
        """Answer every pending row; ``False`` if the run was handed over or its lease lost."""
        streak = self.settings.failure_streak
        ran = await self.pipeline.run(
            RowQueue(run),
            width=self.dispatcher.concurrency(plan.route) or self.settings.concurrency,
            call=partial(self._call, plan),
            render=partial(self._result, plan),
            failure_streak=streak,
        )
        if ran.ended is Ended.LOST:
            # Another claim holds the run: what landed here is not written.
            log.warning("run lease lost", extra={"run_id": run.id, "lease_token": run.lease_token})
            return False
        if ran.ended is Ended.HANDED_OVER:
            return False
        error: dict[str, Any] | None = None
        if ran.streak_error is not None:
            error = {
                "code": "too_many_failures",
                "message": f"{streak} rows in a row failed (last: {ran.streak_error.message}); "
                "the route looks broken, so the run stopped",
            }
        await self._begin_finish(run.id, run.lease, error=error)
        return True

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
        metrics = self.dispatcher.metrics

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
                settled = billing.settle(
                    c,
                    run.reservation_id,
                    run.charge_accum,
                    now,
                    ref=run.id,
                    detail={
                        "purpose": "run",
                        "model": run.spec["model"].get("id"),
                        "rows": run.rows_done,
                        "uncertain": run.rows_uncertain,
                        "input_tokens": run.input_tokens,
                        "output_tokens": run.output_tokens,
                    },
                    if_held=True,
                )
                charged = settled.charged
                if settled.now:
                    metrics.charged("run", from_ticks(charged), from_ticks(settled.over))
            update_run(
                c,
                run_id,
                now,
                status=final,
                charge=charged,
                blocked_reason=None,
                outcome=final,
                **LET_GO,
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
                    **LET_GO,
                )

            await self.db.transact(block)
            return
        if final:
            log.info("run finished", extra={"run_id": run_id, "status": final})
