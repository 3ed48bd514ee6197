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

``sync_pacer.py`` is generated from this module for the sync client
(``scripts/gen_sync_client.py``): edit here, then regenerate.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

__all__ = ["MonotonicClock", "PaceClock", "Pacer"]

#: How much one timing-noise 429 widens the margin, as a share of a slot.
_MARGIN_STEP = 0.05


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

    ``headroom`` aims a little under the limit (99% by default). Two kinds of
    429 can still come back, and they call for different answers:

    - *Timing noise*: the server checks its limit only after some work of its
      own (the key lookup, the idempotency claim), and that work varies by
      milliseconds, so a request sent on time can land a little early. The
      429 asks for a wait under half a slot. The pacer learns a *margin* that
      it adds to every interval: each such 429 widens it by a step, each
      answer narrows it by a step ``noise_429s`` times smaller, so it settles
      where about that share of requests draws a 429 (the margin where the
      server's jitter exceeds it that often). Steps are a share of the slot,
      not the 429's own wait, so one stall of the server cannot make the
      rest of the run slow.
    - *A shared limit*: another key of the organisation is using it, and the
      wait is longer. Each such 429 slows the pace by ``slow_down`` (up to
      twice the planned interval); each answer eases it back by
      ``slow_down ** (1 / recover_after)``, so a limit truly shared settles
      where such a 429 comes about once per ``recover_after`` answers, and a
      burst of them early in a long run does not slow the rest of it for good.
    """

    def __init__(
        self,
        rpm: float,
        tpm: float | None = None,
        *,
        headroom: float = 0.99,
        slow_down: float = 1.02,
        recover_after: int = 20,
        noise_429s: float = 0.03,
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
        self._margin = 0.0
        self._margin_up = self._request_interval * _MARGIN_STEP
        self._margin_down = self._margin_up * noise_429s / (1.0 - noise_429s)
        self._next_at: float | None = None
        self._blocked_until = float("-inf")
        self.push_backs = 0
        self._lock = threading.Lock()

    @property
    def rpm(self) -> float:
        """The requests a minute this pacer aims at now."""
        return 60.0 / self.interval()

    @property
    def margin(self) -> float:
        """Seconds added to every interval for the server's timing noise."""
        return self._margin

    def interval(self, tokens: int = 0) -> float:
        """Seconds this request occupies: whichever limit it would use up first."""
        per_request = max(self._request_interval, tokens * self._token_interval)
        return per_request * self._factor + self._margin

    async def wait(self, tokens: int = 0) -> None:
        """Return when this request may go; its slot is taken before any wait."""
        while True:
            delay, reserved = self._reserve(tokens)
            if delay > 0:
                await self.clock.sleep(delay)
            if reserved and self.clock.time() >= self._blocked_until:
                return

    def _reserve(self, tokens: int) -> tuple[float, bool]:
        """Seconds to wait, and whether a slot was taken (not while a push-back holds).

        Under the lock because a pacer may be shared by threads (the sync
        client's); nothing waits while the lock is held.
        """
        with self._lock:
            now = self.clock.time()
            if now < self._blocked_until:
                return self._blocked_until - now, False
            slot = now if self._next_at is None else max(now, self._next_at)
            self._next_at = slot + self.interval(tokens)
            return slot - now, True

    def push_back(self, seconds: float, *, slow: bool = True) -> None:
        """A 429 said to wait ``seconds``: nobody sends before then.

        ``slow=False`` is for timing noise (see the class docstring): the
        wait is learned into the margin instead of slowing the pace.
        """
        with self._lock:
            self.push_backs += 1
            wait = max(0.0, seconds)
            until = self.clock.time() + wait
            self._blocked_until = max(self._blocked_until, until)
            self._next_at = max(self._next_at or until, until)
            if slow:
                self._factor = min(2.0, self._factor * self._slow_down)
            else:
                self._margin = min(self._request_interval, self._margin + self._margin_up)

    def answered(self) -> None:
        """A paced request went through: ease what earlier 429s added."""
        with self._lock:
            self._factor = max(1.0, self._factor / self._ease)
            self._margin = max(0.0, self._margin - self._margin_down)
