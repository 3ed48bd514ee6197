"""Marking calls sent, many at a time: one statement for the calls that start together.

A worker records each call as sent, durably, just before the engine is
called (``Dispatcher.call``'s ``on_send``), so that after a crash only calls
that really started are ``uncertain``. Against a fast upstream dozens of calls
start within the same instant, and one write per call cost a run much of its
throughput (``bench/runs.py``). ``SentMarks`` gathers the marks asked for in the
same turn of the event loop into one write, and each caller still waits until
its own mark is committed before its call goes out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from datetime import datetime
from typing import Generic, TypeVar

from sqlalchemy import Connection

from batchyard.core.clock import Clock
from batchyard.store.database import Database

__all__ = ["SentMarks"]

K = TypeVar("K", bound=Hashable)


class SentMarks(Generic[K]):
    """``await marks.mark(key)``: True once ``key`` is durably marked sent, False if not ours.

    ``write(keys, now)``, called on the event loop, gives the write that marks
    the keys in one statement (run on the database threads) and returns
    those it marked (the others are no longer this worker's).
    """

    def __init__(
        self,
        db: Database,
        clock: Clock,
        write: Callable[[list[K], datetime], Callable[[Connection], set[K]]],
    ) -> None:
        self._db = db
        self._clock = clock
        self._write = write
        self._pending: dict[K, asyncio.Future[bool]] = {}
        self._flushing: asyncio.Task[None] | None = None

    async def mark(self, key: K) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._pending[key] = fut
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(0)  # the marks asked for in this turn join the write
                batch, self._pending = self._pending, {}
                try:
                    marked = await self._db.write(self._write(list(batch), self._clock.now()))
                except BaseException as exc:
                    for fut in batch.values():
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for key, fut in batch.items():
                    if not fut.done():
                        fut.set_result(key in marked)
        finally:
            self._flushing = None
