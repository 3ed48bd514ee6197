"""The pacers' schedule (async and sync), driven by manual clocks: even from the first second."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchyard.client.pacer import Pacer
from batchyard.client.sync_pacer import SyncPacer
from batchyard.core.clock import ManualClock


async def _send_times(
    pacer: Pacer,
    clock: ManualClock,
    workers: int,
    per_worker: int,
    step: float = 0.05,
    tokens: int = 0,
    after: dict[int, float] | None = None,
) -> list[float]:
    """Times (from start) at which each wait() returned, with ``workers`` tasks."""
    start = clock.time()
    times: list[float] = []

    async def worker() -> None:
        for _ in range(per_worker):
            await pacer.wait(tokens)
            times.append(round(clock.time() - start, 6))
            if after and len(times) in after:
                pacer.push_back(after[len(times)])

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    for _ in range(100_000):
        if all(t.done() for t in tasks):
            break
        for _ in range(3):
            await asyncio.sleep(0)
        clock.advance(step)
    await asyncio.gather(*tasks)
    return sorted(times)


async def test_first_send_is_immediate_and_later_ones_are_evenly_spaced() -> None:
    clock = ManualClock()
    pacer = Pacer(60, headroom=1.0, clock=clock)
    times = await _send_times(pacer, clock, workers=4, per_worker=3)
    assert times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g == pytest.approx(1.0, abs=0.051) for g in gaps)


async def test_no_burst_at_the_start_of_a_minute() -> None:
    clock = ManualClock()
    pacer = Pacer(600, clock=clock)  # 10 a second, aiming at 99%
    times = await _send_times(pacer, clock, workers=50, per_worker=2, step=0.01)
    in_first_second = [t for t in times if t < 1.0]
    assert len(in_first_second) == 10
    rate = (len(times) - 1) / (times[-1] - times[0]) * 60
    assert 0.98 * 600 <= rate <= 600


async def test_token_limit_spaces_long_texts_further() -> None:
    clock = ManualClock()
    pacer = Pacer(600, tpm=6000, headroom=1.0, clock=clock)
    assert pacer.interval(10) == pytest.approx(0.1)
    assert pacer.interval(100) == pytest.approx(1.0)
    times = await _send_times(pacer, clock, workers=3, per_worker=2, tokens=100)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g == pytest.approx(1.0, abs=0.051) for g in gaps)


async def test_push_back_holds_every_worker_including_those_already_waiting() -> None:
    clock = ManualClock()
    pacer = Pacer(60, headroom=1.0, slow_down=1.0, clock=clock)
    # After the 2nd send (t=1) a 429 says wait 5 s: nobody sends before t=6.
    times = await _send_times(pacer, clock, workers=3, per_worker=2, after={2: 5.0})
    assert times[:2] == [0.0, 1.0]
    assert all(t >= 6.0 - 1e-9 for t in times[2:])
    gaps = [b - a for a, b in itertools.pairwise(times[2:])]
    assert all(g >= 1.0 - 0.051 for g in gaps)
    assert pacer.push_backs == 1


def test_push_back_slows_the_pace_a_little() -> None:
    pacer = Pacer(100, headroom=1.0, clock=ManualClock())
    pacer.push_back(1)
    assert pacer.rpm == pytest.approx(100 / 1.02)
    for _ in range(100):
        pacer.push_back(0)
    assert pacer.rpm == pytest.approx(50)


def test_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        Pacer(0)
    with pytest.raises(ValueError):
        Pacer(10, tpm=0)


# The sync pacer, generated from this one ---------------------------------------


class FrozenClock:
    """A sync clock that never moves: every wait asked for is recorded, none is waited."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def time(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


class StepClock(FrozenClock):
    """A sync clock that moves by exactly what is slept."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.now += seconds


def test_sync_pacer_sends_the_first_at_once_and_the_rest_one_interval_apart() -> None:
    clock = StepClock()
    pacer = SyncPacer(60, headroom=1.0, clock=clock)
    sent = []
    for _ in range(4):
        pacer.wait()
        sent.append(clock.time())
    assert sent == pytest.approx([0.0, 1.0, 2.0, 3.0])


def test_sync_pacer_push_back_holds_the_next_send() -> None:
    clock = StepClock()
    pacer = SyncPacer(60, headroom=1.0, slow_down=1.0, clock=clock)
    pacer.wait()
    pacer.push_back(5.0)
    pacer.wait()
    assert clock.time() == pytest.approx(5.0)
    assert pacer.push_backs == 1


def test_threads_sharing_a_sync_pacer_each_get_a_slot_of_their_own() -> None:
    # With time frozen, the n-th reservation waits exactly n intervals: a slot
    # handed out twice would show as a repeated wait.
    clock = FrozenClock()
    pacer = SyncPacer(6000, headroom=1.0, clock=clock)
    threads, each = 8, 50
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: [pacer.wait() for _ in range(each)], range(threads)))
    expected = [pytest.approx(n * 0.01) for n in range(1, threads * each)]
    assert sorted(clock.waits) == expected
