"""Executing a run on its own: rows answered through the dispatcher, charged, settled once.

Each test starts from a run as the worker holds it right after claiming a
funded one (``running``, its quote reserved, its rows frozen and pending)
and calls ``RunExecutor.execute`` directly, with the shipped ScriptedEngine
behind the route, the in-memory limiter, an in-memory store and a clock only
the test moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Connection, select

from batchyard.core.clock import ManualClock
from batchyard.core.money import charge_ticks, quote_ticks, to_ticks
from batchyard.core.runs import BlockedReason, ItemState, RunStatus
from batchyard.core.sections import RunSettings
from batchyard.core.tokens import FallbackTokenizer
from batchyard.engines.protocol import Completion, CompletionRequest
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import ServiceUnavailable, UpstreamError
from batchyard.store import activity, ledger, work_items
from batchyard.store import projects as pstore
from batchyard.store.database import Database
from batchyard.store.run_leases import claim_run
from batchyard.store.runs import load_run, update_run
from batchyard.store.tables import ledger_entries
from batchyard.work.runs.executor import RunExecutor
from batchyard.work.runs.funding import fund
from tests.support.clocks import SleepWatchingClock
from tests.support.run_store import add_dataset, add_org, add_run, balance, items, load, run_spec
from tests.support.waits import settles
from tests.unit.work.conftest import PRICE, catalog, drive, make_dispatcher

S = RunStatus
OWNER = "wkr.a"
LEASE = timedelta(seconds=60)
CREDIT = to_ticks(Decimal(10))


def running_run(
    db: Database,
    clock: ManualClock,
    rows: list[dict[str, Any]],
    *,
    tokens: list[int] | None = None,
    max_out: int = 4,
    samples: int = 1,
) -> tuple[str, str]:
    """A funded run over ``rows`` that ``OWNER`` has claimed and started: (org, run).

    ``tokens`` are the frozen input counts (the quote's); by default the
    fallback tokenizer's, as a quote of a fallback-tokenizer model makes them.
    """
    now = clock.now()
    org = add_org(db, now)
    project, ds = add_dataset(db, now, org, rows)
    tok = FallbackTokenizer()
    counts = tokens or [
        tok.count_messages([{"role": "user", "content": str(r.get("text", ""))}]) for r in rows
    ]
    quote = quote_ticks(PRICE.cost(sum(counts), len(rows) * max_out * samples))
    run_id = add_run(
        db,
        now,
        org_id=org,
        project_id=project,
        dataset_id=ds,
        spec=run_spec(max_out=max_out, samples=samples),
        status=S.AWAITING_CONFIRMATION,
        quote_rows=len(rows),
        quote_input_tokens=sum(counts),
        quote_max_cost=quote,
    )

    def tx(c: Connection) -> None:
        frozen = [(i + 1, 1, n, ItemState.PENDING, None) for i, n in enumerate(counts)]
        work_items.add_items(c, run_id, frozen)
        work_items.recount(c, run_id, now)
        assert fund(c, load_run(c, run_id), now, threshold=None) == S.QUEUED
        assert claim_run(c, OWNER, now, now + LEASE, statuses=[S.QUEUED]) is not None
        update_run(c, run_id, now, status=S.RUNNING)

    db.transact_sync(tx)
    return org, run_id


def executor(
    db: Database,
    clock: SleepWatchingClock,
    engine: ScriptedEngine,
    *,
    settings: RunSettings | None = None,
    **route_limits: Any,
) -> RunExecutor:
    return RunExecutor(
        db=db,
        clock=clock,
        catalog=catalog(**route_limits),
        dispatcher=make_dispatcher(db, clock, engine),
        owner=OWNER,
        settings=settings or RunSettings(),
    )


def states(db: Database, run_id: str) -> list[str]:
    return [i["state"] for i in items(db, run_id)]


def run_entries(db: Database, reservation_id: str) -> list[tuple[str, int]]:
    def q(c: Connection) -> list[tuple[str, int]]:
        rows = c.execute(
            select(ledger_entries.c.kind, ledger_entries.c.amount)
            .where(ledger_entries.c.reservation_id == reservation_id)
            .order_by(ledger_entries.c.id)
        )
        return [(r.kind, r.amount) for r in rows]

    return db.read_sync(q)


def charges(db: Database, org: str) -> list[dict[str, Any]]:
    return [
        a for a in db.read_sync(lambda c: activity.list_activity(c, org)) if a["kind"] == "charge"
    ]


async def test_rows_are_answered_charged_their_usage_and_settled_once(
    db: Database, clock: SleepWatchingClock
) -> None:
    honest = {"text": "alpha beta"}
    long = {"text": "one two three four five six seven eight nine ten"}
    rows = [honest, long, {"note": "no prompt in the frozen row"}]
    # The long row was quoted at 1 input token: it is charged its usage all the same
    # (a share is never capped silently), within the run's one hold.
    org, run_id = running_run(db, clock, rows, tokens=[100, 1, 100], max_out=4)
    engine = ScriptedEngine("w1 w2 w3", clock=clock)

    await executor(db, clock, engine).execute(load(db, run_id))

    first = charge_ticks(PRICE.cost(2, 3))  # 2 words in, 3 out
    share = quote_ticks(PRICE.cost(1, 4))  # its share: 1 token in, maxOutputTokens out
    full = charge_ticks(PRICE.cost(10, 3))
    assert full > share
    [a, b, c] = items(db, run_id)
    assert (a["state"], a["usage_input"], a["usage_output"], a["charge"]) == (
        ItemState.SUCCEEDED,
        2,
        3,
        first,
    )
    assert (b["state"], b["usage_input"], b["usage_output"], b["charge"]) == (
        ItemState.SUCCEEDED,
        10,
        3,
        full,
    )
    # Written into the dataset (below), the answers leave no second copy in the run's rows.
    assert a["outputs"] is None and b["outputs"] is None
    assert (c["state"], json.loads(c["error"])["code"]) == (ItemState.FAILED, "missing_input")
    assert len(engine.calls) == 2

    run = load(db, run_id)
    assert (run.status, run.charge, run.error) == (S.COMPLETED, first + full, None)
    assert (run.rows_done, run.rows_failed, run.input_tokens, run.output_tokens) == (2, 1, 12, 6)
    assert run.outputs_written == 2
    assert (run.lease_owner, run.lease_expires_at) == (None, None)
    written = db.read_sync(lambda c: pstore.list_rows(c, run.dataset_id))
    assert [r.data.get("answer") for r in written] == ["w1 w2 w3", "w1 w2 w3", None]

    assert run.reservation_id is not None
    hold = run.quote_max_cost or 0
    assert run_entries(db, run.reservation_id) == [
        ("reserve", hold),
        ("settle", first + full),
        ("release", hold - first - full),
    ]
    assert balance(db, org) == ledger.Balance(CREDIT, first + full, 0)
    [charge] = charges(db, org)
    assert (charge["ref"], charge["amount"]) == (run_id, first + full)
    assert (charge["detail"]["rows"], charge["detail"]["input_tokens"]) == (2, 12)

    # A second settlement (a worker retrying) changes nothing.
    await executor(db, clock, engine).settle(run_id, load(db, run_id).lease)
    assert len(run_entries(db, run.reservation_id)) == 3
    assert len(charges(db, org)) == 1


async def test_every_sample_is_kept_and_charged(db: Database, clock: SleepWatchingClock) -> None:
    org, run_id = running_run(db, clock, [{"text": "alpha beta"}], max_out=4, samples=3)
    engine = ScriptedEngine("w1 w2", clock=clock)

    await executor(db, clock, engine).execute(load(db, run_id))

    [item] = items(db, run_id)
    dataset_id = load(db, run_id).dataset_id
    [row] = db.read_sync(lambda c: pstore.list_rows(c, dataset_id))
    assert row.data["answer"] == ["w1 w2"] * 3
    assert (item["usage_output"], item["charge"]) == (6, charge_ticks(PRICE.cost(2, 6)))
    assert engine.calls[0].n == 3
    assert balance(db, org).settled == item["charge"]


async def test_rows_go_through_the_dispatcher_at_the_route_s_pace(
    db: Database, clock: SleepWatchingClock
) -> None:
    seen: list[float] = []
    _, run_id = running_run(db, clock, [{"text": f"row {i}"} for i in range(3)])
    engine = ScriptedEngine("ok", clock=clock)
    t0 = clock.time()
    paced = executor(db, clock, engine, rpm=60)
    pace = paced.dispatcher.pacer.admit

    async def admitted(*args: Any) -> None:
        # When the route admits each call: the engine call follows after the row is
        # durably marked sent, which takes real time while the test moves the clock.
        await pace(*args)
        seen.append(clock.time())

    paced.dispatcher.pacer.admit = admitted  # type: ignore[method-assign]
    await drive(clock, asyncio.create_task(paced.execute(load(db, run_id))))

    assert sorted(seen) == [t0, pytest.approx(t0 + 1), pytest.approx(t0 + 2)]
    assert len(engine.calls) == 3
    assert load(db, run_id).status == S.COMPLETED


@pytest.mark.parametrize(
    ("failures", "answered", "failed", "canceled", "status"),
    [
        ([UpstreamError("down")] * 3, 0, 3, 7, S.FAILED),  # 3 in a row: the route is broken
        ([UpstreamError("down")] * 2 + [None] + [UpstreamError("down")] * 2, 6, 4, 0, S.COMPLETED),
    ],
)
async def test_a_streak_of_failures_stops_the_run_and_cancels_its_unsent_rows(
    db: Database,
    clock: SleepWatchingClock,
    failures: list[BaseException | None],
    answered: int,
    failed: int,
    canceled: int,
    status: str,
) -> None:
    rows = [{"text": f"row {i}"} for i in range(10)]
    org, run_id = running_run(db, clock, rows)
    engine = ScriptedEngine("ok", clock=clock, failures=failures)
    # One row at a time, so "in a row" is the order the rows were sent.
    settings = RunSettings(failure_streak=3, concurrency=1)

    await executor(db, clock, engine, settings=settings).execute(load(db, run_id))

    got = states(db, run_id)
    assert (got.count(ItemState.SUCCEEDED), got.count(ItemState.FAILED)) == (answered, failed)
    assert got.count(ItemState.CANCELED) == canceled
    assert len(engine.calls) == answered + failed
    run = load(db, run_id)
    assert (run.status, run.rows_canceled) == (status, canceled)
    if status == S.FAILED:
        assert run.error is not None and run.error["code"] == "too_many_failures"
        assert got[:3] == [ItemState.FAILED] * 3
    assert run.charge == answered * charge_ticks(PRICE.cost(2, 1))
    assert balance(db, org) == ledger.Balance(CREDIT, run.charge, 0)


async def test_a_run_canceled_mid_way_keeps_and_charges_what_was_answered(
    db: Database, clock: SleepWatchingClock
) -> None:
    rows = [{"text": f"row {i}"} for i in range(5)]
    org, run_id = running_run(db, clock, rows)

    def answer(_: CompletionRequest) -> str:
        if len(engine.calls) == 2:  # the user cancels while row 2's call is in flight
            db.transact_sync(lambda c: update_run(c, run_id, clock.now(), status=S.STOPPING))
        return "ok"

    engine = ScriptedEngine(answer, clock=clock)
    settings = RunSettings(concurrency=1)

    await executor(db, clock, engine, settings=settings).execute(load(db, run_id))

    assert states(db, run_id) == [ItemState.SUCCEEDED] * 2 + [ItemState.CANCELED] * 3
    run = load(db, run_id)
    per_row = charge_ticks(PRICE.cost(2, 1))
    assert (run.status, run.charge, run.outputs_written) == (S.CANCELED, 2 * per_row, 2)
    assert balance(db, org) == ledger.Balance(CREDIT, 2 * per_row, 0)


async def test_a_failed_settlement_blocks_the_run_on_payment_until_a_retry_settles_it(
    db: Database, clock: SleepWatchingClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, run_id = running_run(db, clock, [{"text": "alpha beta"}])
    real_settle = ledger.settle
    attempts: list[str] = []

    def settle_once_unavailable(c: Connection, reservation_id: str, *a: Any) -> Any:
        attempts.append(reservation_id)
        if len(attempts) == 1:
            raise ServiceUnavailable("the ledger is unavailable")
        return real_settle(c, reservation_id, *a)

    monkeypatch.setattr(ledger, "settle", settle_once_unavailable)
    engine = ScriptedEngine("w1 w2 w3", clock=clock)
    runner = executor(db, clock, engine)

    await runner.execute(load(db, run_id))

    run = load(db, run_id)
    assert (run.status, run.blocked_reason, run.outcome) == (
        S.BLOCKED,
        BlockedReason.PAYMENT,
        S.COMPLETED,
    )
    assert (run.lease_owner, run.charge) == (None, None)
    assert run.reservation_id is not None
    res = db.read_sync(lambda c: ledger.get_reservation(c, run.reservation_id or ""))
    assert res.state == "held"
    assert charges(db, org) == []

    # A worker claims the blocked run (as ``RunWorker`` does) and settles it.
    now = clock.now()
    claimed = db.transact_sync(
        lambda c: claim_run(
            c,
            OWNER,
            now,
            now + LEASE,
            statuses=[S.BLOCKED],
            blocked_reason=BlockedReason.PAYMENT,
        )
    )
    assert claimed is not None
    await runner.settle(run_id, claimed.lease)

    run = load(db, run_id)
    charge = charge_ticks(PRICE.cost(2, 3))
    assert (run.status, run.blocked_reason, run.charge) == (S.COMPLETED, None, charge)
    assert balance(db, org) == ledger.Balance(CREDIT, charge, 0)
    assert len(charges(db, org)) == 1
    assert len(engine.calls) == 1  # settling again never re-sends a row


async def test_a_run_whose_lease_was_lost_records_and_settles_nothing(
    db: Database, clock: SleepWatchingClock
) -> None:
    org, run_id = running_run(db, clock, [{"text": "alpha beta"}, {"text": "gamma"}])

    def answer(_: CompletionRequest) -> str:
        db.transact_sync(lambda c: update_run(c, run_id, clock.now(), lease_owner="wkr.b"))
        return "ok"

    engine = ScriptedEngine(answer, clock=clock)
    settings = RunSettings(concurrency=1)

    await executor(db, clock, engine, settings=settings).execute(load(db, run_id))

    assert len(engine.calls) == 1
    # The answered row stays dispatched: the new owner marks it uncertain, never re-sends it.
    assert states(db, run_id) == [ItemState.DISPATCHED, ItemState.PENDING]
    run = load(db, run_id)
    assert (run.status, run.lease_owner, run.charge) == (S.RUNNING, "wkr.b", None)
    assert balance(db, org).held == run.quote_max_cost


async def test_a_worker_whose_run_was_claimed_again_under_its_own_name_writes_nothing(
    db: Database, clock: SleepWatchingClock
) -> None:
    """The owner's name is not enough: a claim made since (same name, new token) fences it out.

    The run's lease lapses during the first row's call and the same worker
    name claims it again (a restarted process reusing its name, or its own
    loop): the old execution's token is stale, so it records no row, settles
    nothing and moves the run to no other state.
    """
    org, run_id = running_run(db, clock, [{"text": "alpha beta"}, {"text": "gamma"}])
    stale = load(db, run_id)

    def answer(_: CompletionRequest) -> str:
        clock.advance(LEASE.total_seconds() + 1)
        now = clock.now()
        again = db.transact_sync(
            lambda c: claim_run(c, OWNER, now, now + LEASE, statuses=[S.RUNNING])
        )
        assert again is not None and again.lease_token == stale.lease_token + 1
        return "ok"

    engine = ScriptedEngine(answer, clock=clock)
    settings = RunSettings(concurrency=1)
    await executor(db, clock, engine, settings=settings).execute(stale)

    assert len(engine.calls) == 1
    assert states(db, run_id) == [ItemState.DISPATCHED, ItemState.PENDING]
    run = load(db, run_id)
    assert (run.status, run.lease_owner, run.charge) == (S.RUNNING, OWNER, None)
    assert run.lease_token == stale.lease_token + 1
    assert (run.rows_done, run.charge_accum) == (0, 0)
    assert balance(db, org).held == run.quote_max_cost
    assert charges(db, org) == []
    # Settling under the stale token posts nothing either.
    await executor(db, clock, engine).settle(run_id, stale.lease)
    assert charges(db, org) == [] and load(db, run_id).status == S.RUNNING


async def test_a_payment_retry_that_finds_the_hold_already_resolved_posts_nothing_again(
    db: Database, clock: SleepWatchingClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    org, run_id = running_run(db, clock, [{"text": "alpha beta"}])

    def unavailable(*args: Any) -> Any:
        raise ServiceUnavailable("the ledger is unavailable")

    with monkeypatch.context() as patch:
        patch.setattr(ledger, "settle", unavailable)
        runner = executor(db, clock, ScriptedEngine("w1", clock=clock))
        await runner.execute(load(db, run_id))
    run = load(db, run_id)
    assert run.status == S.BLOCKED
    assert run.reservation_id is not None
    res_id = run.reservation_id

    # Meanwhile an operator resolved the hold by hand (here: voided it).
    now = clock.now()
    db.transact_sync(lambda c: ledger.release(c, res_id, now))
    claimed = db.transact_sync(
        lambda c: claim_run(
            c, OWNER, now, now + LEASE, statuses=[S.BLOCKED], blocked_reason=BlockedReason.PAYMENT
        )
    )
    assert claimed is not None
    await runner.settle(run_id, claimed.lease)

    run = load(db, run_id)
    assert (run.status, run.charge) == (S.COMPLETED, 0)
    assert run_entries(db, res_id) == [
        ("reserve", run.quote_max_cost),
        ("release", run.quote_max_cost),
    ]
    assert charges(db, org) == []
    assert balance(db, org) == ledger.Balance(CREDIT, 0, 0)


async def test_a_drain_cut_off_by_its_grace_hands_the_run_over(
    db: Database, clock: SleepWatchingClock
) -> None:
    """The sent row becomes uncertain; the rows still waiting for their turn wait again."""
    from tests.support.deferred_batches import BlockingEngine

    _, run_id = running_run(db, clock, [{"text": f"row {i}"} for i in range(5)])
    engine = BlockingEngine()
    stopping = [False]
    ex = RunExecutor(
        db=db,
        clock=clock,
        catalog=catalog(rpm=60),
        dispatcher=make_dispatcher(db, clock, engine),
        owner=OWNER,
        settings=RunSettings(concurrency=3),
        draining=lambda: stopping[0],
    )
    task = asyncio.create_task(ex.execute(load(db, run_id)))
    await settles(engine.entered.wait())  # row 1's call is in flight
    await clock.next_sleep()  # rows 2 and 3 wait for the route's pace
    stopping[0] = True  # SIGTERM, and then the grace period ends
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert len(engine.calls) == 1
    assert states(db, run_id) == [ItemState.UNCERTAIN] + [ItemState.PENDING] * 4
    run = load(db, run_id)
    assert (run.status, run.rows_uncertain, run.lease_owner) == (S.RUNNING, 1, None)
    acts = db.read_sync(lambda c: activity.list_activity(c, run.org_id))
    [event] = [a for a in acts if a["kind"] == "uncertain"]
    assert event["detail"]["count"] == 1


class CachingScripted(ScriptedEngine):
    """The shipped engine, reporting all but the last prompt word as read from its cache."""

    async def complete(self, request: CompletionRequest) -> Completion:
        done = await super().complete(request)
        cached = max(0, done.usage.input_tokens - 1)
        return dataclasses.replace(
            done, usage=dataclasses.replace(done.usage, cached_input_tokens=cached)
        )


async def test_a_rows_cached_prompt_tokens_settle_at_the_routes_cached_price(
    db: Database, clock: SleepWatchingClock
) -> None:
    org, run_id = running_run(db, clock, [{"text": "alpha beta gamma"}], max_out=4)
    engine = CachingScripted("w1 w2", clock=clock)

    await executor(db, clock, engine, cached_input_per_mtok=Decimal("250")).execute(
        load(db, run_id)
    )

    # 3 words in, 2 of them cached at $250/M instead of $1000/M; 2 out.
    charged = charge_ticks(PRICE.for_route(Decimal("250")).cost(3, 2, 2))
    assert charged < charge_ticks(PRICE.cost(3, 2))
    [item] = items(db, run_id)
    assert (item["usage_input"], item["usage_cached"], item["charge"]) == (3, 2, charged)
    run = load(db, run_id)
    assert (run.input_tokens, run.cached_input_tokens, run.charge) == (3, 2, charged)
    assert balance(db, org) == ledger.Balance(CREDIT, charged, 0)
