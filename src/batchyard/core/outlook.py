"""What followed moments like this one, in a market's own past.

``DeadlineAware`` (``batchyard.core.market``) must decide, for an item that
could be dispatched now, whether waiting for a deeper discount is worth it
and whether it is safe. Prices that swing daily, drift or dip are not a run
of independent draws: what comes next depends on where the market is and
where it is heading. So the answer is read from *analogues* (Lorenz's method
of analogues): the moments in the recent past whose last few hours looked
most like the last few hours now, and what each of them went on to offer.

* ``MarketHistory`` keeps, per market, the deepest discount on offer in each
  2-minute bin over a trailing ``memory`` (seven days by default), ``-inf``
  where no route had a fresh payable price. It can be saved and restored, so
  a restarted worker does not start blind.
* ``Outlook`` is one snapshot of it. For an item needing ``minimum`` with
  ``bins`` left, ``waiting`` takes the ``k`` analogues whose own future is at
  least that long, and simulates every simple plan "take the first price at
  least as deep as tau, else whatever qualifies at the end" on each of their
  futures. It returns the share of futures that held any qualifying price
  (``chance``) and the expected cost of the best plan (``cost``, in points of
  the direct price; a future with nothing at the end costs ``penalty``).

Each analogue's future is shifted by the small difference between its level
and the level now (at most ``shift`` points), so that a neighbour matched a
little higher or lower does not pass its luck on. The shift is capped: a
neighbour in another regime (the base price when the market is in a dip)
must not have its whole future lifted by the dip.

Discounts here are floats: they only rank and estimate, never authorise a
spend or count money (``qualifies`` does that, exactly, on fresh prices).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import numpy.typing as npt

__all__ = ["BIN", "Analogues", "MarketHistory", "Outlook", "bin_index"]

_NOTHING = -math.inf
#: The width of a history bin: a few worker passes, short enough for a 5-minute dip.
BIN = timedelta(minutes=2)
Floats = npt.NDArray[np.float64]

#: How far back an analogue's shape is compared, in bins (2 min each): now,
#: 10 and 30 minutes, 1, 2 and 4 hours ago. Enough to tell the falling side of
#: a daily swing from the rising side, the start of a dip from its end.
LAGS = (0, 5, 15, 30, 60, 120)
#: Where no price was ever seen, a shape counts this level (below any payable one).
_UNSEEN = -10.0


@dataclass(frozen=True, slots=True)
class Analogues:
    """How analogues are found and judged; defaults chosen with ``bench/market.py``."""

    #: How many analogues a forecast rests on.
    k: int = 30
    #: The least distance between two analogues, in bins: neighbouring bins share
    #: almost all their future, and thirty of them are one future counted thirty times.
    spacing: int = 5
    #: The most an analogue's future is shifted towards the level now, in points.
    shift: float = 3.0
    #: The root-mean-square difference of shape, in points, beyond which a past
    #: moment is no analogue at all (a young history has few that qualify).
    unlike: float = 20.0
    #: The bins before the deadline whose price a plan falls back on.
    tail: int = 3
    #: What a future with nothing qualifying at the end costs, in points of the
    #: direct price (100: paying it in full; 300: a miss is three times worse).
    penalty: float = 300.0

    def __post_init__(self) -> None:
        if self.k < 3 or self.spacing < 1 or self.tail < 1:
            raise ValueError("analogues need k >= 3, spacing >= 1 and tail >= 1")
        if self.shift < 0 or self.penalty < 0 or self.unlike <= 0:
            raise ValueError("shift and penalty cannot be negative, unlike must be positive")


class Outlook:
    """Analogues of the present, found once per bin and shared by every item."""

    def __init__(self, bins: Sequence[float], analogues: Analogues | None = None) -> None:
        self.settings = settings = analogues or Analogues()
        values = np.asarray(bins, dtype=np.float64)
        self._values = values
        self._filled = _carry_forward(values)
        n = len(values)
        self._now = n - 1
        self._level = float(self._filled[-1]) if n else _UNSEEN
        lags = np.asarray(LAGS)
        # Every past moment with a full shape and at least one bin of future.
        starts = np.arange(int(lags[-1]), n - 1)
        if len(starts):
            shapes = self._filled[starts[:, None] - lags[None, :]]
            here = self._filled[self._now - lags]
            distance = ((shapes - here) ** 2).mean(axis=1)
            # A moment that does not look like now is no analogue of it,
            # however few better ones there are.
            alike = distance <= settings.unlike**2
            self._ranked = starts[alike][np.argsort(distance[alike], kind="stable")]
        else:
            self._ranked = starts
        self._outages = _outages(values)
        self._futures: dict[tuple[int, float], _Futures | None] = {}
        self._answers: dict[tuple[int, float], tuple[float, float] | None] = {}

    def waiting(self, bins: int, minimum: float) -> tuple[float, float] | None:
        """(chance, cost) of waiting ``bins`` more bins; None without enough analogues."""
        if bins < 1:
            return None
        key = (bins, minimum)
        if key in self._answers:
            return self._answers[key]
        plans = (_horizon(bins), minimum)
        if plans not in self._futures:
            self._futures[plans] = self._plans(*plans)
        futures = self._futures[plans]
        answer = None if futures is None else futures.at(min(bins, futures.horizon))
        self._answers[key] = answer
        return answer

    def _apart(self, ranked: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The ``k`` best analogues at least ``spacing`` bins from each other.

        Neighbouring bins share almost all their future: thirty of them are
        one future counted thirty times, and would make a rare outcome look
        certain.
        """
        taken: list[int] = []
        for start in ranked.tolist():
            if all(abs(start - other) >= self.settings.spacing for other in taken):
                taken.append(start)
                if len(taken) == self.settings.k:
                    break
        return np.asarray(taken, dtype=np.int64)

    def _plans(self, horizon: int, minimum: float) -> _Futures | None:
        # Only analogues whose future is known for the whole horizon. A future
        # cut short by "now" would pass its last bin off as the deadline, where
        # something usually still qualifies: too short a history is no history.
        whole = self._ranked[self._now - self._ranked > horizon]
        chosen = self._apart(whole)
        if len(chosen) < self.settings.k:
            return None
        rows = self._values[chosen[:, None] + 1 + np.arange(horizon)[None, :]]
        shift = self.settings.shift
        lift = np.clip(self._level - self._filled[chosen], -shift, shift)
        return _Futures(rows + lift[:, None], minimum, self.settings, self._outages)


