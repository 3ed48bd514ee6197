"""The run worker: prepares quotes, funds confirmed runs, and executes them.

One loop per process (``install`` adds it to the service) takes runs through
leases in the store, so any number of processes can share the work and a dead
one's runs are taken over once its lease expires:

- *preparing* runs are quoted: the selected rows are frozen as ``(row id,
  version)`` work items and counted with the model's tokenizer, in batches,
  on a thread (counting is CPU work and the event loop keeps serving);
- *blocked* runs are retried: ``funds`` when credit may have arrived,
  ``payment`` when the settlement may now succeed;
- *queued* runs are executed: rows are dispatched concurrently (the embedded
  engine's pool of contexts, or the route's concurrency) through
  ``dispatcher.call``, which paces each route by its limits. Finished rows are
  written with their usage in the same transaction that marks them
  succeeded, batched with the next claim and the lease renewal, so a fast
  upstream costs one commit per handful of rows, not one per row.

The run's one reservation pays for every row; it is settled once, at the end,
with the sum of the rows' charges. A row whose call was in flight when its
worker died becomes ``uncertain`` on takeover and is never sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from batchyard.core.catalog import RouteSpec
from batchyard.core.filters import compile_filter
from batchyard.core.ids import new_id
from batchyard.core.money import charge_ticks, from_ticks, quote_ticks
from batchyard.core.runs import (
    BlockedReason,
    ItemState,
    RunSettings,
    RunStatus,
    prompt_messages,
    prompt_text,
    resolve_model,
)
from batchyard.engines.base import CompletionRequest
from batchyard.errors import BatchyardError, InsufficientCredit
from batchyard.store import activity, ledger
from batchyard.store import projects as pstore
from batchyard.store import runs as rstore
from batchyard.work.dispatcher import Price

if TYPE_CHECKING:
    from batchyard.service import Service

__all__ = ["RunWorker", "approve", "fund", "install", "notify", "worker_for"]

log = logging.getLogger("batchyard.runs")
S = RunStatus
# Statuses a worker takes runs in (held ones only once their lease expired).
CLAIMABLE = (S.PREPARING, S.QUEUED, *rstore.HELD)
_workers: weakref.WeakKeyDictionary[Service, RunWorker] = weakref.WeakKeyDictionary()


def fund(
    conn: Connection,
    run: rstore.Run,
    now: Any,
    *,
    threshold: Decimal | None,
    tiers: Any = None,
) -> str:
    """Reserve a confirmed run's quote, or block it; returns the new status.

    One transaction moves the run and writes its reservation, so the store
    never shows a queued run without its money.
    """
    cost = run.quote_max_cost or 0
    if threshold is not None and from_ticks(cost) > threshold and not run.approved:
        rstore.update_run(
            conn, run.id, now, status=S.BLOCKED, blocked_reason=BlockedReason.BILLING_REVIEW
        )
        return S.BLOCKED
    try:
        res = ledger.reserve(conn, run.org_id, cost, now, purpose="run", ref=run.id, tiers=tiers)
    except InsufficientCredit:
        if run.status != S.BLOCKED or run.blocked_reason != BlockedReason.FUNDS:
            rstore.update_run(
                conn, run.id, now, status=S.BLOCKED, blocked_reason=BlockedReason.FUNDS
            )
        return S.BLOCKED
    rstore.update_run(
        conn, run.id, now, status=S.QUEUED, blocked_reason=None, reservation_id=res.id
    )
    return S.QUEUED


def approve(conn: Connection, run_id: str, now: Any, *, tiers: Any = None) -> str:
    """An operator's approval of a run held for billing review; then it is funded."""
    run = rstore.load_run(conn, run_id, lock=True)
    if run.status != S.BLOCKED or run.blocked_reason != BlockedReason.BILLING_REVIEW:
        from batchyard.errors import InvalidState

        raise InvalidState(f"run {run_id} is {run.status}, not held for billing review")
    rstore.update_run(conn, run_id, now, approved=True)
    run = rstore.load_run(conn, run_id)
    return fund(conn, run, now, threshold=None, tiers=tiers)


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


