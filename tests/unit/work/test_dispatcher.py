"""The dispatcher on its own: reserve, pace, call, settle or release, and upstream 429s.

Every front door ends in ``Dispatcher``, so its order of operations is the
billing promise: the most a call can cost is held first (402 before anything
runs), the route's pace is waited out on the clock, and the call is settled
to its real usage with its activity record, or released with the reason.
These tests use the shipped ScriptedEngine, the in-memory limiter, an
in-memory store and a clock that only the test moves; the ledger audit runs
after each (the ``db`` fixture).
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Connection, select

from batchyard.core.catalog import RouteSpec
from batchyard.core.limits import PENALTY, InMemoryLimiter, RateLimitSignal
from batchyard.core.money import charge_ticks, quote_ticks, to_ticks
from batchyard.core.route_pace import PACE_MARGIN
from batchyard.core.telemetry import MemoryRecorder
from batchyard.engines.protocol import CompletionRequest, Usage
from batchyard.engines.scripted import ScriptedEngine
from batchyard.errors import InsufficientCredit, UpstreamError, UpstreamRateLimited
from batchyard.store import activity, billing, ledger
from batchyard.store.database import Database
from batchyard.store.tables import ledger_entries, reservations
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry
from tests.support.clocks import SleepWatchingClock
from tests.support.run_store import add_org, balance
from tests.unit.work.conftest import MODEL, PRICE, make_dispatcher, route, spin

PROMPT = [{"role": "user", "content": "one two three four"}]  # 4 words: 4 tokens in
CREDIT = to_ticks(Decimal("10"))


def request(max_tokens: int = 16, n: int = 1) -> CompletionRequest:
    return CompletionRequest(model="up-m", messages=PROMPT, max_tokens=max_tokens, n=n)


def most(max_tokens: int = 16) -> int:
    """The hold for one call of ``request(max_tokens)``: 4 tokens in, ``max_tokens`` out."""
    return quote_ticks(PRICE.cost(4, max_tokens))


def paid(org_id: str, **route_limits: Any) -> dict[str, Any]:
    """What a paid call of these tests names: its organisation, model, route, request and hold."""
    return {
        "org_id": org_id,
        "model": MODEL,
        "route": route(**route_limits),
        "requests": [(request(), 4)],
        "max_cost": most(),
        "price": PRICE,
        "purpose": "chat",
        "ref": "chat.1",
    }


async def execute(d: Dispatcher, org_id: str, **route_limits: Any) -> Any:
    return await d.execute(**paid(org_id, **route_limits))


def held_reservations(db: Database) -> list[ledger.Reservation]:
    def q(c: Connection) -> list[ledger.Reservation]:
        ids = c.execute(select(reservations.c.id).order_by(reservations.c.id)).scalars()
        return [ledger.get_reservation(c, i) for i in ids]

    return db.read_sync(q)


def entries_of(db: Database, reservation_id: str) -> dict[str, int]:
    def q(c: Connection) -> dict[str, int]:
        rows = c.execute(
            select(ledger_entries.c.kind, ledger_entries.c.amount).where(
                ledger_entries.c.reservation_id == reservation_id
            )
        ).all()
        kinds = [r.kind for r in rows]
        assert len(kinds) == len(set(kinds)), kinds
        return {r.kind: r.amount for r in rows}

    return db.read_sync(q)


def activity_of(db: Database, org_id: str) -> list[dict[str, Any]]:
    return db.read_sync(lambda c: activity.list_activity(c, org_id))


@pytest.fixture
def org(db: Database, clock: SleepWatchingClock) -> str:
    return add_org(db, clock.now(), credit="10")


# -- reserve ------------------------------------------------------------------------


async def test_credit_short_of_the_most_a_call_can_cost_is_a_402_before_anything_runs(
    db: Database, clock: SleepWatchingClock
) -> None:
    poor = add_org(db, clock.now(), name="poor", credit="0.03")
    assert most() == to_ticks(Decimal("0.036"))  # 4 x $0.001 + 16 x $0.002
    engine = ScriptedEngine("a b c", clock=clock)
    d = make_dispatcher(db, clock, engine)

    with pytest.raises(InsufficientCredit) as raised:
        await execute(d, poor, rpm=1)

    assert raised.value.status == 402
    assert engine.calls == []
    assert held_reservations(db) == []
    assert balance(db, poor) == ledger.Balance(to_ticks(Decimal("0.03")), 0, 0)
    assert activity_of(db, poor) == []
    # Nor did it take the route's one request a minute: the next caller goes at once.
    await d.call(route=route(rpm=1), request=request(), input_tokens=4)
    assert clock.sleeps == []


# -- pace ---------------------------------------------------------------------------


async def test_route_rpm_makes_the_second_call_wait_one_interval_of_clock_time(
    db: Database, clock: SleepWatchingClock
) -> None:
    seen: list[float] = []

    def answer(_: CompletionRequest) -> str:
        seen.append(clock.time())
        return "ok"

    engine = ScriptedEngine(answer, clock=clock)
    d = make_dispatcher(db, clock, engine)
    t0 = clock.time()

    await d.call(route=route(rpm=60), request=request(), input_tokens=4)
    assert clock.sleeps == []
    second = asyncio.create_task(d.call(route=route(rpm=60), request=request(), input_tokens=4))
    # One interval of the pace: the route's rate less the margin kept for jitter.
    interval = 1.0 / (1.0 - PACE_MARGIN)
    assert await clock.next_sleep() == pytest.approx(interval)

    clock.advance(interval - 0.001)
    await spin()
    assert not second.done()
    assert len(engine.calls) == 1

    clock.advance(0.002)
    await second
    assert seen[0] == t0 and seen[1] - t0 == pytest.approx(interval + 0.001)


@pytest.mark.parametrize(("n", "wait"), [(1, 3.0), (2, 4.0)])
async def test_route_tpm_counts_the_prompt_and_every_sample_s_most_output(
    db: Database, clock: SleepWatchingClock, n: int, wait: float
) -> None:
    # 600 tokens a minute is 10 a second; 20 in + n x 10 out must drain first.
    engine = ScriptedEngine("ok", clock=clock)
    d = make_dispatcher(db, clock, engine)
    paced = route(tpm=600)

    await d.call(route=paced, request=request(max_tokens=10, n=n), input_tokens=20)
    second = asyncio.create_task(
        d.call(route=paced, request=request(max_tokens=10, n=n), input_tokens=20)
    )
    assert await clock.next_sleep() == pytest.approx(wait)
    clock.advance(wait)
    await second
    assert len(engine.calls) == 2


async def test_an_upstream_s_exhausted_allowance_holds_the_route_until_its_reset(
    db: Database, clock: SleepWatchingClock
) -> None:
    signal = RateLimitSignal(remaining_requests=0, reset_requests_s=3.0)
    engine = ScriptedEngine("ok", clock=clock, rate_limit=signal)
    d = make_dispatcher(db, clock, engine)

    await d.call(route=route(), request=request(), input_tokens=4)
    second = asyncio.create_task(d.call(route=route(), request=request(), input_tokens=4))
    assert await clock.next_sleep() == pytest.approx(3.0)
    assert len(engine.calls) == 1
    clock.advance(3.0)
    await second
    assert len(engine.calls) == 2


async def test_route_concurrency_admits_one_call_at_a_time(
    db: Database, clock: SleepWatchingClock
) -> None:
    engine = ScriptedEngine("ok", clock=clock, delay_s=1.0)
    d = make_dispatcher(db, clock, engine)
    one = route(concurrency=1)

    calls = [
        asyncio.create_task(d.call(route=one, request=request(), input_tokens=4)) for _ in range(2)
    ]
    for _ in calls:
        assert await clock.next_sleep() == pytest.approx(1.0)
        assert engine.in_flight == 1
        clock.advance(1.0)
    await asyncio.gather(*calls)
    assert engine.max_in_flight == 1


# -- call and settle ----------------------------------------------------------------


async def test_a_call_is_settled_to_its_real_usage_with_its_activity_record(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    engine = ScriptedEngine("a b c", clock=clock)  # 3 words out
    d = make_dispatcher(db, clock, engine)

    result = await execute(d, org)

    charge = to_ticks(Decimal("0.010"))  # 4 x $0.001 + 3 x $0.002
    assert charge == charge_ticks(PRICE.cost(4, 3))
    assert result.completion.usage == Usage(4, 3)
    assert result.charge == charge
    assert result.route == "r"
    [res] = held_reservations(db)
    assert (res.id, res.state, res.amount, res.charged) == (
        result.reservation_id,
        "settled",
        most(),
        charge,
    )
    assert (res.purpose, res.ref) == ("chat", "chat.1")
    assert entries_of(db, res.id) == {
        "reserve": most(),
        "settle": charge,
        "release": most() - charge,
    }
    assert balance(db, org) == ledger.Balance(CREDIT, charge, 0)
    [act] = activity_of(db, org)
    assert (act["kind"], act["reservation_id"], act["amount"], act["ref"]) == (
        "charge",
        res.id,
        charge,
        "chat.1",
    )
    assert act["detail"] == {
        "purpose": "chat",
        "model": "m",
        "route": "r",
        "input_tokens": 4,
        "output_tokens": 3,
        # The price it was charged at: what lets the audit price the charge again.
        "price": {"input_per_mtok": "1000", "output_per_mtok": "2000"},
    }


async def test_settlement_and_its_activity_record_commit_together_or_not_at_all(
    db: Database, clock: SleepWatchingClock, org: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the activity table is unwritable")

    monkeypatch.setattr(activity, "record", refuse)
    d = make_dispatcher(db, clock, ScriptedEngine("a b c", clock=clock))

    with pytest.raises(RuntimeError, match="unwritable"):
        await execute(d, org)

    # The settle entry rolled back with the record: the hold stays, as for any
    # call whose outcome the ledger did not learn (its error says: inspect Activity).
    [res] = held_reservations(db)
    assert res.state == "held"
    assert entries_of(db, res.id) == {"reserve": most()}
    assert balance(db, org) == ledger.Balance(CREDIT, 0, most())


async def test_a_charge_above_its_hold_posts_the_hold_and_is_recorded_counted_and_audited(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    d = make_dispatcher(db, clock, ScriptedEngine(clock=clock))
    d.metrics = recorder = MemoryRecorder()
    terms = {"model": MODEL, "route": route(), "price": PRICE, "purpose": "decide"}
    async with d.paying(org, 1000, **terms, ref="dec.1") as pay:
        charged = await pay.settle(Usage(7, 2), {"outcomes": 2})

    owed = charge_ticks(PRICE.cost(7, 2))
    assert owed > charged == 1000
    assert entries_of(db, pay.reservation.id) == {"reserve": 1000, "settle": 1000}
    [act] = activity_of(db, org)
    assert act["amount"] == 1000
    assert act["detail"] == {
        "purpose": "decide",
        "model": MODEL.id,
        "route": route().id,
        "input_tokens": 7,
        "output_tokens": 2,
        "price": {"input_per_mtok": "1000", "output_per_mtok": "2000"},
        "outcomes": 2,
        # Never capped silently: what the hold did not cover is on the record ...
        "over_hold": owed - 1000,
    }
    # ... counted on /metrics ...
    assert recorder.counts["over_hold", "decide"] == 1
    # ... and listed by `batchyard audit`.
    [problem] = db.read_sync(billing.audit_charges)
    assert act["id"] in problem and "above its hold" in problem


# -- the one way to pay -------------------------------------------------------------


async def test_paying_settles_what_the_block_used_at_the_route_s_price_once(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    d = make_dispatcher(db, clock, ScriptedEngine(clock=clock))
    cached = route(cached_input_per_mtok=Decimal("250"))
    async with d.paying(
        org, most(), model=MODEL, route=cached, price=PRICE, purpose="chat", ref="c.1"
    ) as pay:
        charged = await pay.settle(Usage(4, 3, cached_input_tokens=2))
    # 2 tokens in at $0.001, 2 cached at $0.00025, 3 out at $0.002: the one rule (core).
    assert charged == pay.ticks == charge_ticks(Decimal("0.0085")) <= most()
    assert entries_of(db, pay.reservation.id)["settle"] == charged
    [act] = activity_of(db, org)
    assert act["detail"]["price"] == {
        "input_per_mtok": "1000",
        "output_per_mtok": "2000",
        "cached_input_per_mtok": "250",
    }
    # The record names the usage and the price, and the audit finds the charge to be them.
    assert db.read_sync(billing.audit_charges) == []


async def test_paying_releases_the_hold_when_the_block_fails_or_never_settles(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    d = make_dispatcher(db, clock, ScriptedEngine(clock=clock))
    paid = {"model": MODEL, "route": route(), "price": PRICE, "purpose": "chat"}
    with pytest.raises(UpstreamError):
        async with d.paying(org, most(), **paid, ref="c.1"):
            raise UpstreamError("the upstream broke")
    async with d.paying(org, most(), **paid, ref="c.2") as unused:
        pass
    assert unused.ticks == 0
    assert {(a["ref"], a["kind"], a["detail"]["reason"]) for a in activity_of(db, org)} == {
        ("c.1", "release", "upstream_error"),
        ("c.2", "release", "unanswered"),
    }
    assert balance(db, org) == ledger.Balance(CREDIT, 0, 0)


# -- release on failure -------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (UpstreamError("the upstream fell over"), "upstream_error"),
        (ConnectionResetError("reset by peer"), "ConnectionResetError"),
    ],
)
async def test_a_failed_call_is_released_and_charges_nothing(
    db: Database, clock: SleepWatchingClock, org: str, failure: Exception, reason: str
) -> None:
    engine = ScriptedEngine("a b c", clock=clock, failures=[failure])
    d = make_dispatcher(db, clock, engine)

    with pytest.raises(type(failure)):
        await execute(d, org)

    assert len(engine.calls) == 1  # no failure but a 429 is retried here
    [res] = held_reservations(db)
    assert (res.state, res.charged) == ("released", 0)
    assert entries_of(db, res.id) == {"reserve": most(), "release": most()}
    assert balance(db, org) == ledger.Balance(CREDIT, 0, 0)
    [act] = activity_of(db, org)
    assert (act["kind"], act["reservation_id"], act["amount"]) == ("release", res.id, most())
    assert act["detail"] == {"reason": reason}


async def test_a_call_canceled_while_it_waits_for_the_route_is_released(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    engine = ScriptedEngine("a b c", clock=clock)
    d = make_dispatcher(db, clock, engine)
    await d.call(route=route(rpm=1), request=request(), input_tokens=4)

    waiting = asyncio.create_task(execute(d, org, rpm=1))
    assert await clock.next_sleep() == pytest.approx(60.0 / (1.0 - PACE_MARGIN))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting

    assert len(engine.calls) == 1
    [res] = held_reservations(db)
    assert res.state == "released"
    assert balance(db, org) == ledger.Balance(CREDIT, 0, 0)
    [act] = activity_of(db, org)
    assert act["detail"] == {"reason": "CancelledError"}


# -- upstream 429 -------------------------------------------------------------------


async def test_an_upstream_429_penalises_the_route_for_every_caller_and_retries_on_the_same_hold(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    limiter = InMemoryLimiter(clock)
    engine = ScriptedEngine(
        "a b c", clock=clock, failures=[UpstreamRateLimited("slow down", retry_after=2.0)]
    )
    d = Dispatcher(
        db=db,
        clock=clock,
        limiter=limiter,
        engines=EngineRegistry(overrides={"r": engine}),
        tiers=(),
    )

    first = asyncio.create_task(execute(d, org))
    assert await clock.next_sleep() == pytest.approx(2.0)
    assert len(engine.calls) == 1
    verdict = await limiter.try_acquire("route:r", [])
    assert (verdict.allowed, verdict.limit) == (False, PENALTY)
    assert verdict.retry_after == pytest.approx(2.0)

    # Another caller of the route, with no 429 of its own, waits the penalty out too.
    other = asyncio.create_task(d.call(route=route(), request=request(), input_tokens=4))
    assert await clock.next_sleep() == pytest.approx(2.0)
    clock.advance(1.5)
    await spin()
    assert len(engine.calls) == 1

    clock.advance(0.5)
    result = await first
    await other
    assert len(engine.calls) == 3

    charge = to_ticks(Decimal("0.010"))
    assert result.charge == charge
    [res] = held_reservations(db)  # one reservation, one charge
    assert res.id == result.reservation_id
    assert entries_of(db, res.id) == {
        "reserve": most(),
        "settle": charge,
        "release": most() - charge,
    }
    assert [a["kind"] for a in activity_of(db, org)] == ["charge"]
    assert balance(db, org) == ledger.Balance(CREDIT, charge, 0)


async def test_a_429_without_retry_after_holds_the_route_for_one_second(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    engine = ScriptedEngine("a b c", clock=clock, failures=[UpstreamRateLimited("busy")])
    d = make_dispatcher(db, clock, engine)

    first = asyncio.create_task(execute(d, org))
    assert await clock.next_sleep() == pytest.approx(1.0)
    clock.advance(1.0)
    assert (await first).charge == to_ticks(Decimal("0.010"))


@pytest.mark.parametrize(("throttles", "succeeds"), [(2, True), (3, False)])
async def test_more_429s_than_the_retries_allowed_fail_the_call_and_release_it(
    db: Database, clock: SleepWatchingClock, org: str, throttles: int, succeeds: bool
) -> None:
    engine = ScriptedEngine(
        "a b c",
        clock=clock,
        failures=[UpstreamRateLimited("slow down", retry_after=1.0)] * throttles,
    )
    d = make_dispatcher(db, clock, engine, upstream_429_retries=2)

    call = asyncio.create_task(execute(d, org))
    for _ in range(2):  # each retry waits out the Retry-After first
        assert await clock.next_sleep() == pytest.approx(1.0)
        clock.advance(1.0)

    [res_id] = [r.id for r in held_reservations(db)]
    if succeeds:
        assert (await call).charge == to_ticks(Decimal("0.010"))
        assert len(engine.calls) == 3
        assert [a["kind"] for a in activity_of(db, org)] == ["charge"]
        return
    with pytest.raises(UpstreamRateLimited):
        await call
    assert len(engine.calls) == 3
    assert entries_of(db, res_id) == {"reserve": most(), "release": most()}
    assert balance(db, org) == ledger.Balance(CREDIT, 0, 0)
    [act] = activity_of(db, org)
    assert (act["kind"], act["detail"]) == ("release", {"reason": "upstream_rate_limited"})
    # The last 429's Retry-After still holds the route for the next caller.
    verdict = await d.limiter.try_acquire("route:r", [])
    assert not verdict.allowed
    assert verdict.retry_after == pytest.approx(1.0)


# -- streams ------------------------------------------------------------------------


def stream(d: Dispatcher, org_id: str, on_send: Any = None, **route_limits: Any) -> Any:
    words = lambda text: len(text.split())  # noqa: E731
    pay = paid(org_id, **route_limits)
    ((one, n),) = pay.pop("requests")
    return d.stream(**pay, request=one, input_tokens=n, count_tokens=words, on_send=on_send)


async def test_a_stream_refused_before_its_first_piece_is_waited_out_on_the_same_hold(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    """A stream goes through the one paced call: its 429 is retried, its send is marked."""
    engine = ScriptedEngine(
        "a b c", clock=clock, failures=[UpstreamRateLimited("slow down", retry_after=2.0)]
    )
    d = make_dispatcher(db, clock, engine)
    marks: list[int] = []

    async def on_send() -> None:
        marks.append(len(engine.calls))  # before the engine: its calls so far

    async def read() -> list[Any]:
        return [piece async for piece in stream(d, org, on_send)]

    pieces = asyncio.create_task(read())
    assert await clock.next_sleep() == pytest.approx(2.0)  # the upstream's Retry-After
    clock.advance(2.0)
    got = await pieces

    assert len(engine.calls) == 2 and marks == [0, 1]
    assert "".join(p.text for p in got[:-1]) == "a b c"
    result = got[-1]
    [res] = held_reservations(db)  # the 429 did not cost a second hold
    assert res.id == result.reservation_id and result.charge == to_ticks(Decimal("0.010"))
    assert [a["kind"] for a in activity_of(db, org)] == ["charge"]


async def test_a_stream_holds_its_route_s_concurrency_slot_until_it_ends(
    db: Database, clock: SleepWatchingClock, org: str
) -> None:
    engine = ScriptedEngine("a b c", clock=clock)
    d = make_dispatcher(db, clock, engine)
    pieces = stream(d, org, concurrency=1)
    first = await anext(pieces)
    assert first.text == "a"

    other = asyncio.create_task(
        d.call(route=route(concurrency=1), request=request(), input_tokens=4)
    )
    await spin()
    assert len(engine.calls) == 1  # the other call waits for the stream's slot

    rest = [piece async for piece in pieces]
    assert rest[-1].charge == to_ticks(Decimal("0.010"))
    await other
    assert len(engine.calls) == 2


# -- scoring ------------------------------------------------------------------------


async def test_can_score_asks_the_route_s_engine(db: Database, clock: SleepWatchingClock) -> None:
    engines = EngineRegistry(overrides={"scripted": ScriptedEngine(clock=clock)})
    d = Dispatcher(db=db, clock=clock, limiter=InMemoryLimiter(clock), engines=engines, tiers=())
    scripted = RouteSpec("scripted", "m", "openai_http", "up-m", base_url="http://x.invalid")
    http = route()  # no override: the registry builds the real OpenAI-compatible engine
    try:
        assert d.can_score(scripted)
        assert not d.can_score(http)
        with pytest.raises(TypeError, match="cannot score"):
            await d.score(
                route=http, model="up-m", messages=PROMPT, candidates=["yes"], input_tokens=4
            )
    finally:
        await engines.aclose()


async def test_scoring_is_paced_by_the_prompt_and_one_token_per_candidate(
    db: Database, clock: SleepWatchingClock
) -> None:
    engine = ScriptedEngine(clock=clock)
    d = make_dispatcher(db, clock, engine)
    paced = route(tpm=60)  # one token a second
    candidates = ["yes", "no", "maybe"]

    scores, usage = await d.score(
        route=paced, model="up-m", messages=PROMPT, candidates=candidates, input_tokens=2
    )
    assert len(scores) == 3
    assert usage == Usage(4, 3)
    second = asyncio.create_task(
        d.score(route=paced, model="up-m", messages=PROMPT, candidates=candidates, input_tokens=2)
    )
    assert await clock.next_sleep() == pytest.approx(5.0)  # 2 in + 3 candidates
    clock.advance(5.0)
    await second
    assert [c.candidates for c in engine.score_calls] == [candidates, candidates]


async def test_a_429_while_scoring_is_waited_out_and_scored_again(
    db: Database, clock: SleepWatchingClock
) -> None:
    engine = ScriptedEngine(clock=clock, failures=[UpstreamRateLimited("busy", retry_after=4.0)])
    d = make_dispatcher(db, clock, engine)

    scoring = asyncio.create_task(
        d.score(route=route(), model="up-m", messages=PROMPT, candidates=["a"], input_tokens=4)
    )
    assert await clock.next_sleep() == pytest.approx(4.0)
    clock.advance(4.0)
    scores, _ = await scoring
    assert len(scores) == 1
    assert len(engine.score_calls) == 2
