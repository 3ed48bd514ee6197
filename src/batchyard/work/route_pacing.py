"""Pacing calls to upstream routes: the shared schedule, the local send window, learning.

The dispatcher asks three things of it per call: ``admit`` (wait for the
route's turn in the shared GCRA schedule, under its declared or learned rate
and its tokens limit, and out any penalty the upstream imposed), ``send``
(wait until sending keeps this process's rolling second under the route's
allowance, then mark the send), and, after the upstream answered,
``answered`` or ``refused`` (what its headers and 429s teach). A route whose
limit is still unknown keeps at most ``COLD_CONCURRENCY`` calls in flight
until it first answers (``cold``). See ``core.route_pace`` for the rules.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from batchyard.core.catalog import RouteSpec
from batchyard.core.clock import Clock
from batchyard.core.limits import Limit, Limiter, RateLimitSignal
from batchyard.core.route_pace import COLD_CONCURRENCY, PACE_MARGIN, RoutePace

__all__ = ["RoutePacer"]


class RoutePacer:
    """Per-process pacing state of every route, over a (possibly shared) limiter."""

    def __init__(
        self,
        clock: Clock,
        limiter: Limiter,
        *,
        margin: float = PACE_MARGIN,
        cold_concurrency: int = COLD_CONCURRENCY,
    ) -> None:
        self.clock = clock
        self.limiter = limiter
        self.margin = margin
        self.cold_concurrency = cold_concurrency
        self._paces: dict[str, RoutePace] = {}
        self._send_locks: dict[str, asyncio.Lock] = {}
        self._cold: dict[str, asyncio.Semaphore] = {}

    def state(self, route: RouteSpec) -> RoutePace:
        pace = self._paces.get(route.id)
        if pace is None or pace.declared_rpm != (route.rpm or None):
            pace = self._paces[route.id] = RoutePace(route.rpm or None, self.margin)
        return pace

    @staticmethod
    def key(route: RouteSpec) -> str:
        return f"route:{route.id}"

    @contextlib.asynccontextmanager
    async def cold(self, route: RouteSpec) -> AsyncIterator[None]:
        """Hold one of the few slots a route gets before its limit is known."""
        if not self.state(route).cold:
            yield
            return
        sem = self._cold.get(route.id)
        if sem is None:
            sem = self._cold[route.id] = asyncio.Semaphore(self.cold_concurrency)
        async with sem:
            yield

    async def admit(self, route: RouteSpec, input_tokens: int, max_output_tokens: int) -> None:
        """Wait for the route's turn in the shared schedule (and out any penalty)."""
        limits: list[tuple[Limit, float]] = []
        rpm = self.state(route).pace_rpm
        if rpm:
            limits.append((Limit("rpm", rpm), 1.0))
        if route.tpm:
            limits.append((Limit("tpm", float(route.tpm)), float(input_tokens + max_output_tokens)))
        # Always ask, even with no limits of its own: the route's penalty (an
        # upstream's Retry-After or exhausted x-ratelimit-*) must hold it too.
        await self.limiter.acquire(self.key(route), limits)

    async def send(self, route: RouteSpec) -> None:
        """Wait until one more send keeps the rolling second under the allowance; mark it."""
        pace = self.state(route)
        if pace.per_window is None:
            pace.sent(self.clock.time())
            return
        lock = self._send_locks.get(route.id)
        if lock is None:
            lock = self._send_locks[route.id] = asyncio.Lock()
        async with lock:
            delay = pace.send_delay(self.clock.time())
            if delay > 0:
                await self.clock.sleep(delay)
            pace.sent(self.clock.time())

    async def answered(self, route: RouteSpec, signal: RateLimitSignal | None) -> None:
        self.state(route).answered_with(signal, self.clock.time())
        if signal is not None:
            await self.limiter.observe(self.key(route), signal)

    async def refused(
        self, route: RouteSpec, retry_after: float, signal: RateLimitSignal | None
    ) -> None:
        """A 429: every caller of the route waits ``retry_after``, and the rate is learned."""
        now = self.clock.time()
        self.state(route).refused(signal, now)
        await self.limiter.penalize(self.key(route), now + retry_after)
