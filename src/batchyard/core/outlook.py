"""What a market's recent past says about the discounts the next hours may bring.

``DeadlineAware`` (``batchyard.core.market``) must decide, for an item that
could be dispatched now, whether waiting is worth it and whether it is safe.
Both answers come from one object per market: the best discount on offer at
each worker pass, kept for a trailing ``memory`` in short bins. From it:

* ``reserve(window, q)``: the ``q`` quantile of *the best discount seen in a
  window of that length*, over every such window of the past. Holding out for
  it is the classic reserve price of online selling: an offer at least that
  good is one that a window of the same length usually does not beat.
* ``chance(window, minimum)``: the share of past windows of that length that
  held any price at ``minimum`` or better. Stale gaps count as nothing on
  offer, so a feed that drops out lowers it.
* ``move``: the largest drop of the best discount between two passes. A
  discount within that of the item's minimum can vanish at the next pass.
* ``stopping(minimum, miss)``: optimal-stopping thresholds by backward
  induction (``OptimalStopping``), treating the market as a run of
  independent draws from the per-bin distribution, one draw per
  ``decorrelation`` (the lag after which the trace forgets its level):
  a 15 s pass is not a fresh draw on a market that moves by the hour.

Discounts here are floats: they only rank and estimate, never authorise a
spend or count money (``qualifies`` does that, exactly, on fresh prices).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from datetime import datetime, timedelta

__all__ = ["MarketHistory", "Outlook"]

_NOTHING = -math.inf


class Outlook:
    """Window statistics computed from one snapshot of a market's history."""

    def __init__(self, bins: list[float], bin_s: float, move: float) -> None:
        self.bin_s = bin_s
        self.move = move
        self._total = len(bins)
        # Per-bin best discounts that were on offer, ascending, with suffix sums.
        self._values = sorted(b for b in bins if b > _NOTHING)
        self._suffix = [0.0] * (len(self._values) + 1)
        for i in range(len(self._values) - 1, -1, -1):
            self._suffix[i] = self._suffix[i + 1] + self._values[i]
        self._stopping: dict[tuple[float, float], list[float]] = {}
        #: How long the trace takes to forget its level (autocorrelation below 1/e).
        self.decorrelation = timedelta(seconds=bin_s * _decorrelation_bins(bins))
        self._lengths: list[int] = []  # window lengths in bins, ascending
        self._maxima: list[list[float]] = []  # per length: sorted best discounts
        n = len(bins)
        table = _sparse_max(bins)
        length = 1
        while length <= max(1, n // 2):
            stride = max(1, (n - length) // 240)
            maxima = sorted(
                _range_max(table, s, s + length) for s in range(0, n - length + 1, stride)
            )
            self._lengths.append(length)
            self._maxima.append(maxima)
            length = max(length + 1, int(length * 1.2))

    def _for(self, window: timedelta) -> list[float]:
        # The longest tabulated window that fits: a shorter one holds fewer
        # chances, so the estimate errs towards dispatching sooner.
        want = max(1, int(window.total_seconds() // self.bin_s))
        index = max(0, bisect_left(self._lengths, want + 1) - 1)
        return self._maxima[index]

    def reserve(self, window: timedelta, q: float) -> float:
        maxima = self._for(window)
        return maxima[min(len(maxima) - 1, int(q * len(maxima)))]

    def chance(self, window: timedelta, minimum: float) -> float:
        maxima = self._for(window)
        return 1 - bisect_left(maxima, minimum) / len(maxima)

    def draws(self, window: timedelta) -> int:
        """Independent looks at the market a window holds (at least the current one)."""
        tau = max(self.decorrelation.total_seconds(), self.bin_s)
        return 1 + int(window.total_seconds() // tau)

    def stopping(self, minimum: float, miss: float, draws: int) -> float:
        """The discount worth taking now with ``draws`` looks left, this one included.

        Backward induction: with no look left the item is missed, worth
        ``miss`` (a discount; 0 is paying the direct price). With n looks,
        t_n = E[max(Y, t_{n-1})], where Y is a draw's best discount, counted
        as nothing (keep t_{n-1}) when no route was on offer at ``minimum``.
        Taking the offer now is optimal when it is at least t_{draws-1}.
        Discounts stand in for cost, which falls linearly as they deepen.
        """
        key = (minimum, miss)
        table = self._stopping.get(key)
        if table is None:
            table = self._stopping[key] = [miss]
        start = bisect_left(self._values, minimum)
        total = max(1, self._total)
        while len(table) < draws:
            t = table[-1]
            i = max(start, bisect_left(self._values, t))
            above = len(self._values) - i
            table.append(t + (self._suffix[i] - above * t) / total)
        return table[draws - 1]


class MarketHistory:
    """The best discount a market offered at each pass, binned over ``memory``.

    A bin keeps the best discount seen in it (``-inf`` when nothing had a
    fresh price) and the largest pass-to-pass drop. Bins with no observation
    at all (the worker was idle) also count as nothing on offer: unknown is
    treated as unavailable, which only makes the policy more careful.
    """

    def __init__(
        self,
        memory: timedelta,
        bin_width: timedelta = timedelta(minutes=2),
        refresh: timedelta = timedelta(minutes=20),
    ) -> None:
        self._bin_s = bin_width.total_seconds()
        self._keep = int(memory.total_seconds() // self._bin_s)
        self._refresh = refresh
        self._bins: deque[tuple[int, float, float]] = deque()  # (index, best, drop)
        self._last: float | None = None
        #: Whether the last change of the best discount was upwards (deeper).
        self.rising = False
        self._last_at: datetime | None = None
        self._outlook: Outlook | None = None
        self._outlook_at: datetime | None = None

    def add(self, now: datetime, discount: float | None) -> None:
        if self._last_at is not None and now <= self._last_at:
            return  # several items ask in one pass; one sample is enough
        index = int(now.timestamp() // self._bin_s)
        value = _NOTHING if discount is None else discount
        drop = 0.0
        if self._last is not None and discount is None:
            drop = math.inf  # the feed went stale: every chance went at once
        elif self._last is not None and discount is not None and self._last > discount:
            drop = self._last - discount
        if self._last is not None and discount is not None and self._last != discount:
            self.rising = discount > self._last
        elif discount is None:
            self.rising = False
        self._last, self._last_at = discount, now
        if self._bins and self._bins[-1][0] == index:
            _, best, worst_drop = self._bins[-1]
            self._bins[-1] = (index, max(best, value), max(worst_drop, drop))
        else:
            if self._bins:  # idle bins in between: nothing known, nothing counted
                for gap in range(self._bins[-1][0] + 1, index):
                    self._bins.append((gap, _NOTHING, 0.0))
            self._bins.append((index, value, drop))
        while self._bins and self._bins[0][0] <= index - self._keep:
            self._bins.popleft()

    def span(self) -> timedelta:
        return timedelta(seconds=len(self._bins) * self._bin_s)

    def outlook(self, now: datetime) -> Outlook:
        """Statistics from the history, recomputed at most every ``refresh``."""
        if (
            self._outlook is None
            or self._outlook_at is None
            or now - self._outlook_at >= self._refresh
        ):
            bins = [best for _, best, _ in self._bins] or [_NOTHING]
            move = max((drop for _, _, drop in self._bins), default=0.0)
            self._outlook = Outlook(bins, self._bin_s, move)
            self._outlook_at = now
        return self._outlook


def _decorrelation_bins(bins: list[float]) -> int:
    """The first lag (in bins, geometric steps) where autocorrelation falls below 1/e.

    Only pairs of bins that both had a price count: a feed outage says
    nothing about how fast prices move, and must not pass for a fresh draw
    (the chance of an outage is ``chance``'s business, not this one's).
    """
    n = len(bins)
    seen = [b for b in bins if b > _NOTHING]
    if len(seen) < 4:
        return 1
    mean = sum(seen) / len(seen)
    dev = [b - mean if b > _NOTHING else None for b in bins]
    var = sum((b - mean) ** 2 for b in seen) / len(seen)
    if var <= 0:
        return max(1, n // 2)  # a flat market: no new draw in sight
    lag = 1
    while lag < n // 2:
        pairs = [
            (a, b) for a, b in zip(dev, dev[lag:], strict=False) if a is not None and b is not None
        ]
        if pairs:
            acf = sum(a * b for a, b in pairs) / len(pairs) / var
            if acf < 1 / math.e:
                return lag
        lag = max(lag + 1, int(lag * 1.25))
    return max(1, n // 2)


def _sparse_max(values: list[float]) -> list[list[float]]:
    table = [values]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
        width *= 2
    return table


def _range_max(table: list[list[float]], start: int, stop: int) -> float:
    level = (stop - start).bit_length() - 1
    row = table[level]
    return max(row[start], row[stop - (1 << level)])
