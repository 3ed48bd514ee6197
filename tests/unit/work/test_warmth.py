"""Warmth's wait for a version's load, on a clock the test moves.

The fallback budget runs from the call: a caller that asks to wait 10 s and
then sees the clock pass 10 s gets its answer, even when the clock moved
before the sleeper it started had its first turn on the event loop (a busy
loop makes that order likely; the integration test that found it hung).
"""

from __future__ import annotations

import asyncio

from batchyard.engines.scripted import ScriptedEngine
from batchyard.store.database import Database
from batchyard.work.warmth import Serving, Warmth
from tests.support.clocks import SleepWatchingClock
from tests.support.waits import settles
from tests.unit.work.conftest import make_dispatcher, route


async def test_the_wait_runs_from_the_call_when_the_clock_moves_before_the_sleeper_starts(
    clock: SleepWatchingClock, db: Database
) -> None:
    dispatcher = make_dispatcher(db, clock, ScriptedEngine("a", clock=clock))
    warmth = Warmth(clock=clock, engines=dispatcher.engines, dispatcher=dispatcher)
    never = asyncio.Event()

    async def load() -> str:
        await never.wait()
        return "loaded"

    waiting = asyncio.ensure_future(warmth.run("v", Serving(route(), "up-v"), load, wait_s=10))
    # One turn: the call has started the load and its sleeper, neither has run yet.
    await asyncio.sleep(0)
    clock.advance(10)
    assert await settles(waiting, "the 10-second wait ends") == (False, None)
    # The load given up on goes on in the background, and marks the version warm.
    never.set()
    pending = warmth._versions["v"].loading
    assert pending is not None and await settles(pending) == "loaded"
    assert warmth.view("v", Serving(route(), "up-v")).state == "warm"
