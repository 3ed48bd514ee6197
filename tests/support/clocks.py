"""Clocks for tests that need to see what a waiter asked to sleep for."""

from __future__ import annotations

import asyncio

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
