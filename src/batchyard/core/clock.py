"""The one place that reads the wall clock.

Deadlines, expiry, the 24-hour idempotency window and rate limits all read a
``Clock``, so tests move time with ``ManualClock.advance`` instead of sleeping.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock", "isoformat", "parse_iso"]


@runtime_checkable
class Clock(Protocol):
    """Time as the service sees it: UTC wall time, and a way to wait on it."""

    def now(self) -> datetime:
        """Aware UTC datetime."""
        ...

    def time(self) -> float:
        """Seconds since the epoch, for arithmetic in limiters."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told; sleepers wake when time passes them."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._changed: asyncio.Event | None = None

    def now(self) -> datetime:
        return self._now

    def time(self) -> float:
        return self._now.timestamp()

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def set(self, when: datetime) -> None:
        if when.tzinfo is None:
            raise ValueError("ManualClock needs an aware datetime")
        self._now = when
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def sleep(self, seconds: float) -> None:
        wake = self._now + timedelta(seconds=max(0.0, seconds))
        while self._now < wake:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        # Give other tasks a turn, as a real sleep would.
        await asyncio.sleep(0)


def isoformat(when: datetime) -> str:
    """ISO 8601 in UTC with a ``Z``, milliseconds kept: every timestamp on the wire."""
    utc = when.astimezone(UTC)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