class _Futures:
    """The analogues' futures for one minimum, and every threshold plan on them."""

    def __init__(self, rows: Floats, minimum: float, settings: Analogues, outages: Floats) -> None:
        tail = settings.tail
        self.outages = outages
        self.horizon = rows.shape[1]
        self.minimum = minimum
        self.penalty = settings.penalty
        self.best = np.maximum.accumulate(rows, axis=1)  # the deepest seen so far
        # The fallback of every plan: the deepest price in the last ``tail`` bins.
        end = rows.copy()
        for back in range(1, tail):
            end[:, back:] = np.maximum(end[:, back:], rows[:, :-back])
        self.end = end
        # Plans: take the first bin at least tau deep, tau from the minimum up.
        self.taus = np.arange(minimum, 100.0 + 1e-9, 2.0)
        # The running best is sorted, so the first bin reaching tau is a search.
        self.first = np.stack([np.searchsorted(row, self.taus) for row in self.best])
        last = self.horizon - 1
        self.got = np.take_along_axis(self.best, np.minimum(self.first, last), axis=1)

    def at(self, bins: int) -> tuple[float, float]:
        last = bins - 1
        chance = float((self.best[:, last] >= self.minimum).mean())
        end = self.end[:, last]
        fallback = np.where(end >= self.minimum, 100.0 - end, self.penalty)
        # Thirty futures rarely show the feed going dark at the very end; the
        # whole history knows how often it does, and for how long.
        dark = float(self.outages[min(last, len(self.outages) - 1)])
        fallback = (1 - dark) * fallback + dark * self.penalty
        cost = np.where(self.first <= last, 100.0 - self.got, fallback[:, None])
        return chance, float(cost.mean(axis=0).min())


