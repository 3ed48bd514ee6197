"""The work layer's unit tier: an in-memory store, a clock the test moves, no server.

- ``clock``: a ManualClock that also reports what each waiter asked to sleep
  for, so a test can wait for "the dispatcher is pacing" and then move time.
- ``db``: a migrated in-memory store per test; the ledger audit must be clean
  when the test ends, whatever it did with the money.
- ``MODEL`` and ``route()``: a catalog model priced in round numbers (one
  input token costs $0.001, one output token $0.002) whose tokenizer is the
  fallback one, so no model file is needed, and a route to it whose engine
  the test puts in place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from typing import Any, TypeVar

import pytest

from batchyard.core.catalog import Catalog, ModelSpec, RouteSpec
from batchyard.core.limits import InMemoryLimiter
from batchyard.core.prices import Price
from batchyard.core.tiers import DEFAULT_TIERS
from batchyard.engines.protocol import Engine
from batchyard.store import ledger
from batchyard.store.database import Database
from batchyard.work.dispatcher import Dispatcher
from batchyard.work.engines import EngineRegistry
from tests.support.clocks import SleepWatchingClock
from tests.support.memory_db import memory_copy
from tests.support.waits import HANG_S

MODEL = ModelSpec(
    "m",
    input_per_mtok=Decimal("1000"),
    output_per_mtok=Decimal("2000"),
    context_window=4096,
    tokenizer="fallback",
    max_output_tokens=256,
)
PRICE = Price(MODEL.input_per_mtok, MODEL.output_per_mtok)

T = TypeVar("T")


def route(**limits: Any) -> RouteSpec:
    """The model's route; its engine is whatever the test registers for ``"r"``."""
    return RouteSpec(
        "r", MODEL.id, "openai_http", "up-m", base_url="http://upstream.invalid", **limits
    )


def catalog(**limits: Any) -> Catalog:
    return Catalog([MODEL], [route(**limits)])


def make_dispatcher(
    db: Database,
    clock: SleepWatchingClock,
    engine: Engine,
    *,
    upstream_429_retries: int = 5,
) -> Dispatcher:
    return Dispatcher(
        db=db,
        clock=clock,
        limiter=InMemoryLimiter(clock),
        engines=EngineRegistry(overrides={"r": engine}),
        tiers=DEFAULT_TIERS,
        upstream_429_retries=upstream_429_retries,
    )


async def spin(turns: int = 20) -> None:
    """Let every task that can run without time passing or I/O take its turns."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def drive(clock: SleepWatchingClock, task: asyncio.Task[T]) -> T:
    """Await ``task``, moving the clock to each waiter's wake-up as it asks to sleep.

    The clock moves only when something waits on it, by what that waiter
    asked for, so paced work runs in clock time without any real sleeping.
    Each step is bounded only against a hang (``tests.support.waits``).
    """
    while True:
        sleeping = asyncio.ensure_future(clock.sleeping.wait())
        done, _ = await asyncio.wait(
            {task, sleeping}, timeout=HANG_S, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            sleeping.cancel()
            return task.result()
        assert done, "the task neither finished nor waited on the clock"
        clock.sleeping.clear()
        clock.advance(clock.sleeps[-1])


@pytest.fixture
def clock() -> SleepWatchingClock:
    return SleepWatchingClock()


@pytest.fixture
def db() -> Iterator[Database]:
    database = memory_copy()
    try:
        yield database
        problems = database.read_sync(ledger.audit)
        assert problems == [], problems
    finally:
        database.close()
