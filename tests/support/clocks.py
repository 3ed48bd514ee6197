"""Clocks for tests that need to see what a waiter asked to sleep for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from batchyard.core.clock import ManualClock
from tests.support.waits import settles


class SleepWatchingClock(ManualClock):
    """A ManualClock that tells the test what a waiter asked to sleep for."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float] = []
        self.sleeping = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.sleeping.set()
        await super().sleep(seconds)

    async def next_sleep(self) -> float:
        await settles(self.sleeping.wait(), "a waiter sleeps on the clock")
        self.sleeping.clear()
        return self.sleeps[-1]


class ReleasingClock:
    """A following client's clock: each poll lets the engine answer one more call.

    ``sleep`` releases one call (``release``) and returns once ``ended()`` has
    grown, so a reader reads between answers and no real time passes for the
    poll itself; once ``total`` have ended it only gives the batch a moment of
    real time to finish.
    """

    def __init__(self, ended: Callable[[], int], total: int, release: Callable[[], None]) -> None:
        self.ended = ended
        self.total = total
        self.release = release

    def time(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        before = self.ended()
        if before >= self.total:
            await asyncio.sleep(0.01)
            return
        self.release()
        while self.ended() <= before:
            await asyncio.sleep(0.01)
