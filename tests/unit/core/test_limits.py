"""The in-process limiter and the GCRA arithmetic every limiter shares.

Time only moves when a test advances the ManualClock; ``acquire`` is driven by
watching what it asks the clock to sleep for and then advancing past it.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchyard.core.clock import ManualClock
from batchyard.core.limits import (
    EPSILON,
    PENALTY,
    Admission,
    Cell,
    InMemoryLimiter,
    Limit,
    SlotGrant,
    cell_for,
    gcra,
    gcra_adjust,
    gcra_many,
    penalty_until,
)
from batchyard.engines.protocol import RateLimitSignal
from batchyard.errors import RateLimited
from tests.support.clocks import SleepWatchingClock
from tests.support.waits import settles

RPM = Limit("rpm", per_minute=60)
TPM = Limit("tpm", per_minute=6000, burst=100)


@pytest.fixture
def clock() -> SleepWatchingClock:
    return SleepWatchingClock()


@pytest.fixture
def limiter(clock: SleepWatchingClock) -> InMemoryLimiter:
    return InMemoryLimiter(clock)


# -- the arithmetic -----------------------------------------------------------


def test_cell_tolerance_is_at_least_the_cost() -> None:
    assert cell_for(TPM, 30) == Cell(0.3, 1.0)
    # A single request larger than the burst is admitted once caught up.
    assert cell_for(TPM, 500) == Cell(5.0, 5.0)


def test_gcra_from_idle_admits_and_schedules_one_interval_ahead() -> None:
    new_tat, wait = gcra(0.0, 100.0, cell_for(RPM, 1))
    assert (new_tat, wait) == (101.0, 0.0)
    new_tat, wait = gcra(new_tat, 100.0, cell_for(RPM, 1))
    assert wait == pytest.approx(1.0)


def test_gcra_many_reports_the_largest_wait_and_its_index() -> None:
    cells = [Cell(0, 0), cell_for(RPM, 1), cell_for(TPM, 50)]
    wait, binding, new_tats = gcra_many([0.0, 103.0, 101.0], 100.0, cells)
    assert binding == 1
    assert wait == pytest.approx(3.0)
    assert new_tats == pytest.approx([100.0, 104.0, 101.5])


def test_refund_goes_back_to_idle_but_no_further() -> None:
    assert gcra_adjust(110.0, 100.0, -4.0) == 106.0
    assert gcra_adjust(110.0, 100.0, -40.0) == 100.0
    assert gcra_adjust(50.0, 100.0, -4.0) == 100.0
    assert gcra_adjust(50.0, 100.0, 2.0) == 102.0


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        (lambda: Limit("rpm", per_minute=0), "per_minute"),
        (lambda: Limit("rpm", per_minute=float("inf")), "per_minute"),
        (lambda: Limit("rpm", per_minute=1, burst=-1), "burst"),
        (lambda: Limit("!penalty", per_minute=1), "name"),
        (lambda: Limit("a:b", per_minute=1), "name"),
    ],
)
def test_nonsense_limits_are_refused(limit, error) -> None:
    with pytest.raises(ValueError, match=error):
        limit()


async def test_negative_cost_and_repeated_names_are_refused(limiter: InMemoryLimiter) -> None:
    with pytest.raises(ValueError, match="cost"):
        await limiter.try_acquire("org:a", [(RPM, -1)])
    with pytest.raises(ValueError, match="repeat"):
        await limiter.try_acquire("org:a", [(RPM, 1), (RPM, 1)])


# -- the in-process limiter ---------------------------------------------------


async def test_even_spacing_from_the_first_second(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    assert await limiter.try_acquire("org:a", [(RPM, 1)]) == Admission(True, 0.0)
    second = await limiter.try_acquire("org:a", [(RPM, 1)])
    assert not second.allowed
    assert second.retry_after == pytest.approx(1.0)
    assert second.limit == "rpm"
    clock.advance(1.0)
    assert (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed


async def test_no_full_bucket_at_start(limiter: InMemoryLimiter) -> None:
    admitted = [(await limiter.try_acquire("org:a", [(RPM, 1)])).allowed for _ in range(60)]
    assert admitted.count(True) == 1


async def test_burst_allows_that_many_ahead_of_schedule(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    limit = Limit("rpm", per_minute=60, burst=5)
    admitted = [(await limiter.try_acquire("org:a", [(limit, 1)])).allowed for _ in range(20)]
    assert admitted.count(True) == 5
    clock.advance(2.0)
    admitted = [(await limiter.try_acquire("org:a", [(limit, 1)])).allowed for _ in range(20)]
    assert admitted.count(True) == 2


async def test_keys_are_independent(limiter: InMemoryLimiter) -> None:
    assert (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed
    assert (await limiter.try_acquire("org:b", [(RPM, 1)])).allowed


async def test_all_or_nothing(limiter: InMemoryLimiter, clock: ManualClock) -> None:
    # Fill the token limit, then ask for a request and tokens together: the
    # token limit refuses, and the request limit must not have been charged.
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).allowed
    refused = await limiter.try_acquire("org:a", [(RPM, 1), (TPM, 100)])
    assert refused == Admission(False, pytest.approx(1.0), "tpm")
    assert (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed


async def test_a_cost_above_burst_waits_for_the_schedule_not_forever(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).allowed
    big = await limiter.try_acquire("org:a", [(TPM, 1000)])
    assert big.allowed is False
    assert big.retry_after == pytest.approx(1.0)
    clock.advance(1.0)
    assert (await limiter.try_acquire("org:a", [(TPM, 1000)])).allowed


async def test_refused_limit_does_not_consume_the_others(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).allowed
    assert not (await limiter.try_acquire("org:a", [(RPM, 1), (TPM, 100)])).allowed
    clock.advance(1.0)
    # Had the refused request taken its RPM slot, this would wait another second.
    assert (await limiter.try_acquire("org:a", [(RPM, 1), (TPM, 100)])).allowed


async def test_refund_lets_the_next_request_through_earlier(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    # Reserve max_tokens=600 (six seconds of a 100/s schedule), use 100.
    assert (await limiter.try_acquire("org:a", [(TPM, 600)])).allowed
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).retry_after == pytest.approx(6.0)
    await limiter.adjust("org:a", TPM, -500)
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).retry_after == pytest.approx(1.0)


async def test_extra_debit_pushes_the_next_request_out(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).allowed
    await limiter.adjust("org:a", TPM, 300)
    assert (await limiter.try_acquire("org:a", [(TPM, 100)])).retry_after == pytest.approx(4.0)


async def test_refund_after_idle_gives_no_credit(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    assert (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed
    clock.advance(30)
    await limiter.adjust("org:a", RPM, -10)
    assert (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed
    assert not (await limiter.try_acquire("org:a", [(RPM, 1)])).allowed


async def test_penalize_blocks_every_limit_under_the_key(
    limiter: InMemoryLimiter, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="batchyard.core.limits"):
        await limiter.penalize("route:r1", clock.time() + 20)
    assert caplog.records[0].limit_key == "route:r1"
    decision = await limiter.try_acquire("route:r1", [(RPM, 1)])
    assert decision == Admission(False, pytest.approx(20.0), PENALTY)
    assert (await limiter.try_acquire("route:r1", [])).allowed is False
    assert (await limiter.try_acquire("route:r2", [(RPM, 1)])).allowed
    # A shorter penalty afterwards does not shorten the longer one.
    await limiter.penalize("route:r1", clock.time() + 5)
    clock.advance(19)
    assert not (await limiter.try_acquire("route:r1", [(RPM, 1)])).allowed
    clock.advance(1)
    assert (await limiter.try_acquire("route:r1", [(RPM, 1)])).allowed


async def test_acquire_waits_on_the_clock(
    limiter: InMemoryLimiter, clock: SleepWatchingClock
) -> None:
    await limiter.acquire("org:a", [(RPM, 1)])
    assert clock.sleeps == []
    waiter = asyncio.create_task(limiter.acquire("org:a", [(RPM, 1)]))
    assert await clock.next_sleep() == pytest.approx(1.0)
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert not waiter.done()
    clock.advance(0.5)
    await settles(waiter)
    assert clock.sleeps == [pytest.approx(1.0)]


async def test_a_penalty_reaches_a_sleeping_waiter(
    limiter: InMemoryLimiter, clock: SleepWatchingClock
) -> None:
    await limiter.acquire("route:r", [(RPM, 1)])
    waiter = asyncio.create_task(limiter.acquire("route:r", [(RPM, 1)]))
    assert await clock.next_sleep() == pytest.approx(1.0)
    await limiter.penalize("route:r", clock.time() + 5)
    clock.advance(1.0)
    assert await clock.next_sleep() == pytest.approx(4.0)
    clock.advance(4.0)
    await settles(waiter)


async def test_acquire_gives_up_past_max_wait(
    limiter: InMemoryLimiter, clock: SleepWatchingClock
) -> None:
    await limiter.acquire("org:a", [(RPM, 1)])
    with pytest.raises(RateLimited) as raised:
        await limiter.acquire("org:a", [(RPM, 1)], max_wait=0.5)
    assert raised.value.retry_after == pytest.approx(1.0)
    assert raised.value.status == 429
    assert clock.sleeps == []
    # Giving up consumed nothing: a second later the next one goes straight in.
    clock.advance(1.0)
    await limiter.acquire("org:a", [(RPM, 1)], max_wait=0)


async def test_observe_turns_exhausted_headers_into_a_penalty(
    limiter: InMemoryLimiter, clock: ManualClock
) -> None:
    await limiter.observe("route:r", RateLimitSignal(remaining_requests=3, reset_requests_s=9))
    assert (await limiter.try_acquire("route:r", [])).allowed
    await limiter.observe("route:r", RateLimitSignal(remaining_tokens=0, reset_tokens_s=7.5))
    assert (await limiter.try_acquire("route:r", [])).retry_after == pytest.approx(7.5)


def test_penalty_until_reads_each_allowance() -> None:
    assert penalty_until(RateLimitSignal(), 100.0) is None
    assert penalty_until(RateLimitSignal(remaining_requests=2, reset_requests_s=5), 100.0) is None
    signal = RateLimitSignal(remaining_requests=0, reset_requests_s=5)
    assert penalty_until(signal, 100.0) == 105.0
    both = RateLimitSignal(
        remaining_requests=0, reset_requests_s=5, remaining_tokens=0, reset_tokens_s=12
    )
    assert penalty_until(both, 100.0) == 112.0
    assert penalty_until(RateLimitSignal(remaining_tokens=0), 100.0) == 101.0
    assert penalty_until(RateLimitSignal(remaining_tokens=0), 100.0, default_reset_s=3) == 103.0


async def test_idle_keys_are_swept(limiter: InMemoryLimiter, clock: ManualClock) -> None:
    for i in range(100):
        await limiter.try_acquire(f"org:{i}", [(RPM, 1)])
    clock.advance(2)
    for _ in range(InMemoryLimiter._SWEEP_EVERY):
        await limiter.try_acquire("org:busy", [(RPM, 0)])
    assert not any(k.startswith("org:1") for k in limiter._tats)


# -- the property -------------------------------------------------------------

steps = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.integers(0, 400)),
        st.tuples(st.just("advance"), st.floats(0, 30, allow_nan=False)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    steps=steps,
    rpm=st.floats(1, 600),
    tpm=st.floats(60, 60000),
    rpm_burst=st.floats(0, 10),
    tpm_burst=st.floats(0, 500),
)
def test_admitted_cost_over_any_window_stays_within_rate_and_burst(
    steps, rpm, tpm, rpm_burst, tpm_burst
) -> None:
    """Over any window of W seconds, admitted cost <= rate * W + max(burst, cost).

    Both limits are checked together on every request, so the bound for each
    also shows that a refusal by one consumed nothing of the other.
    """
    requests = Limit("rpm", per_minute=rpm, burst=rpm_burst)
    tokens = Limit("tpm", per_minute=tpm, burst=tpm_burst)

    async def play() -> list[tuple[float, int]]:
        clock = ManualClock()
        limiter = InMemoryLimiter(clock)
        admitted = []
        for kind, value in steps:
            if kind == "advance":
                clock.advance(value)
            elif (await limiter.try_acquire("org:p", [(requests, 1), (tokens, value)])).allowed:
                admitted.append((clock.time(), value))
        return admitted

    admitted = asyncio.run(play())
    for limit, cost_of in ((requests, lambda c: 1), (tokens, lambda c: c)):
        for i, (start, _) in enumerate(admitted):
            total, largest = 0.0, 0.0
            for at, cost in admitted[i:]:
                total += cost_of(cost)
                largest = max(largest, cost_of(cost))
                bound = limit.per_minute / 60 * (at - start) + max(limit.burst, largest)
                assert total <= bound + limit.per_minute / 60 * EPSILON * 10 + 1e-9


async def test_a_slot_freed_while_the_waiter_s_attempt_is_on_its_way_wakes_it() -> None:
    """The attempt sees the slot taken; the slot is freed before the waiter looks again.

    (A store a round trip away, on a loaded machine.) The wake-up was registered
    before the attempt, so the waiter tries again at once, on a clock that stands still.
    """

    class SlowStore(InMemoryLimiter):
        def __init__(self, clock: ManualClock) -> None:
            super().__init__(clock)
            self.answered = asyncio.Event()
            self.go_on = asyncio.Event()

        async def take_slot(self, key: str, capacity: int, lease_s: float) -> SlotGrant:
            grant = await super().take_slot(key, capacity, lease_s)
            if grant.token is None and not self.answered.is_set():
                self.answered.set()  # the store has answered "full"...
                await self.go_on.wait()  # ...and the answer is still on its way back
            return grant

    limiter = SlowStore(ManualClock())
    held = await limiter.take_slot("org:w", 1, 60)
    waiter = asyncio.create_task(limiter.occupy("org:w", 1, 60, max_wait=30))
    await settles(limiter.answered.wait(), "the waiter's attempt finds the slot taken")
    await limiter.free_slot("org:w", held.token)
    limiter.go_on.set()
    grant = await settles(waiter, "the waiter takes the freed slot")
    assert grant.token is not None
