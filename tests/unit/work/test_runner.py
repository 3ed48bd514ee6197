"""The leased-work runner on its own: its pipeline, its answer step, its recovery, its loop.

Every kind of background work (runs, file batches, deferred batches) runs on
these pieces, so their rules are tested here once, directly, over an
in-memory lease queue (``tests.support.memory_queue``) on an in-memory store,
with calls the test scripts and a clock only the test moves. The kinds' own
tests (and the fault tests, with real processes killed) show the same rules
through the store's queues.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from batchyard.core.telemetry import MemoryRecorder
from batchyard.errors import (
    StorageUnavailable,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from batchyard.store.database import Database
from batchyard.work.dispatcher import OnSend
from batchyard.work.runner import (
    Answered,
    Ended,
    Failed,
    NotSent,
    Pipeline,
    Renewal,
    Runner,
    Unsent,
    answer,
    failure,
    recover_lapsed,
)
from tests.support.clocks import SleepWatchingClock
from tests.support.memory_queue import MemoryQueue
from tests.support.waits import HANG_S, settles, until
from tests.unit.work.conftest import spin

LEASE_S = 60.0


def pipeline(
    db: Database,
    clock: SleepWatchingClock,
    metrics: MemoryRecorder | None = None,
    draining: Callable[[], bool] = lambda: False,
) -> Pipeline:
    return Pipeline(
        db=db,
        clock=clock,
        metrics=metrics or MemoryRecorder(),
        lease_s=LEASE_S,
        renew_s=5.0,
        flush_s=0.25,
        draining=draining,
        outage_pause_s=2.0,
    )


def render(unit: int, attempt: Answered[Any] | Failed) -> tuple[int, object]:
    if isinstance(attempt, Failed):
        return unit, attempt.error.code
    return unit, attempt.value


class Calls:
    """A scripted engine for units: each call marks itself sent, then answers (or not yet)."""

    def __init__(self, *, gated: bool = False, fail: dict[int, BaseException] | None = None):
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.fail = fail or {}
        self.sent: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def __call__(self, unit: int, on_send: OnSend) -> str:
        await on_send()
        self.sent.append(unit)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1
        if unit in self.fail:
            raise self.fail[unit]
        return f"answer {unit}"


async def within(task: asyncio.Future[Any] | asyncio.Task[Any]) -> Any:
    return await settles(task)  # a hang guard, not a timing assertion


async def test_every_unit_is_answered_once_with_at_most_width_calls_in_flight(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(10)
    calls = Calls()

    ran = await within(pipeline(db, clock).run(queue, width=3, call=calls, render=render))

    assert ran.ended is Ended.DONE
    assert (ran.answered, ran.failed, ran.unsent) == (10, 0, 0)
    assert sorted(calls.sent) == list(range(1, 11))
    assert calls.most_in_flight <= 3
    assert {u.key: (u.state, u.written, u.result) for u in queue.units.values()} == {
        k: ("done", 1, f"answer {k}") for k in range(1, 11)
    }


async def test_a_failed_call_is_recorded_with_its_code_and_never_retried(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(3)
    calls = Calls(fail={2: UpstreamTimeout("slow"), 3: RuntimeError("the engine broke")})

    ran = await within(pipeline(db, clock).run(queue, width=3, call=calls, render=render))

    assert (ran.answered, ran.failed) == (1, 2)
    assert [queue.units[k].result for k in (1, 2, 3)] == [
        "answer 1",
        "upstream_timeout",
        "upstream_error",  # the one mapping for a failure with no code of its own
    ]
    assert sorted(calls.sent) == [1, 2, 3]


def test_one_mapping_from_a_failure_to_its_error() -> None:
    coded = UpstreamTimeout("slow")
    assert failure(coded) is coded
    mapped = failure(KeyError("secret text from the prompt"))
    assert (mapped.code, mapped.message) == ("upstream_error", "the engine failed (KeyError)")


async def test_a_call_refused_before_it_starts_waits_again_and_a_stop_ends_the_claims(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(4)
    sent: list[int] = []

    async def call(unit: int, on_send: OnSend) -> str:
        if unit == 2:
            raise NotSent("no route qualifies now", stop=True)
        await on_send()
        sent.append(unit)
        return "ok"

    ran = await within(pipeline(db, clock).run(queue, width=2, call=call, render=render))

    # Units 1 and 2 were claimed together; 2 went back unsent and stopped the claims.
    assert ran.ended is Ended.DONE and ran.unsent == 1
    assert sent == [1]
    assert [queue.state(k) for k in (1, 2, 3, 4)] == ["done", "waiting", "waiting", "waiting"]
    assert queue.units[2].written == 0


async def test_a_unit_no_longer_ours_is_never_sent_and_never_written(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(2)
    steal = asyncio.Event()
    sent: list[int] = []

    async def call(unit: int, on_send: OnSend) -> str:
        if unit == 2:
            await steal.wait()  # still waiting for its turn (the route's pace)
        await on_send()
        sent.append(unit)
        return "ok"

    task = asyncio.create_task(pipeline(db, clock).run(queue, width=2, call=call, render=render))
    while sent != [1]:
        await asyncio.sleep(0.01)
    # Its lease lapsed meanwhile and another worker claimed it: a new token, another owner.
    stolen = queue.units[2]
    stolen.token, stolen.owner = stolen.token + 1, "wkr.b"
    steal.set()
    ran = await within(task)

    assert (ran.answered, ran.unsent) == (1, 1)
    assert sent == [1]
    assert (stolen.state, stolen.owner, stolen.sent, stolen.written) == (
        "claimed",
        "wkr.b",
        False,
        0,
    )


async def test_an_outage_before_the_send_hands_the_unit_back_after_a_pause(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(1)
    queue.mark_outages = 1  # the store refuses the first sent mark
    calls = Calls()
    task = asyncio.create_task(pipeline(db, clock).run(queue, width=1, call=calls, render=render))

    assert await within(clock.next_sleep()) == 2.0  # the outage pause, on the clock
    assert calls.sent == [] and queue.units[1].sent is False
    clock.advance(2.0)
    ran = await within(task)

    assert (ran.unsent, ran.answered) == (1, 1)
    assert queue.units[1].claims == 2 and queue.units[1].written == 1


async def test_a_call_refused_at_the_connection_waits_for_its_route_and_is_not_sent_twice(
    db: Database, clock: SleepWatchingClock
) -> None:
    # Marked sent, then the route refused the connection: nothing left, so the unit's
    # mark is taken back and it waits (after the pause) instead of failing.
    calls = Calls(fail={1: UpstreamUnreachable("upstream unreachable (ClientConnectorError)")})
    queue = MemoryQueue.of(1)
    task = asyncio.create_task(pipeline(db, clock).run(queue, width=1, call=calls, render=render))

    assert await within(clock.next_sleep()) == 2.0  # the pause, on the clock
    assert calls.sent == [1] and queue.units[1].sent is True
    del calls.fail[1]  # the route is back
    clock.advance(2.0)
    ran = await within(task)

    assert (ran.unsent, ran.answered, ran.failed) == (1, 1, 0)
    assert calls.sent == [1, 1] and queue.units[1].written == 1
    assert queue.units[1].claims == 2


async def test_a_streak_of_failures_stops_claiming(db: Database, clock: SleepWatchingClock) -> None:
    queue = MemoryQueue.of(20)
    calls = Calls(fail={k: UpstreamError("down") for k in range(1, 21)})

    ran = await within(
        pipeline(db, clock).run(queue, width=2, call=calls, render=render, failure_streak=4)
    )

    assert ran.streak_error is not None and ran.streak_error.code == "upstream_error"
    assert 4 <= ran.failed < 20
    assert [u.state for u in queue.units.values()].count("waiting") == 20 - ran.failed


async def test_a_stopping_renewal_lets_calls_in_flight_land_and_claims_nothing_more(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(6)
    calls = Calls(gated=True)
    task = asyncio.create_task(pipeline(db, clock).run(queue, width=2, call=calls, render=render))
    while len(calls.sent) < 2:
        await asyncio.sleep(0.01)
    queue.renewal = Renewal.STOPPING  # the batch was cancelled
    calls.gate.set()
    ran = await within(task)

    assert ran.ended is Ended.DONE and ran.answered == 2
    assert [queue.state(k) for k in range(1, 7)] == ["done"] * 2 + ["waiting"] * 4


async def test_a_lost_lease_ends_the_pipeline_and_writes_nothing_more(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(4)
    calls = Calls(gated=True)
    task = asyncio.create_task(pipeline(db, clock).run(queue, width=2, call=calls, render=render))
    while len(calls.sent) < 2:
        await asyncio.sleep(0.01)
    queue.renewal = Renewal.LOST  # another worker claimed the scope
    calls.gate.set()
    ran = await within(task)

    assert ran.ended is Ended.LOST
    assert all(u.written == 0 for u in queue.units.values())


async def test_a_drain_lets_calls_in_flight_land_and_hands_the_rest_back(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(5)
    draining = [False]
    calls = Calls(gated=True)
    p = pipeline(db, clock, draining=lambda: draining[0])
    task = asyncio.create_task(p.run(queue, width=2, call=calls, render=render))
    while len(calls.sent) < 2:
        await asyncio.sleep(0.01)
    draining[0] = True  # SIGTERM: claim and send nothing more
    calls.gate.set()  # the calls in flight land within the grace period
    ran = await within(task)

    assert ran.ended is Ended.HANDED_OVER
    assert sorted(calls.sent) == [1, 2]
    assert [queue.state(k) for k in range(1, 6)] == ["done", "done"] + ["waiting"] * 3
    assert all(u.owner is None for u in queue.units.values())


async def test_a_drain_cut_off_makes_only_the_sent_call_uncertain(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(3)
    metrics = MemoryRecorder()
    draining = [False]
    one_slot = asyncio.Semaphore(1)  # the route runs one call at a time
    calls = Calls(gated=True)

    async def call(unit: int, on_send: OnSend) -> str:
        async with one_slot:
            return await calls(unit, on_send)

    p = pipeline(db, clock, metrics, draining=lambda: draining[0])
    task = asyncio.create_task(p.run(queue, width=3, call=call, render=render))
    while len(calls.sent) < 1:
        await asyncio.sleep(0.01)
    draining[0] = True
    task.cancel()  # the grace period ended with the call still in flight
    with pytest.raises(asyncio.CancelledError):
        await within(task)

    (started,) = calls.sent
    assert queue.state(started) == "uncertain"
    assert sorted(queue.state(k) for k in (1, 2, 3) if k != started) == ["waiting", "waiting"]
    assert metrics.counts["uncertain", "memory"] == 1
    assert metrics.counts["leases_recovered", "memory"] == 0  # its own, not a lapsed one


async def test_recovery_counts_each_lapsed_lease_and_each_uncertain_unit_once(
    db: Database, clock: SleepWatchingClock
) -> None:
    queue = MemoryQueue.of(3, owner="wkr.dead")
    now = clock.now()
    queue.claim(None, 3, now, clock.now())  # a worker that will never renew
    queue.mark_sent(None, {1: queue_lease(queue, 1)}, now)
    metrics = MemoryRecorder()

    assert (await recover_lapsed(db, clock, metrics, queue)).uncertain == 0  # not lapsed yet
    clock.advance(1)
    recovered = await recover_lapsed(db, clock, metrics, queue)

    assert (recovered.leases, recovered.uncertain, recovered.returned) == (3, 1, 2)
    assert [queue.state(k) for k in (1, 2, 3)] == ["uncertain", "waiting", "waiting"]
    assert metrics.counts["leases_recovered", "memory"] == 3
    assert metrics.counts["uncertain", "memory"] == 1
    assert (await recover_lapsed(db, clock, metrics, queue)).leases == 0  # once


def queue_lease(queue: MemoryQueue, key: int) -> Any:
    from batchyard.core.leases import Lease

    unit = queue.units[key]
    return Lease(unit.owner or "", unit.token)


async def test_answer_sees_a_refused_call_as_unsent_and_a_started_one_as_answered(
    clock: SleepWatchingClock,
) -> None:
    async def refuse() -> None:
        raise NotSent("the worker is stopping")

    async def allow() -> None:
        return None

    async def call(on_send: OnSend) -> str:
        await on_send()
        return "ok"

    assert await answer(call, refuse, clock=clock, outage_pause_s=1) == Unsent(
        "the worker is stopping"
    )
    assert await answer(call, allow, clock=clock, outage_pause_s=1) == Answered("ok")

    async def out_after_send(on_send: OnSend) -> str:
        await on_send()
        raise StorageUnavailable("gone")

    failed = await answer(out_after_send, allow, clock=clock, outage_pause_s=1)
    assert isinstance(failed, Failed) and failed.error.code == "storage_unavailable"


async def test_a_call_the_upstream_did_not_take_is_sent_again_a_bounded_number_of_times(
    clock: SleepWatchingClock,
) -> None:
    marks: list[int] = []
    refusals = [
        UpstreamError("upstream failed with HTTP 503", not_taken=True, retry_after=3.0),
        UpstreamError("upstream failed with HTTP 503", not_taken=True),
    ]

    async def mark() -> None:
        marks.append(1)

    async def call(on_send: OnSend) -> str:
        await on_send()
        if refusals:
            raise refusals.pop(0)
        return "ok"

    task = asyncio.create_task(
        answer(call, mark, clock=clock, outage_pause_s=1, unavailable_retries=2)
    )
    assert await within(clock.next_sleep()) == 3.0  # the upstream's Retry-After
    clock.advance(3.0)
    assert await within(clock.next_sleep()) == 1  # else the outage pause
    clock.advance(1.0)
    assert await within(task) == Answered("ok")
    assert len(marks) == 3  # each attempt marked sent, right before it

    # Past the bound it fails; a 5xx that may have reached the engine is never sent again.
    refusals[:] = [UpstreamError("503", not_taken=True)] * 2
    once = asyncio.create_task(
        answer(call, mark, clock=clock, outage_pause_s=1, unavailable_retries=1)
    )
    assert await within(clock.next_sleep()) == 1
    clock.advance(1.0)
    failed = await within(once)
    assert isinstance(failed, Failed) and failed.error.code == "upstream_error"
    marks.clear()
    refusals[:] = [UpstreamError("upstream failed with HTTP 500")]
    reached = await answer(call, mark, clock=clock, outage_pause_s=1, unavailable_retries=5)
    assert isinstance(reached, Failed) and marks == [1]


class Counting(Runner):
    """A runner whose rounds the test counts, with a task per round it can hold open."""

    def __init__(self, clock: SleepWatchingClock, *, timed: bool) -> None:
        super().__init__(name="counting", clock=clock, poll_s=30.0, timed=timed)
        self.rounds = 0
        self.release = asyncio.Event()

    async def round(self) -> bool:
        self.rounds += 1
        if not self.draining and "work" not in self.active:
            self.start("work", self.release.wait())
        return False


async def test_the_loop_wakes_on_notify_drains_and_stops(clock: SleepWatchingClock) -> None:
    worker = Counting(clock, timed=True)
    loop = asyncio.create_task(worker.run_forever())
    await spin()
    assert worker.rounds == 1
    worker.notify()
    await spin()
    assert worker.rounds == 2  # woken at once, no time passed

    worker.drain()
    assert await worker.wait_idle(0.05) is False  # its task is still in hand
    worker.release.set()
    assert await worker.wait_idle(HANG_S) is True
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loop
    assert worker.stopped and not worker.active


async def test_a_timed_loop_waits_on_the_clock_and_a_poll_on_real_time_too(
    clock: SleepWatchingClock,
) -> None:
    timed = Counting(clock, timed=True)
    polled = Counting(clock, timed=False)
    polled.poll_s = 0.05
    tasks = [asyncio.create_task(w.run_forever()) for w in (timed, polled)]
    # Real time passes, the clock stands still: the poll goes round, the timed loop waits.
    await until(lambda: polled.rounds > 2, "the poll goes round on real time")
    assert timed.rounds == 1
    clock.advance(30)
    await spin()
    assert timed.rounds == 2
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
