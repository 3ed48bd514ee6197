"""What the gateway knows of one upstream route's request limit, and how it keeps under it.

Hosted providers state their limits per minute but enforce them per second
(3,000 a minute is 50 in any second), so a route is paced two ways:

- a GCRA schedule at the route's rate, shared by every process (``Limiter``),
  slightly under the limit (``margin``) so that the jitter of real sends (an
  event loop that wakes a waiter a few milliseconds late, a socket that
  delivers two requests together) does not tip a second over;
- a local send window: no more than the per-second allowance leaves this
  process in any rolling second, measured at the moment of sending. A
  schedule can only be kept on average; this window is what makes a late
  waiter and the punctual one behind it not count twice in one second.

The rate is the route's declared ``rpm`` when there is one. Without one it is
learned from the upstream: ``x-ratelimit-limit-requests`` on any answer names
it outright; an upstream that only answers 429 (with ``Retry-After``) gets
multiplicative decrease from the rate that was just refused and a slow
increase while nothing more is refused. Until the route has answered once, a
route without a declared rate keeps only a few calls in flight
(``cold_concurrency``), so a flood of clients at start-up does not become a
flood of 429s before the first headers say what the limit is.

Everything here is pure arithmetic on times passed in, so a ``ManualClock``
test drives it step by step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from batchyard.core.limits import RateLimitSignal

__all__ = [
    "BACKOFF_FACTOR",
    "COLD_CONCURRENCY",
    "MAX_MARGIN",
    "PACE_MARGIN",
    "RECOVERY_FACTOR",
    "WINDOW_S",
    "RoutePace",
]

#: The window hosted providers enforce a per-minute limit over.
WINDOW_S = 1.0
#: How far under a known limit the shared schedule runs.
PACE_MARGIN = 0.015
#: The furthest under a declared limit refusals push the schedule.
MAX_MARGIN = 0.1
#: Calls in flight on a route whose limit is unknown, before its first answer.
COLD_CONCURRENCY = 8
#: A refused learned rate is cut to this share of what was being sent.
BACKOFF_FACTOR = 0.9
#: Each refusal-free window, a backed-off rate grows by this factor.
RECOVERY_FACTOR = 1.05


@dataclass
class RoutePace:
    """One route's known request limit, its send window, and how the limit was learned.

    ``source`` is ``"declared"`` (the route's ``rpm``), ``"headers"`` (the
    upstream's ``x-ratelimit-limit-requests``), ``"backoff"`` (learned from
    429s alone), or ``"unknown"`` (nothing yet; none is needed while the
    upstream never refuses).
    """

    declared_rpm: float | None = None
    margin: float = PACE_MARGIN
    learned_rpm: float | None = None
    source: str = "unknown"
    answered: bool = False
    last_refusal: float = -math.inf
    last_growth: float = -math.inf
    _sends: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.declared_rpm:
            self.source = "declared"

    @property
    def rpm(self) -> float | None:
        """The route's request limit a minute, as far as anyone knows."""
        return self.declared_rpm or self.learned_rpm

    @property
    def pace_rpm(self) -> float | None:
        """The rate the shared schedule runs at: the limit less the margin."""
        rpm = self.rpm
        return None if rpm is None else rpm * (1.0 - self.margin)

    @property
    def per_window(self) -> int | None:
        """Sends allowed in any rolling ``WINDOW_S`` (at least one)."""
        rpm = self.rpm
        return None if rpm is None else max(1, math.floor(rpm * WINDOW_S / 60.0 + 1e-9))

    @property
    def cold(self) -> bool:
        """Whether calls should be few in flight: no rate known and no answer seen yet."""
        return self.rpm is None and not self.answered

    def send_delay(self, now: float) -> float:
        """Seconds to wait before the next send keeps the window under its allowance."""
        allowed = self.per_window
        if allowed is None or len(self._sends) < allowed:
            return 0.0
        return max(0.0, self._sends[-allowed] + WINDOW_S - now)

    def sent(self, now: float) -> None:
        """Record a send at ``now``; only the last window's worth is kept."""
        self._sends.append(now)
        keep = max(self.per_window or 0, 1)
        while len(self._sends) > keep and self._sends[0] <= now - WINDOW_S:
            self._sends.popleft()

    def recent_rate(self, now: float) -> float:
        """Sends in the last window, as a rate a minute."""
        count = sum(1 for t in self._sends if t > now - WINDOW_S)
        return count * 60.0 / WINDOW_S

    def answered_with(self, signal: RateLimitSignal | None, now: float) -> None:
        """An answer came back (not a refusal): learn what its headers say."""
        self.answered = True
        self._learn_limit(signal)
        self._grow(now)

    def refused(self, signal: RateLimitSignal | None, now: float) -> None:
        """The upstream answered 429: learn its limit, or back off from what was sent."""
        self.answered = True
        if self.declared_rpm:
            # Refused under a declared limit: sends land bunched (a loaded
            # machine, a slow upstream), so keep further under it from now on.
            self.margin = min(MAX_MARGIN, self.margin + PACE_MARGIN)
            self.last_refusal = now
            return
        if self._learn_limit(signal):
            self.last_refusal = now
            return
        sending = self.recent_rate(now)
        if sending < 2 * 60.0 / WINDOW_S and self.learned_rpm is None:
            # One call refused says when to come back (its Retry-After), not how fast.
            self.last_refusal = now
            return
        candidates = [x for x in (self.learned_rpm, sending) if x]
        base = min(candidates)
        self.learned_rpm = max(1.0, base * BACKOFF_FACTOR)
        self.source = "backoff"
        self.last_refusal = now
        self.last_growth = now

    def _learn_limit(self, signal: RateLimitSignal | None) -> bool:
        if self.declared_rpm or signal is None or not signal.limit_requests:
            return False
        if signal.limit_requests > 0:
            self.learned_rpm = float(signal.limit_requests)
            self.source = "headers"
            return True
        return False

    def _grow(self, now: float) -> None:
        """A backed-off rate creeps up again, a window at a time, while nothing is refused."""
        if self.source != "backoff" or self.learned_rpm is None:
            return
        if now - self.last_refusal < WINDOW_S or now - self.last_growth < WINDOW_S:
            return
        self.learned_rpm *= RECOVERY_FACTOR
        self.last_growth = now
