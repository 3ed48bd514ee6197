"""A steady pace shared by every worker of a run.

Hosted limits are enforced per second, not per minute: a whole minute's
requests sent at once are mostly refused. So the pacer hands out send times
one interval apart (GCRA: one timestamp, the next free slot), starting with
the very first request, and a 429's Retry-After moves that timestamp instead
of starting a penalty. Workers that reserved a slot before a push-back see it
when they wake and queue again behind it.

The pacer reads time only through a ``PaceClock`` so tests drive it with a
manual clock; the client may not import the server's clock module, and
``batchyard.core.clock.ManualClock`` fits this protocol as it is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["MonotonicClock", "PaceClock", "Pacer"]


class PaceClock(Protocol):
    def time(self) -> float:
        """Seconds on any steady scale; only differences are used."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The real clock: monotonic, so a wall-clock jump cannot stall or burst a run."""

    def time(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class Pacer:
    """Spaces requests evenly under a requests limit and an input-tokens limit.

    ``headroom`` aims a little under the limit (99% by default) so the small
    jitter of real networks does not land two requests inside one interval of
    the server's limiter. Each 429 also slows the pace by ``slow_down`` (up to
    twice the planned interval), because a 429 under a correct pace may mean
    someone else (another key of the organisation) shares the limit. Each
    answer eases it back by ``slow_down ** (1 / recover_after)``: a 429 that
    was only a request landing a few milliseconds early (the server's own
    processing time varies) must not slow the rest of a long run for good,
    while a limit truly shared settles where a 429 comes about once per
    ``recover_after`` answers.
    """

    def __init__(
        self,
        rpm: float,
        tpm: float | None = None,
        *,
        headroom: float = 0.99,
        slow_down: float = 1.02,
        recover_after: int = 20,
        clock: PaceClock | None = None,
    ) -> None:
        if rpm <= 0:
            raise ValueError("rpm must be positive")
        if tpm is not None and tpm <= 0:
            raise ValueError("tpm must be positive")
        self.clock: PaceClock = clock or MonotonicClock()
        self._request_interval = 60.0 / (rpm * headroom)
        self._token_interval = 60.0 / (tpm * headroom) if tpm else 0.0
        self._factor = 1.0
        self._slow_down = slow_down
        self._ease = slow_down ** (1.0 / max(1, recover_after))
        self._next_at: float | None = None
        self._blocked_until = float("-inf")
        self.push_backs = 0

    @property
    def rpm(self) -> float:
        """The requests a minute this pacer aims at now."""
        return 60.0 / (self._request_interval * self._factor)

    def interval(self, tokens: int = 0) -> float:
        """Seconds this request occupies: whichever limit it would use up first."""
        per_request = max(self._request_interval, tokens * self._token_interval)
        return per_request * self._factor

    async def wait(self, tokens: int = 0) -> None:
        """Return when this request may go; reservation happens without awaiting."""
        while True:
            now = self.clock.time()
            if now < self._blocked_until:
                await self.clock.sleep(self._blocked_until - now)
                continue
            slot = now if self._next_at is None else max(now, self._next_at)
            self._next_at = slot + self.interval(tokens)
            if slot > now:
                await self.clock.sleep(slot - now)
            if self.clock.time() >= self._blocked_until:
                return

    def push_back(self, seconds: float, *, slow: bool = True) -> None:
        """A 429 said to wait ``seconds``: nobody sends before then.

        ``slow=False`` holds the pace without slowing it, for a 429 that only
        says a request landed a moment early (see ``AsyncClient.send_raw``).
        """
        self.push_backs += 1
        until = self.clock.time() + max(0.0, seconds)
        self._blocked_until = max(self._blocked_until, until)
        self._next_at = max(self._next_at or until, until)
        if slow:
            self._factor = min(2.0, self._factor * self._slow_down)

    def answered(self) -> None:
        """A paced request went through: ease a slow-down from earlier 429s."""
        self._factor = max(1.0, self._factor / self._ease)