class MarketHistory:
    """The best discount a market offered in each bin, over a trailing ``memory``.

    Bins with no observation at all (the worker was idle) count as nothing
    on offer: unknown is treated as unavailable, which only makes the policy
    more careful.
    """

    def __init__(
        self,
        memory: timedelta = timedelta(days=7),
        bin_width: timedelta = BIN,
        analogues: Analogues | None = None,
    ) -> None:
        self.bin_s = bin_width.total_seconds()
        self._keep = int(memory.total_seconds() // self.bin_s)
        self._first: int | None = None  # bin index of self._bins[0]
        self._bins: list[float] = []
        self._last_at: datetime | None = None
        self._analogues = analogues or Analogues()
        self._outlook: Outlook | None = None
        self._outlook_bin: int | None = None

    def index(self, now: datetime) -> int:
        return bin_index(now, self.bin_s)

    def add(self, now: datetime, discount: float | None) -> None:
        if self._last_at is not None and now <= self._last_at:
            return  # several items ask in one pass; one sample is enough
        self._last_at = now
        self._put(self.index(now), _NOTHING if discount is None else discount)

    def _put(self, index: int, value: float) -> None:
        if self._first is None:
            self._first = index
        pos = index - self._first
        if pos < 0:
            return  # older than what is kept
        if pos >= len(self._bins):
            self._bins.extend([_NOTHING] * (pos + 1 - len(self._bins)))
        self._bins[pos] = max(self._bins[pos], value)
        extra = len(self._bins) - self._keep
        if extra > self._keep // 8:  # trim in chunks, not on every bin
            del self._bins[:extra]
            self._first += extra

    def span(self) -> timedelta:
        return timedelta(seconds=len(self._bins) * self.bin_s)

    def saved(self, since: int | None = None) -> list[tuple[int, float | None]]:
        """(bin index, best discount or None) per bin from ``since``, as ``restore`` takes them."""
        first = self._first or 0
        skip = 0 if since is None else max(0, since - first)
        return [
            (first + i, None if v == _NOTHING else v)
            for i, v in enumerate(self._bins[skip:], start=skip)
        ]

    def restore(self, bins: Iterable[tuple[int, float | None]]) -> None:
        """Merge saved bins in (a restarted worker picks up where it left off)."""
        for index, value in sorted(bins):
            self._put(index, _NOTHING if value is None else value)
        self._outlook = None

    def outlook(self, now: datetime) -> Outlook:
        """Analogues of ``now``, recomputed once per bin."""
        index = self.index(now)
        if self._outlook is None or self._outlook_bin != index:
            self._outlook = Outlook(self._bins, self._analogues)
            self._outlook_bin = index
        return self._outlook


def bin_index(at: datetime, width_s: float = BIN.total_seconds()) -> int:
    """The bin ``at`` falls in: the same numbering for every worker and every restart."""
    return int(at.timestamp() // width_s)


def _horizon(bins: int) -> int:
    # Items' windows are 1 h, 6 h or 24 h: analogues are chosen per class of
    # horizon, so a 1 h item still learns from the last day's moments.
    for step in (32, 192, 736):
        if bins <= step:
            return step
    return bins


def _outages(values: Floats, longest: int = 800) -> Floats:
    """P(the last bins of a window of n bins fall in an outage that began inside it), per n.

    An outage is a run of bins with nothing on offer after one with a price.
    Outages start at rate h per bin with durations D, so the chance is
    h x sum over s < n of P(D > s) (capped at 1).
    """
    seen = values > _NOTHING
    starts = np.flatnonzero(seen[:-1] & ~seen[1:]) + 1
    if not len(starts) or not len(values):
        return np.zeros(longest)
    ends = np.append(np.flatnonzero(~seen[:-1] & seen[1:]) + 1, len(values))
    # Each outage ends at the first recovery after it began (or is still on).
    durations = ends[np.searchsorted(ends, starts, side="right")] - starts
    rate = len(starts) / len(values)
    survive = (durations[None, :] > np.arange(longest)[:, None]).mean(axis=1)
    return np.minimum(1.0, rate * np.cumsum(survive))


def _carry_forward(values: Floats) -> Floats:
    """The last price seen at each bin: a feed outage hides the level, it does not end it."""
    seen = values > _NOTHING
    if not seen.any():
        return np.full(len(values), _UNSEEN)
    last = np.where(seen, np.arange(len(values)), 0)
    np.maximum.accumulate(last, out=last)
    filled = values[last]
    filled[~seen & (np.cumsum(seen) == 0)] = _UNSEEN
    return filled
