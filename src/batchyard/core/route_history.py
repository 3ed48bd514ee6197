"""One route's past, slot by slot: what the waiting policy learns from.

``RouteHistory`` keeps one route's guaranteed discount (the shallowest of its
two rates and of every fallback) at each 15-second slot, the worker's pass
interval: ``nan`` where nobody looked, ``-inf`` where the route had no fresh
payable price. One series per route, not one for the best over all routes:
routes with their own levels, cycles and dips only look alike as a maximum
while the same route stays cheapest. The worker saves it and restores it
(``batchyard.store.market_history``); ``batchyard.core.outlook`` reads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta

import numpy as np
import numpy.typing as npt

__all__ = ["SLOT", "RouteHistory", "slot_index"]

Floats = npt.NDArray[np.float64]

#: One slot per worker pass: the market is checked about every 15 s.
SLOT = timedelta(seconds=15)
_SLOT_S = SLOT.total_seconds()


def slot_index(at: datetime) -> int:
    """The slot ``at`` falls in: the same numbering for every worker and every restart."""
    return int(at.timestamp() // _SLOT_S)


class RouteHistory:
    """One route's guaranteed discount per slot over a trailing ``keep`` slots.

    A slot seen twice (two passes inside 15 s, two workers) keeps the deeper
    discount: a policy acting on either pass could have had it.
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError("a history keeps at least one slot")
        self.keep = keep
        self._first: int | None = None
        self._values: Floats = np.full(0, np.nan)
        self._size = 0

    @property
    def first(self) -> int | None:
        return self._first

    @property
    def last(self) -> int | None:
        return None if self._first is None else self._first + self._size - 1

    def put(self, slot: int, discount: float | None) -> None:
        value = -math.inf if discount is None else float(discount)
        if self._first is None:
            self._first = slot
        if slot <= self._first + self._size - 1 - self.keep:
            return  # older than what is kept
        if slot < self._first:
            self._shift_right(self._first - slot)
        elif slot - self._first >= self.keep + self.keep // 8:
            # Trim in chunks, not on every slot.
            self._drop(slot - self._first + 1 - self.keep)
        pos = slot - self._first
        if pos >= len(self._values):
            grown = np.full(max(pos + 1, 2 * len(self._values), 1024), np.nan)
            grown[: self._size] = self._values[: self._size]
            self._values = grown
        if pos >= self._size:
            self._values[self._size : pos + 1] = np.nan
            self._size = pos + 1
        old = self._values[pos]
        self._values[pos] = value if math.isnan(old) else max(old, value)

    def _shift_right(self, by: int) -> None:
        assert self._first is not None
        grown = np.full(max(len(self._values), self._size + by) + 256, np.nan)
        grown[by : by + self._size] = self._values[: self._size]
        self._values = grown
        self._first -= by
        self._size += by

    def _drop(self, count: int) -> None:
        assert self._first is not None
        if count >= self._size:
            self._size = 0
        else:
            self._values[: self._size - count] = self._values[count : self._size].copy()
            self._size -= count
        self._first += count

    def window(self, start: int, stop: int) -> Floats:
        """Slots ``start`` to ``stop - 1``: ``nan`` where nothing was recorded."""
        out = np.full(max(0, stop - start), np.nan)
        if self._first is None or stop <= start:
            return out
        lo = max(start, self._first)
        hi = min(stop, self._first + self._size)
        if hi > lo:
            out[lo - start : hi - start] = self._values[lo - self._first : hi - self._first]
        return out

    def span(self) -> int:
        """Slots from the first observation to the last."""
        return self._size

    def saved(self, since: int | None = None) -> list[tuple[int, float | None]]:
        """(slot, discount or None) per observed slot from ``since``, as ``restore`` takes them."""
        if self._first is None:
            return []
        skip = 0 if since is None else max(0, since - self._first)
        values = self._values[skip : self._size]
        seen = np.flatnonzero(~np.isnan(values))
        return [
            (self._first + skip + int(i), None if math.isinf(v) else float(v))
            for i, v in zip(seen.tolist(), values[seen].tolist(), strict=True)
        ]

    def restore(self, slots: Iterable[tuple[int, float | None]]) -> None:
        """Merge saved slots in (a restarted worker picks up where it left off)."""
        for slot, value in sorted(slots, key=lambda s: s[0]):
            self.put(slot, value)
