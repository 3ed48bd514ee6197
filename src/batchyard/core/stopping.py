"""When to stop waiting: backward induction over the checks left, on scenarios.

An item that could be dispatched now at cost ``c`` should wait only if the
best policy from the next check on is expected to pay less than ``c``. That
is an optimal stopping problem. Given scenarios of what the market will offer
(``batchyard.core.outlook``, or in the benchmark the law that made the
prices), ``solve`` runs the backward induction from each deadline to the next
check: at every future column it stops where the price there beats the mean
cost of going on, and a scenario where nothing qualified by the deadline costs
``penalty`` (points of the direct price; 300: a miss is three times worse than
paying in full). Re-solved every couple of minutes from the present, that is
the classic rolling-horizon approximation of the optimal policy.

The future is held in *columns*: single checks for the first eight minutes,
then one, four and sixteen minutes wide, out to 25.6 hours. A wide column
holds the deepest price in it; a plan that stops there is charged the middle
of its threshold and that price, since it takes the first check that crosses
the threshold, not necessarily the deepest.

The answer is kept per minimum discount and for a grid of horizons; an item
reads the value at the largest grid horizon not beyond its own deadline (a
plan for an earlier deadline is one the item can follow, so this errs towards
taking the price now).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["CHARGE", "COLUMNS", "HORIZONS", "Columns", "Plans", "solve"]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Columns:
    """Consecutive runs of checks, counted from the next check (0)."""

    offsets: Ints
    widths: Ints

    @classmethod
    def layout(cls, groups: Sequence[tuple[int, int]]) -> Columns:
        """``groups`` of (count, width); each width must divide the offset it starts at."""
        widths = np.concatenate([np.full(count, width) for count, width in groups])
        offsets = np.concatenate([[0], np.cumsum(widths)[:-1]])
        if any(off % w for off, w in zip(offsets.tolist(), widths.tolist(), strict=True)):
            raise ValueError("every column must start at a multiple of its width")
        return cls(offsets.astype(np.int64), widths.astype(np.int64))

    @property
    def ends(self) -> Ints:
        return self.offsets + self.widths


#: 4 minutes of single checks, to 32 minutes in minutes, to 3.7 h in 4 minutes, to 25 h in 16.
COLUMNS = Columns.layout(((16, 1), (28, 4), (48, 16), (80, 64)))
#: Where between a wide column's deepest price (0) and the plan's threshold (1) a stop
#: in it is charged when nothing better is known (``outlook.first_crossing`` measures it).
CHARGE = 0.5
#: Horizons (checks from the next one to the deadline) that plans are solved for.
HORIZONS: Ints = np.unique(np.round(np.geomspace(4, int(COLUMNS.ends[-1]), 24))).astype(np.int64)


class Plans:
    """The best plan's expected cost and its risk, per minimum and horizon.

    ``value[minimum, horizon]``: expected cost, in points of the direct price,
    of going on from the next check; ``assured[minimum, horizon]``: qualifying
    columns that all but the worst ``risk`` share of the scenarios hold before
    the horizon; ``cover``: how many checks the scenarios reach (no plan looks
    beyond).
    """

    def __init__(
        self, minima: Sequence[float], horizons: Ints, value: Floats, assured: Ints, cover: int
    ) -> None:
        self.minima = tuple(float(m) for m in minima)
        self.horizons = horizons
        self.value = value
        self.assured = assured
        self.cover = int(cover)
        # Plain lists: an item looks its plan up at every pass, and numpy calls cost more.
        self._rows = {m: i for i, m in enumerate(self.minima)}
        self._horizons: list[int] = horizons.tolist()
        self._value: list[list[float]] = value.tolist()
        self._assured: list[list[int]] = assured.tolist()

    def lookup(self, minimum: float, horizon: int, safe: int) -> tuple[float, int] | None:
        """(value within ``horizon``, assured chances within ``safe``); None if not solved."""
        row = self._rows.get(minimum)
        if row is None:
            return None
        at = bisect.bisect_right(self._horizons, min(horizon, self.cover)) - 1
        if at < 0:
            return None
        at_safe = bisect.bisect_right(self._horizons, min(safe, self.cover)) - 1
        chances = 0 if at_safe < 0 else self._assured[row][at_safe]
        return self._value[row][at], chances


def solve(
    discounts: Floats,
    minima: Sequence[float],
    cover: int,
    *,
    penalty: float = 300.0,
    risk: float = 0.0,
    columns: Columns = COLUMNS,
    horizons: Ints = HORIZONS,
    regress: bool = True,
    charge: float | Floats = CHARGE,
) -> Plans:
    """Backward induction on ``discounts[scenario, column]`` for each minimum and horizon.

    The continuation value at each column is the mean over scenarios of what
    the plan from the next column on pays in each of them, so a scenario that
    stays dear stays dear: a slow market is not mistaken for a fresh draw
    every check.

    ``charge`` says what a stop in a wide column pays: its deepest price
    (0), the plan's threshold there (1), or a share of the way between; one
    share for every column or one per column.
    """
    charges = np.broadcast_to(np.asarray(charge, dtype=np.float64), columns.widths.shape)
    if not ((charges >= 0) & (charges <= 1)).all():
        raise ValueError("charge is a share from 0 to 1")
    charged: list[float] = np.where(columns.widths > 1, charges, 0.0).tolist()
    n_scen = discounts.shape[0]
    mins = np.asarray(minima, dtype=np.float64)
    hz = horizons[horizons <= cover] if (horizons <= cover).any() else horizons[:1]
    cost = np.ascontiguousarray((100.0 - discounts).T)  # [column, scenario]; inf: nothing payable
    qual = np.ascontiguousarray(
        (discounts.T[:, None, :] >= mins[None, :, None])[:, :, None, :]
    )  # [column, minimum, 1, scenario]
    paid = np.full((len(mins), len(hz), n_scen), float(penalty))
    # Horizons are sorted, so those a column lies within are a suffix of them.
    first_live = np.searchsorted(hz, columns.offsets, side="right")
    useful: list[bool] = np.asarray(qual.any(axis=(1, 2, 3))).tolist()
    share = 1.0 / n_scen
    # Bare ufunc calls: this loop is numpy-call bound, not arithmetic bound.
    add, less_equal, logical_and, copyto = np.add, np.less_equal, np.logical_and, np.copyto
    # The price itself, as the state a continuation is regressed on (Longstaff-Schwartz):
    # in a market that moves slowly, a scenario dear now stays dear for a while.
    u = np.where(np.isfinite(cost), cost / 100.0, 0.0)  # [column, scenario]
    moments = np.stack([np.ones_like(u), u, u**2, u**3, u**4], axis=1)  # [column, power, scenario]
    weights = qual[:, :, 0, :] * 1.0  # [column, minimum, scenario]
    for c in range(len(columns.widths) - 1, -1, -1):
        j = int(first_live[c])
        if j >= len(hz) or columns.offsets[c] >= cover or not useful[c]:
            continue
        part = paid[:, j:, :]
        x = cost[c]
        if regress:
            going_on = _regressed(part, weights[c], moments[c, :3], moments[c])
        else:
            going_on = add.reduce(part, axis=2, keepdims=True)
            going_on *= share
        stop = less_equal(x, going_on)
        logical_and(stop, qual[c], out=stop)
        share_c = charged[c]
        if share_c:
            realised = going_on * share_c + x * (1.0 - share_c)  # inf where x is: never stops
            copyto(part, realised, where=stop)
        else:
            copyto(part, x, where=stop)
    value = paid.mean(axis=2)
    # Chances: qualifying columns wholly before each horizon, in the worst ``risk`` share.
    counts = np.cumsum(qual[:, :, 0, :], axis=0)  # [column, minimum, scenario]
    last = np.searchsorted(columns.ends, hz, side="right") - 1
    held = np.where(last[:, None, None] >= 0, counts[np.maximum(last, 0)], 0)  # [hz, min, scen]
    assured = np.floor(np.quantile(held, risk, axis=2, method="lower")).T.astype(np.int64)
    return Plans(minima, hz, value, assured, cover)


def _regressed(paid: Floats, weight: Floats, basis: Floats, moments: Floats) -> Floats:
    """What going on pays, regressed on a quadratic in the price, per scenario.

    Fitted on the scenarios that could stop here (``weight`` 1, where the
    choice is made); for a minimum with fewer than eight of them, the plain
    mean. ``moments`` are the powers 0-4 of the price, for the normal equations.
    """
    m = weight @ moments.T  # [minimum, 5]: sums of price^0..4 over the fitted scenarios
    # The 3x3 normal equations' inverse by cofactors (symmetric, one per minimum), with
    # a little ridge so that scenarios all at one price give the mean, not a blow-up.
    ridge = 1e-4 * m[:, 0] + 1e-9
    a, b, c, d, e = m[:, 0] + 1e-9, m[:, 1], m[:, 2] + ridge, m[:, 3], m[:, 4] + ridge
    c00, c01, c02 = c * e - d * d, c * d - b * e, b * d - c * c
    c11, c12, c22 = a * e - c * c, b * c - a * d, a * c - b * b
    det = a * c00 + b * c01 + c * c02
    few = (m[:, 0] < 8) | ~(det > 1e-12 * a**3)
    det = np.where(few, 1.0, det)
    inv = np.stack([c00, c01, c02, c01, c11, c12, c02, c12, c22], axis=1).reshape(-1, 3, 3)
    inv /= det[:, None, None]
    rhs = (paid * weight[:, None, :]) @ basis.T  # [minimum, horizon, basis]
    fitted: Floats = (rhs @ inv) @ basis  # [minimum, horizon, scenario]
    if few.any():
        fitted[few] = paid[few].mean(axis=2, keepdims=True)
    return fitted
