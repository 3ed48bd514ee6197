"""Waiting in tests: on a condition, bounded only against a hang.

A test waits for what it needs (a line printed, a row written, an event set, a
process answering), never for time to pass: time that matters to the code is
moved on the injectable clock. The wall clock only bounds a hang, and one bound
serves every wait, so a slow machine (two test processes beside builds and
other suites) never fails a wait that was going to end. ``HANG_S`` is that
bound: a wait that outlasts it has hung, and fails naming what it waited for.
It is below the per-test limit (``timeout`` in pyproject.toml) so that the wait
that hung, not the test as a whole, is what a failure names; set
``BATCHYARD_TEST_HANG_S`` to change it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["HANG_S", "settles", "until"]

#: Seconds after which a wait in a test is a hang (a subprocess, a client, a poll).
HANG_S = float(os.environ.get("BATCHYARD_TEST_HANG_S", "240"))

T = TypeVar("T")


async def until(
    condition: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition holds",
    *,
    interval: float = 0.005,
    detail: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` (sync or async) until it holds; a hang after ``HANG_S`` seconds.

    Each poll yields to the loop, so tasks of the same loop (a server in process,
    a background worker) run between looks. ``detail`` adds what a hang's failure
    should show (the output of the processes waited on).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"hung: waited {HANG_S:g} s until {what}{more}")
        await asyncio.sleep(interval)


async def settles(awaitable: Awaitable[T], what: str = "it settles") -> T:
    """Await ``awaitable`` (an event's wait, a task); a hang after ``HANG_S`` seconds."""
    try:
        async with asyncio.timeout(HANG_S) as scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():  # not a TimeoutError of the awaitable's own
            raise AssertionError(f"hung: waited {HANG_S:g} s until {what}") from None
        raise