def _plan(svc: Service, run: rstore.Run) -> _Plan:
    model, route, upstream = resolve_model(svc.catalog, run.spec["model"])
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


class RunWorker:
    """One process's share of the run work; ``run_forever`` is its loop."""

    def __init__(self, service: Service, *, owner: str | None = None) -> None:
        self.svc = service
        self.owner = owner or new_id("wkr", service.clock.now())
        self.settings = RunSettings.from_raw(service.settings.raw.get("runs"))
        self._active: dict[str, asyncio.Task[None]] = {}
        # (run ID, status when claimed) of every claim, for operators and tests.
        self.claims: list[tuple[str, str]] = []
        self._wake: asyncio.Event | None = None
        # Tells a quote being prepared on a thread to give up (the loop stopped).
        self._stopping = False

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
                except Exception:
                    log.exception("run worker tick failed", extra={"worker": self.owner})
                # A poll interval, not a time rule: leases and quotes read the clock.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
                self._wake.clear()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Abandon active runs as a crash would: their leases expire, others take over."""
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
        now, exclude = self.svc.clock.now(), list(self._active)
        claimable, funds = await self.svc.db.run(
            lambda c: rstore.work_waiting(c, now, CLAIMABLE, exclude), readonly=True
        )
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

    def _lease_until(self) -> Any:
        from datetime import timedelta

        return self.svc.clock.now() + timedelta(seconds=self.settings.lease_s)

    async def _claim(self) -> rstore.Run | None:
        now, until = self.svc.clock.now(), self._lease_until()
        exclude = list(self._active)

        def tx(c: Connection) -> rstore.Run | None:
            run = rstore.claim_run(
                c,
                self.owner,
                now,
                until,
                statuses=CLAIMABLE,
                exclude=exclude,
            ) or rstore.claim_run(
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
                rstore.update_run(c, run.id, now, status=S.RUNNING)
            elif run.status in rstore.HELD:
                self._take_over(c, run, now)
            return rstore.load_run(c, run.id)

        return await self.svc.db.run(tx)

    def _take_over(self, c: Connection, run: rstore.Run, now: Any) -> None:
        """A dead worker's run: its in-flight rows become uncertain, never re-sent."""
        uncertain = rstore.mark_uncertain(c, run.id, now)
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
        rstore.recount(c, run.id, now)

    async def _retry_blocked_funds(self) -> None:
        now = self.svc.clock.now()
        threshold = self.svc.settings.billing_review_threshold
        tiers = self.svc.settings.tiers

        def tx(c: Connection) -> int:
            queued = 0
            for run in rstore.blocked_runs(c, BlockedReason.FUNDS, limit=20):
                queued += fund(c, run, now, threshold=threshold, tiers=tiers) == S.QUEUED
            return queued

        if await self.svc.db.run(tx):
            self.notify()

    async def _work(self, run: rstore.Run) -> None:
        if run.status == S.PREPARING:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._prepare, run)
            return
        if run.status == S.BLOCKED:
            await self._settle(run.id)
            return
        await self._execute(run)

    # -- preparing the quote -------------------------------------------------------

    def _prepare(self, run: rstore.Run) -> None:
        """Freeze and count the selected rows in batches (runs on a thread)."""
        from batchyard.core.clock import isoformat

        db, clock, spec = self.svc.db, self.svc.clock, run.spec
        try:
            model, _, _ = resolve_model(self.svc.catalog, spec["model"])
        except BatchyardError as exc:
            self._fail_prepare(run, exc.code, exc.message)
            return
        tok = self.svc.tokenizer(model)
        keep = compile_filter(spec.get("filter"))
        source = spec["input"]
        max_out = int(spec["sampling"]["maxOutputTokens"])
        by_field = source.get("type") == "field"
        field = str(source.get("field"))
        # A text field is sent as one user message: the template's tokens are
        # the same for every row, so count them once (never fewer than the
        # template renders: BPE merges across the seam can only save tokens).
        wrap = tok.count_messages([{"role": "user", "content": ""}]) if by_field else 0
        db.run_sync(lambda c: rstore.clear_items(c, run.id))
        after, rows, tokens = 0, 0, 0
        too_long = json.dumps(
            {
                "code": "context_window_exceeded",
                "message": (
                    f"the prompt and maxOutputTokens exceed the {model.context_window}-token "
                    f"context window of {model.id}"
                ),
            }
        )
        while True:

            def scan(c: Connection, a: int = after) -> list[tuple[int, int, str]]:
                return pstore.current_rows(
                    c, run.dataset_id, after=a, limit=self.settings.prepare_batch
                )

            batch = db.run_sync(scan, readonly=True)
            if not batch or self._stopping:
                break
            after = batch[-1][0]
            refs: list[tuple[int, int]] = []
            texts: list[str] = []
            counts: list[int] = []
            for row_id, version, raw in batch:
                data = json.loads(raw)
                if not keep(data):
                    continue
                if by_field:
                    text = prompt_text(data, field)
                    if text is not None:
                        refs.append((row_id, version))
                        texts.append(text)
                else:
                    messages = prompt_messages(data, source)
                    if messages is not None:
                        refs.append((row_id, version))
                        counts.append(tok.count_messages(messages))
            if by_field:
                counts = [n + wrap for n in tok.count_batch(texts)]
            items: list[tuple[int, int, int, str, str | None]] = []
            for (row_id, version), n in zip(refs, counts, strict=True):
                if n + max_out > model.context_window:
                    items.append((row_id, version, n, ItemState.FAILED, too_long))
                else:
                    items.append((row_id, version, n, ItemState.PENDING, None))
                    rows += 1
                    tokens += n
            until = self._lease_until()

            def save(c: Connection, items: list[Any] = items, until: Any = until) -> bool:
                now = clock.now()
                if not rstore.update_run(
                    c,
                    run.id,
                    now,
                    expect=[S.PREPARING],
                    owner=self.owner,
                    lease_expires_at=until,
                ):
                    return False
                rstore.add_items(c, run.id, items)
                return True

            if not db.run_sync(save):
                log.info("quote abandoned", extra={"run_id": run.id})
                return
        if self._stopping:
            return
        if rows == 0:
            self._fail_prepare(
                run,
                "filter_matches_no_rows",
                "no row of the dataset matches the filter with a prompt to send",
            )
            return
        samples = int(spec["sampling"]["samplesPerRow"])
        out_tokens = rows * max_out * samples
        cost = quote_ticks(
            Price(model.input_per_mtok, model.output_per_mtok).cost(tokens, out_tokens)
        )

        def finish(c: Connection) -> None:
            now = clock.now()
            rstore.recount(c, run.id, now)
            rstore.update_run(
                c,
                run.id,
                now,
                expect=[S.PREPARING],
                owner=self.owner,
                status=S.AWAITING_CONFIRMATION,
                quote_rows=rows,
                quote_input_tokens=tokens,
                quote_max_output_tokens=out_tokens,
                quote_max_cost=cost,
                quote_expires_at=now + self.settings.quote_ttl,
                lease_owner=None,
                lease_expires_at=None,
            )

        db.run_sync(finish)
        log.info(
            "quote ready",
            extra={
                "run_id": run.id,
                "rows": rows,
                "input_tokens": tokens,
                "expires": isoformat(clock.now() + self.settings.quote_ttl),
            },
        )

    def _fail_prepare(self, run: rstore.Run, code: str, message: str) -> None:
        def tx(c: Connection) -> None:
            rstore.update_run(
                c,
                run.id,
                self.svc.clock.now(),
                expect=[S.PREPARING],
                owner=self.owner,
                status=S.FAILED,
                error={"code": code, "message": message},
                lease_owner=None,
                lease_expires_at=None,
            )

        self.svc.db.run_sync(tx)

    # -- executing -----------------------------------------------------------------

    def _concurrency(self, route: RouteSpec) -> int:
        if route.concurrency:
            return route.concurrency
        if route.engine == "llama_cpp":
            return max(1, self.svc.settings.embedded_contexts)
        return self.settings.default_concurrency

    async def _answer(
        self, plan: _Plan, item: rstore.WorkItem, data: dict[str, Any] | None
    ) -> rstore.ItemResult:
        messages = prompt_messages(data or {}, plan.source)
        if messages is None:
            return rstore.ItemResult(
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
        try:
            c = await self.svc.dispatcher.call(
                route=plan.route, request=request, input_tokens=item.input_tokens
            )
        except BatchyardError as exc:
            return rstore.ItemResult(
                item.row_id, ItemState.FAILED, error={"code": exc.code, "message": exc.message}
            )
        except Exception as exc:
            log.exception("row call failed", extra={"row_id": item.row_id})
            return rstore.ItemResult(
                item.row_id,
                ItemState.FAILED,
                error={"code": "internal_error", "message": type(exc).__name__},
            )
        charge = charge_ticks(plan.price.cost(c.usage.input_tokens, c.usage.output_tokens))
        return rstore.ItemResult(
            item.row_id,
            ItemState.SUCCEEDED,
            outputs=[ch.text for ch in c.choices][: plan.samples],
            usage_input=c.usage.input_tokens,
            usage_output=c.usage.output_tokens,
            charge=min(charge, plan.row_cap(item.input_tokens)),
        )

    async def _execute(self, run: rstore.Run) -> None:
        if run.status in (S.RUNNING, S.STOPPING):
            try:
                plan = _plan(self.svc, run)
            except BatchyardError as exc:
                await self._begin_finish(run.id, error={"code": exc.code, "message": exc.message})
            else:
                if not await self._dispatch_rows(run, plan):
                    return
        await self._write_outputs(run.id)
        await self._settle(run.id)

    async def _dispatch_rows(self, run: rstore.Run, plan: _Plan) -> bool:
        """Answer every pending row; ``False`` if the lease was lost on the way.

        Commits are pipelined with the calls: while one transaction records
        finished rows and claims the next ones, the calls still in flight go
        on, so the engine's slots stay busy and each commit covers many rows.
        """
        width = self._concurrency(plan.route)
        loop = asyncio.get_running_loop()
        interval = min(self.settings.heartbeat_s, self.settings.flush_s)
        flying: dict[asyncio.Task[rstore.ItemResult], int] = {}
        stepping: asyncio.Task[Any] | None = None
        asked = 0
        done: list[rstore.ItemResult] = []
        stop = exhausted = False
        streak, last_step = 0, float("-inf")
        error: dict[str, Any] | None = None
        try:
            while True:
                idle = stop or exhausted
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
                            return False
                        status, claimed = step
                        stop = stop or status == S.STOPPING
                        exhausted = exhausted or (asked > 0 and len(claimed) < asked)
                        for item, data in claimed:
                            answer = asyncio.create_task(self._answer(plan, item, data))
                            flying[answer] = item.row_id
                        continue
                    del flying[task]
                    result = task.result()
                    done.append(result)
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
        finally:
            for task in flying:
                task.cancel()
            if stepping is not None:
                stepping.cancel()
        await self._begin_finish(run.id, error=error)
        return True

    async def _step(
        self, run: rstore.Run, results: list[rstore.ItemResult], free: int
    ) -> tuple[str, list[tuple[rstore.WorkItem, dict[str, Any] | None]]] | None:
        """Record finished rows, renew the lease and claim more: one transaction."""
        now, until = self.svc.clock.now(), self._lease_until()

        def tx(c: Connection) -> tuple[str, list[Any]] | None:
            status = rstore.heartbeat(c, run.id, self.owner, until)
            if status is None:
                return None
            rstore.record_results(c, run.id, results, now)
            if status == S.STOPPING:
                return status, []
            return status, rstore.claim_items(c, run.id, run.dataset_id, free, now)

        return await asyncio.shield(self.svc.db.run(tx))

    async def _begin_finish(self, run_id: str, *, error: dict[str, Any] | None) -> None:
        """No more calls: unsent rows are canceled and the outputs get written."""
        now = self.svc.clock.now()

        def tx(c: Connection) -> None:
            run = rstore.load_run(c, run_id, lock=True)
            if run.lease_owner != self.owner:
                return
            rstore.cancel_pending(c, run_id, now)
            rstore.recount(c, run_id, now)
            values: dict[str, Any] = {"outcome": S.FAILED if error else S.COMPLETED}
            if error:
                values["error"] = error
            if run.status == S.RUNNING:
                values["status"] = S.WRITING_OUTPUTS
            rstore.update_run(c, run_id, now, **values)

        await self.svc.db.run(tx)

    async def _write_outputs(self, run_id: str) -> None:
        while True:
            now, until = self.svc.clock.now(), self._lease_until()

            def tx(c: Connection, now: Any = now, until: Any = until) -> int:
                return self._write_batch(c, run_id, now, until)

            if await self.svc.db.run(tx) == 0:
                return

    def _write_batch(self, c: Connection, run_id: str, now: Any, until: Any) -> int:
        run = rstore.renew_lease(c, run_id, self.owner, until)
        if run is None:
            return 0
        batch = rstore.succeeded_unwritten(c, run_id, self.settings.write_batch)
        if not batch:
            return 0
        output = run.spec["output"]
        samples = int(run.spec["sampling"]["samplesPerRow"])
        if output["type"] == "field":
            values = {r: (outs[0] if samples == 1 and outs else outs) for r, _, outs in batch}
            pstore.write_field(c, run.dataset_id, output["field"], values, now)
        else:
            target = run.output_dataset_id
            if target is None:
                target = pstore.create_dataset(
                    c,
                    run.org_id,
                    run.project_id,
                    output["name"],
                    "chat-sft",
                    now,
                    source_run_id=run.id,
                ).id
                rstore.update_run(c, run_id, now, output_dataset_id=target)
            frozen = pstore.rows_at(c, run.dataset_id, [(r, v) for r, v, _ in batch])
            rows = []
            for row_id, _, outs in batch:
                prompt = prompt_messages(frozen.get(row_id, {}), run.spec["input"]) or []
                for i, text in enumerate(outs):
                    rows.append(
                        {
                            "messages": [*prompt, {"role": "assistant", "content": text}],
                            "sourceRowId": row_id,
                            "sample": i,
                        }
                    )
            pstore.append_rows(c, target, rows, now)
        rstore.mark_written(c, run_id, [r for r, _, _ in batch], now)
        return len(batch)

    async def _settle(self, run_id: str) -> None:
        """Charge the summed usage against the run's reservation, release the rest, end it."""
        now = self.svc.clock.now()

        def tx(c: Connection) -> str | None:
            run = rstore.load_run(c, run_id, lock=True)
            if run.lease_owner != self.owner:
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
            rstore.update_run(
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
            final = await asyncio.shield(self.svc.db.run(tx))
        except BatchyardError as exc:
            log.error("run settlement failed", extra={"run_id": run_id, "code": exc.code})

            def block(c: Connection) -> None:
                run = rstore.load_run(c, run_id, lock=True)
                canceled = run.status == S.STOPPING or run.outcome == S.CANCELED
                rstore.update_run(
                    c,
                    run_id,
                    now,
                    owner=self.owner,
                    status=S.BLOCKED,
                    outcome=S.CANCELED if canceled else run.outcome,
                    blocked_reason=BlockedReason.PAYMENT,
                    lease_owner=None,
                    lease_expires_at=None,
                )

            await self.svc.db.run(block)
            return
        if final:
            log.info("run finished", extra={"run_id": run_id, "status": final})


def worker_for(service: Service) -> RunWorker:
    worker = _workers.get(service)
    if worker is None:
        worker = _workers[service] = RunWorker(service)
    return worker


def notify(service: Service) -> None:
    """Tell this process's worker that there is run work to look at."""
    worker = _workers.get(service)
    if worker is not None:
        worker.notify()


def install(service: Service) -> None:
    """Run this process's run worker while the service is up."""
    worker = worker_for(service)
    service.add_background(worker.run_forever)
